"""Pipeline parallelism: layer splits, point-to-point exchanges, schedules and timelines."""

from megalite.pipeline.broadcast import broadcast_from_last_stage
from megalite.pipeline.layer_split import split_layers
from megalite.pipeline.schedules import SCHEDULES, forward_backward, last_stage_rank
from megalite.pipeline.timeline import PipelineRecorder, analytic_bubble, bubble_fraction

__all__ = ["split_layers", "forward_backward", "SCHEDULES", "last_stage_rank", "broadcast_from_last_stage",
           "PipelineRecorder", "bubble_fraction", "analytic_bubble"]
