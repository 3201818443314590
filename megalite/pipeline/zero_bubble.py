"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2024) as per-rank op lists.

An op is ``(kind, microbatch, chunk)`` with kind ``"F"`` (forward), ``"B"``
(input gradient) or ``"W"`` (weight gradient, deferred by the split backward).
The lists are pure functions of (pp, rank, m), so every rank derives the whole
pipeline's plan without communication and tests can compare them with tables.

* ZB-H1: one chunk per rank.  Warm-up and steady phase as 1F1B, but rank ``r``
  keeps its ``r`` most recent W passes pending, then runs them in the
  cool-down, where 1F1B would idle waiting for gradients.  At most ``pp``
  micro-batches hold activations on any rank, as in 1F1B; with equal F, B and W
  times the bubble is ``(pp-1)/(3m+pp-1)``.
* ZBV: two chunks per rank in a V (:class:`megalite.pipeline.stages.StageMap`),
  so rank 0 holds both the first and the last stage and the turn of the V
  happens on the last rank without communication.

:func:`simulate` replays op lists with given op costs (each op waits for the
ops it depends on) and returns the bubble fraction: the analytic bubble of a
schedule under equal costs.
"""

from __future__ import annotations

Op = tuple[str, int, int]


def zb_h1_order(pp: int, rank: int, m: int) -> list[Op]:
    """The ZB-H1 op list of pipeline rank ``rank`` for ``m`` micro-batches."""
    warmup = min(pp - rank - 1, m)
    ops: list[Op] = [("F", i, 0) for i in range(warmup)]
    weights = 0

    def backward(i):
        nonlocal weights
        ops.append(("B", i, 0))
        if i + 1 - weights > rank:  # keep ``rank`` W passes pending
            ops.append(("W", weights, 0))
            weights += 1

    for i in range(m - warmup):
        ops.append(("F", warmup + i, 0))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    ops += [("W", i, 0) for i in range(weights, m)]
    return ops


def zbv_order(pp: int, rank: int, m: int) -> list[Op]:
    """The ZBV op list of pipeline rank ``rank`` (its two chunks in the V of ``StageMap``).

    Warm-up: ``2(pp-rank)-1`` chunk-0 forwards, then ``rank`` pairs of chunk-1 and
    chunk-0 forwards, then ``pp-rank`` chunk-1 F-B-W triples; steady: chunk-0 F-B-W
    and chunk-1 F-B-W; cool-down: ``rank`` B pairs, then chunk-0 B-W pairs, then the
    pending W passes.  The plan is made for at least ``2pp-1`` micro-batches; ops of
    micro-batches beyond ``m`` are dropped, which keeps the order valid.
    """
    n = max(m, 2 * pp - 1)
    ops: list[Op] = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0, ("W", 0): 0, ("W", 1): 0}

    def op(kind, chunk):
        ops.append((kind, count[kind, chunk], chunk))
        count[kind, chunk] += 1

    for _ in range(2 * (pp - rank) - 1):
        op("F", 0)
    for _ in range(rank):
        op("F", 1)
        op("F", 0)
    for _ in range(pp - rank):
        op("F", 1)
        op("B", 1)
        op("W", 1)
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            op("F", 0)
        op("B", 0)
        op("W", 0)
        op("F", 1)
        op("B", 1)
        op("W", 1)
    for _ in range(rank):
        op("B", 0)
        op("B", 1)
    for _ in range(pp - rank):
        op("B", 0)
        op("W", 0)
    while count["W", 1] < count["B", 1]:
        op("W", 1)
    while count["W", 0] < count["B", 0]:
        op("W", 0)
    return [o for o in ops if o[1] < m]


def simulate(orders: list[list[Op]], stage_of, costs: dict[str, float]) -> float:
    """Bubble fraction of running ``orders[rank]`` with op times ``costs`` ({"F", "B", "W"}).

    ``stage_of(rank, chunk)`` gives the pipeline stage; a B with no W in the
    lists (a fused backward) should cost B+W.  Raises ValueError on a deadlock.
    """
    place = {(r, c): stage_of(r, c) for r, order in enumerate(orders) for _, _, c in order}
    last_stage = max(place.values())
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    pos = [0] * len(orders)
    while any(p < len(o) for p, o in zip(pos, orders)):
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, mb, chunk = order[pos[r]]
                stage = place[r, chunk]
                if kind == "F":
                    needs = [("F", mb, stage - 1)] if stage > 0 else []
                elif kind == "B":
                    needs = [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < last_stage else [])
                else:
                    needs = [("B", mb, stage)]
                if any(n not in done for n in needs):
                    break
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = start + costs[kind]
                busy[r] += costs[kind]
                done[kind, mb, stage] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the op lists deadlock at positions {pos}")
    span = max(clock)
    return sum(1.0 - b / span for b in busy) / len(orders)
