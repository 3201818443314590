"""Build this pipeline rank's model chunks: the one place that turns a layer split into modules.

Every caller (the trainer, the RL examples, the training service) asks :func:`build_chunks`, so
each handles one chunk per rank, interleaved virtual stages and the zbv V the same way: chunk
``c`` holds the layers of its stage (:class:`~megalite.pipeline.stages.StageMap`), the first
stage owns the embedding (``pre_process``) and the last the output layer (``post_process``).
"""

from __future__ import annotations

from megalite import topology
from megalite.pipeline.layer_split import split_layers
from megalite.pipeline.stages import StageMap


def build_chunks(provider, num_layers: int, pp_group, *, vpp: int | None = None, schedule: str | None = None,
                 first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                 stage_layers=None) -> list:
    """This pipeline rank's model chunks, in chunk order (a list even for one chunk).

    ``provider(*, pre_process, post_process, layer_range)`` builds one chunk holding global
    layers ``range(*layer_range)``.  ``pp_group`` is the pipeline group (None: the current
    topology's, or a single stage without one).  ``vpp`` is the number of chunks per rank
    (None: one, or two under ``schedule="zbv"``); ``first_stage_layers`` /
    ``last_stage_layers`` fix the layer count of the first / last pipeline stage as in
    :func:`~megalite.pipeline.layer_split.split_layers`, which raises ValueError on an uneven split.
    """
    group = topology.resolve_group(pp_group, "pp")
    pp, rank = topology.group_size(group), topology.group_rank(group)
    stages = StageMap.for_schedule(schedule, pp, vpp)
    ranges = split_layers(num_layers, pp, stages.chunks, first_stage_layers, last_stage_layers, stages.v_shape,
                          stage_layers)
    return [provider(pre_process=stages.is_first(rank, chunk), post_process=stages.is_last(rank, chunk),
                     layer_range=layer_range)
            for chunk, layer_range in enumerate(ranges[rank])]
