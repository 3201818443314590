"""Pipeline parallelism: layer splits, point-to-point exchanges, schedules and timelines."""

from megalite.pipeline.broadcast import broadcast_from_last_stage
from megalite.pipeline.layout import split_layers
from megalite.pipeline.schedules import forward_backward
from megalite.pipeline.timeline import PipelineRecorder, bubble_fraction

__all__ = ["split_layers", "forward_backward", "broadcast_from_last_stage", "PipelineRecorder", "bubble_fraction"]
