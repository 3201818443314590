"""One candidate parallel layout of a training run, as the planner scores it.

A :class:`Layout` holds what the pretraining flags set about parallelism and
precision; :meth:`Layout.from_args` reads it from those flags (the planner's
input may be a launch line), and :meth:`Layout.flags` writes it back, so the
planner's recommendation is a launch line too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from megalite.pipeline.layer_split import split_layers
from megalite.pipeline.stages import StageMap

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@lru_cache(maxsize=65536)
def _split(num_layers: int, pp: int, chunks: int, first, last, v_shape: bool):
    """:func:`split_layers`, remembered: the planner asks for the same splits many times."""
    return split_layers(num_layers, pp, chunks, first, last, v_shape)


@dataclass(frozen=True)
class Layout:
    """Parallel sizes, data-parallel flavour, precision and micro-batching of one run.

    ``cp_comm_type`` is ``--cp-comm-type`` (``p2p``, ``all_gather`` or ``a2a``); ``reshard_after_forward`` is
    FSDP2's ``--[no-]reshard-after-forward``.
    ``world = tp * cp * dp * pp`` for the dense layers and ``etp * ep * expert_dp * pp``
    for the expert layers (the rank grid of :mod:`megalite.topology`).  ``zero1`` is
    ``--use-distributed-optimizer``, ``fsdp`` is ``--use-torch-fsdp2``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    cp_comm_type: str = "p2p"
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    schedule: str | None = None
    zero1: bool = False
    fsdp: bool = False
    reshard_after_forward: bool = True
    precision: str = "fp32"
    grad_reduce_in_fp32: bool = True
    bucket_size: int | None = 40_000_000
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    recompute: str | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Ranks each expert weight is replicated (or FSDP-sharded) over."""
        return self.world // (self.expert_tp * self.ep * self.pp)

    @property
    def param_bytes(self) -> int:
        """Bytes of one model-parameter element (FSDP2 keeps fp32 sharded main weights)."""
        return 4 if self.fsdp else DTYPE_BYTES[self.precision]

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    def stage_map(self) -> StageMap:
        return StageMap.for_schedule(self.schedule, self.pp, self.vpp)

    def chunk_ranges(self, num_layers: int) -> list[list[tuple[int, int]]]:
        """Global layer range of every model chunk, ``[pp_rank][chunk]`` (the trainer's split)."""
        stages = self.stage_map()
        return _split(num_layers, self.pp, stages.chunks, self.first_stage_layers, self.last_stage_layers,
                      stages.v_shape)

    @classmethod
    def from_args(cls, args, world: int) -> "Layout":
        """The layout the pretraining flags ``args`` describe on ``world`` ranks."""
        tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        from megalite.training.flags import ddp_config, fsdp_config

        fsdp = bool(args.use_torch_fsdp2)
        ddp = ddp_config(args)
        return cls(tp=tp, pp=pp, cp=cp, cp_comm_type=args.cp_comm_type, dp=world // (tp * pp * cp),
                   ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                   vpp=args.virtual_pipeline_model_parallel_size,
                   schedule=args.pipeline_schedule, zero1=bool(args.use_distributed_optimizer) and not fsdp,
                   fsdp=fsdp, reshard_after_forward=fsdp_config(args).reshard_after_forward, precision=precision,
                   grad_reduce_in_fp32=fsdp_config(args).grad_reduce_in_fp32 if fsdp else ddp.grad_reduce_in_fp32,
                   bucket_size=ddp.bucket_size, sequence_parallel=bool(args.sequence_parallel),
                   micro_batch_size=args.micro_batch_size, recompute=args.recompute_granularity,
                   first_stage_layers=args.decoder_first_pipeline_num_layers,
                   last_stage_layers=args.decoder_last_pipeline_num_layers)

    def flags(self) -> list[str]:
        """The pretraining flags that launch this layout (sizes left at their default are omitted)."""
        out = []
        for flag, value, default in (("--tensor-model-parallel-size", self.tp, 1),
                                     ("--pipeline-model-parallel-size", self.pp, 1),
                                     ("--context-parallel-size", self.cp, 1),
                                     ("--cp-comm-type", self.cp_comm_type, "p2p"),
                                     ("--expert-model-parallel-size", self.ep, 1),
                                     ("--expert-tensor-parallel-size", self.etp, None),
                                     ("--virtual-pipeline-model-parallel-size", self.vpp, None),
                                     ("--pipeline-schedule", self.schedule, None),
                                     ("--micro-batch-size", self.micro_batch_size, None),
                                     ("--recompute-granularity", self.recompute, None)):
            if value != default:
                out += [flag, str(value)]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.zero1:
            out.append("--use-distributed-optimizer")
        if self.fsdp:
            out.append("--use-torch-fsdp2")
            if not self.reshard_after_forward:
                out.append("--no-reshard-after-forward")
        if self.precision != "fp32":
            out.append(f"--{self.precision}")
        return out
