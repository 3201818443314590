"""The search: every layout of a model on N GPUs, checked, estimated and ranked by tokens/s/GPU.

Axes: tp (powers of two up to a node), pp (dividing the layers, or with the first and last stage
taking the remainder as Llama 3 405B's pp=16 split does), vpp and the four schedules, cp (powers of
two up to 32), ep (dividing the experts), micro-batch size, recompute none/selective/full, and DDP / ZeRO-1 /
FSDP2.  A layout the trainer would refuse is listed with the model's own error message; a layout
that does not fit with how many GiB it misses by.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from megalite.context_parallel import check_context_parallel
from megalite.hardware import Hardware
from megalite.models.config import GPTConfig
from megalite.plan.estimate import RESERVED_FRACTION, Estimate, estimate, fits
from megalite.plan.layout import Layout

GIB = 2 ** 30
MAX_CP = 32


@dataclass
class Plan:
    ranked: list[Estimate]
    infeasible: list[tuple[Layout, str]]
    considered: int


def _powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def pipeline_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None]]:
    """``(first, last)`` stage layer counts to try: even, or the remainder split over the two ends."""
    if num_layers % pp == 0:
        return [(None, None)]
    if pp < 3:
        return []
    per = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * per
    if rest < 2 or rest % 2:
        return []
    return [(rest // 2, rest // 2)]


def check_layout(config: GPTConfig, layout: Layout, seq_length: int, global_batch_size: int) -> str | None:
    """Why the trainer would refuse ``layout``, or None."""
    try:
        config.validate(layout.tp)
        layout.chunk_ranges(config.num_layers)
        check_context_parallel(seq_length, layout.cp)
        if config.moe is not None:
            config.moe.validate(layout.ep, layout.expert_tp)
        elif layout.ep > 1:
            return f"expert parallelism ep={layout.ep} needs an MoE model"
    except ValueError as error:
        return str(error)
    if layout.world % (layout.expert_tp * layout.ep * layout.pp):
        return f"world {layout.world} is not divisible by etp*ep*pp = {layout.expert_tp * layout.ep * layout.pp}"
    if global_batch_size % (layout.micro_batch_size * layout.dp):
        return (f"global batch {global_batch_size} is not divisible by micro batch {layout.micro_batch_size} "
                f"* dp {layout.dp}")
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    # The trainer's rules (megalite/training/arguments.py), restated for speed.
    if (layout.vpp or 1) > 1 and layout.schedule in (None, "interleaved-1f1b") and m % layout.pp:
        return f"the interleaved schedule needs the {m} micro-batches divisible by pp={layout.pp}"
    if layout.fsdp and layout.schedule in ("zero-bubble-h1", "zbv"):
        return f"FSDP2 does not compose with --pipeline-schedule {layout.schedule}"
    if layout.fsdp and layout.dp * layout.cp == 1:
        return "FSDP2 needs dp x cp > 1 to shard over"
    if layout.schedule == "zbv" and layout.pp > 1 and not config.untie_embeddings_and_output_weights:
        return "zbv puts the first and last stage on one rank; tied embeddings need untying"
    return None


def candidates(config: GPTConfig, world: int, hw: Hardware, precision: str, seq_length: int):
    """Every layout of the search space on ``world`` GPUs (unchecked)."""
    experts = config.moe.num_experts if config.moe is not None else 1
    for tp in _powers_of_two(min(hw.gpus_per_node, world)):
        for pp in [p for p in range(1, min(world, config.num_layers) + 1) if world % (tp * p) == 0]:
            for first, last in pipeline_splits(config.num_layers, pp):
                schedules = [("1f1b", None), ("zero-bubble-h1", None)] if pp > 1 else [(None, None)]
                if pp > 1:
                    schedules += [("interleaved-1f1b", v) for v in (2, 4, 8)] + [("zbv", None)]
                for cp in _powers_of_two(min(world // (tp * pp), seq_length // 2, MAX_CP)):
                    dp = world // (tp * pp * cp)
                    for ep in [e for e in _powers_of_two(experts) if experts % e == 0 and world % (tp * e * pp) == 0]:
                        for (schedule, vpp), flavour in itertools.product(schedules, ("ddp", "zero1", "fsdp")):
                            yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp, schedule=schedule,
                                         zero1=flavour == "zero1", fsdp=flavour == "fsdp", precision=precision,
                                         sequence_parallel=tp > 1, first_stage_layers=first,
                                         last_stage_layers=last)


def plan(config: GPTConfig, world: int, hw: Hardware, *, seq_length: int, global_batch_size: int,
         precision: str = "bf16", micro_batch_sizes=(1, 2, 4, 8), recomputes=(None, "selective", "full"),
         layouts=None) -> Plan:
    """Rank every valid layout that fits; list the others with their reason."""
    ranked, infeasible, considered = [], [], 0
    cache: dict = {}
    for base in (layouts if layouts is not None else candidates(config, world, hw, precision, seq_length)):
        reason = check_layout(config, base, seq_length, global_batch_size)
        if reason is not None:
            considered += 1
            infeasible.append((base, reason))
            continue
        best_missing, fitted = None, False
        for mbs, recompute in itertools.product(micro_batch_sizes, recomputes):
            layout = base.with_(micro_batch_size=mbs, recompute=recompute)
            considered += 1
            if global_batch_size % (mbs * layout.dp):
                continue
            est = estimate(config, layout, hw, seq_length, global_batch_size, cache)
            if fits(est, hw):
                ranked.append(est)
                fitted = True
            else:
                missing = est.memory_total - hw.hbm_bytes * (1 - RESERVED_FRACTION)
                best_missing = missing if best_missing is None else min(best_missing, missing)
        if not fitted and best_missing is not None:
            infeasible.append((base, f"does not fit by {best_missing / GIB:.2f} GiB"))
    ranked.sort(key=lambda e: -e.tokens_per_s_per_gpu)
    return Plan(ranked, infeasible, considered)
