"""Pipeline parallelism: stage map, layer splits, chunk building, point-to-point exchanges, schedules and timelines."""

from megalite.pipeline.broadcast import broadcast_from_last_stage
from megalite.pipeline.chunks import build_chunks
from megalite.pipeline.layer_layout import LayerLayout, accounted_layout, parse_layout, split_flags_layout
from megalite.pipeline.layer_split import split_layers
from megalite.pipeline.schedules import SCHEDULES, forward_backward
from megalite.pipeline.stages import StageMap, last_stage_rank
from megalite.pipeline.timeline import PipelineRecorder, analytic_bubble, bubble_fraction

__all__ = ["StageMap", "split_layers", "LayerLayout", "parse_layout", "accounted_layout", "split_flags_layout",
           "build_chunks",
           "forward_backward", "SCHEDULES", "last_stage_rank",
           "broadcast_from_last_stage", "PipelineRecorder", "bubble_fraction", "analytic_bubble"]
