"""``--calibrate``: measure this machine's compute rates, memory bandwidth and collective bandwidth, per rank.

A CPU rank runs one thread on a core of its own, so every rate is one thread's.  The GEMMs of a micro-batch through
a one-layer megalite GPT of width 512 (QKV, projection, MLP and output layer; forward, input gradient and weight
gradient), timed op by op as the step runs them between its other ops, at a few row counts give how the rate
falls with fewer rows: the fit of ``seconds per FLOP = (1 + gemm_half_rows / rows) / peak`` gives the profile's
peak (with ``efficiency`` 1: the model's large GEMMs run at what this machine's do inside a step) and
``gemm_half_rows``; the other precisions scale it by their square GEMM's rate over fp32's.  Torch's fused causal
attention, forward and backward, at head dimensions 32 and 64 gives ``attention_efficiency`` (its FLOPs' rate over
that peak) and ``attention_score_s`` (its softmax's cost per score, :func:`fit_attention`); a 64 MiB copy the memory
bandwidth; ``torch.exp`` over a score tile ``exp_rate``; a chain of one-element multiplications through autograd,
forward and backward, the time an op costs beyond its work (``op_overhead_s``); the core count how many ranks run
at once (``cores``).  The all-reduce of a few MiB between two gloo ranks gives the link bandwidth and the
all-reduce of one element its latency; each collective a step runs (all-reduce, all-gather, reduce-scatter,
send/recv), at one element and at 128 KiB, 1 MiB and 8 MiB between two ranks that both compute between the calls
(as every core does in a step of a layout with as many ranks as cores), its CPU cost per call by its bytes
(``collective_cpu``) and the time a rank waits in it beyond that CPU (``collective_wait``; :func:`_busy_rounds`), at
two lengths of the compute between the calls (``collective_wait_per_compute`` and ``collective_cpu_per_compute``:
how the wait and the CPU grow with it).  The compute timings take
the median of ten runs in the process's CPU time (what an op typically costs as a step pays it, not the luckiest
run; the time it ran, not the time it waited for a core on a shared machine); the link's bandwidth and latency the
best of ten wall-clock runs (the least preempted); the collectives' costs where every core computes the mean a step
pays, robustly (:func:`median_of_means` over interleaved rounds).
"""

from __future__ import annotations

import statistics
import time

from megalite.hardware import Hardware, save_hardware


def _timed(fn, repeats: int = 10, clock=time.process_time, pick=statistics.median) -> float:
    """``pick`` of ``repeats`` timings of ``fn`` on ``clock``, after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return pick(times)


CALIBRATION_ROWS = (16, 64, 256, 1024)


def gemm_flops(dtype_name: str, n: int = 512, rows: int | None = None) -> float:
    """FLOP/s of a linear layer's GEMMs: ``[rows, n] x [n, n]``, its input gradient and its weight gradient
    (square without ``rows``), hot in cache: the other precisions' rates relative to fp32."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    rows = n if rows is None else rows
    x, w = torch.randn(rows, n, dtype=dtype), torch.randn(n, n, dtype=dtype)

    def linear():
        y = torch.matmul(x, w.t())
        torch.matmul(y, w)
        torch.matmul(y.t(), x)

    return 6 * rows * n * n / _timed(linear)


def step_gemm_flops(rows: int, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of the fp32 GEMMs (``mm``, ``addmm``, ``bmm``) of one micro-batch of ``rows`` tokens through a
    one-layer megalite GPT of width ``n`` (its QKV, projection, MLP and output-layer GEMMs, forward and backward,
    accumulating into existing gradients), timed op by op in process CPU time: the GEMMs as a step runs them,
    between its norms, activations, attention and allocations (operands out of cache, fresh outputs), not one
    GEMM repeated hot.  Only the GEMMs are timed."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megalite.models.config import GPTConfig
    from megalite.models.gpt import GPTModel

    aten = torch.ops.aten
    flops_of = {aten.mm.default: lambda a, b: 2 * a.shape[0] * a.shape[1] * b.shape[1],
                aten.addmm.default: lambda c, a, b: 2 * a.shape[0] * a.shape[1] * b.shape[1],
                aten.bmm.default: lambda a, b: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]}

    class GemmTimer(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds = self.flops = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in flops_of:
                return func(*args, **(kwargs or {}))
            start = time.process_time()
            out = func(*args, **(kwargs or {}))
            self.seconds += time.process_time() - start
            self.flops += flops_of[func](*args[:3])
            return out

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=n, num_attention_heads=8, vocab_size=n,
                               max_position_embeddings=rows))
    ids = torch.randint(0, n, (1, rows))

    def micro_batch() -> GemmTimer:
        with GemmTimer() as timer:
            model(ids, ids).sum().backward()
        return timer

    micro_batch()
    timers = sorted((micro_batch() for _ in range(repeats)), key=lambda t: t.seconds)
    return timers[len(timers) // 2].flops / timers[len(timers) // 2].seconds


def attention_flops(batch: int = 1, heads: int = 8, seq: int = 512, head_dim: int = 64) -> float:
    """FLOP/s of fp32 causal ``scaled_dot_product_attention`` forward and backward, its FLOPs counted as
    :func:`~megalite.models.config.gpt_flops_per_token` counts them (``3 x 4 b s^2 heads d``, no causal
    discount)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    grad = torch.ones(batch, heads, seq, head_dim)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return 3 * 4 * batch * heads * seq * seq * head_dim / _timed(step)


def fit_attention(head_dims=(32, 64)) -> tuple[float, float]:
    """``(FLOP/s, seconds per score)`` of fp32 causal attention, forward and backward: its time at two head
    dimensions (same heads and sequence, so the same ``heads x seq^2`` scores and FLOPs in proportion to the head
    dimension) split as ``FLOPs / rate + scores x seconds per score``, the latter the softmax's work per score
    (exponentials, scaling, masking), which does not shrink with the head dimension.  Scores and FLOPs are counted
    over the whole ``seq x seq``, as :func:`attention_flops` counts them."""
    batch, heads, seq = 1, 8, 512
    seconds = [3 * 4 * batch * heads * seq * seq * d / attention_flops(batch, heads, seq, d) for d in head_dims]
    flops = [3 * 4 * batch * heads * seq * seq * d for d in head_dims]
    per_flop = (seconds[1] - seconds[0]) / (flops[1] - flops[0])
    per_score = (seconds[0] - flops[0] * per_flop) / (batch * heads * seq * seq)
    if per_flop <= 0 or per_score < 0:  # a noisy pair: all of it FLOPs, at the larger head dimension's rate
        return flops[1] / seconds[1], 0.0
    return 1 / per_flop, per_score


def op_overhead(chain: int = 200) -> float:
    """Seconds an op costs beyond its work: a chain of ``chain`` one-element multiplications through autograd,
    forward and backward (one op each way), over the ``2 * chain`` ops."""
    import torch

    x = torch.ones(1, requires_grad=True)

    def step():
        y = x
        for _ in range(chain):
            y = y * 1.0
        y.backward()

    return _timed(step) / (2 * chain)


def exp_rate(shape=(8, 256, 256)) -> float:
    """fp32 elements per second of ``torch.exp`` over a score tile (``[heads, queries, keys]``), out of place."""
    import torch

    x, out = torch.randn(shape), torch.empty(shape)
    return x.numel() / _timed(lambda: torch.exp(x, out=out))


def fit_gemm_curve(rows, flops) -> tuple[float, float]:
    """``(peak, half_rows)`` of ``flops[i] = peak * rows[i] / (rows[i] + half_rows)``, least squares on
    ``1 / flops``, which is linear in ``1 / rows``."""
    xs, ys = [1 / r for r in rows], [1 / f for f in flops]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    return 1 / intercept, max(0.0, slope / intercept)


COLLECTIVE_ELEMENTS = {1 << 15: 8, 1 << 18: 4, 1 << 21: 2}
"""fp32 elements of the buffers the collectives' costs by size are measured with (128 KiB, 1 MiB and 8 MiB: log-spaced
over a step's activations and gradient buckets; gloo's cost per byte falls 2-3-fold from 512 KiB to 8 MiB, so a
straight line from one element to 8 MiB underprices the activations' calls), and the iterations of each one's timed
block in :func:`_busy_rounds`."""

BUSY_ROWS = (128, 512)
"""Rows of the ``[rows, 512] x [512, 1024]`` GEMM each rank computes between two collectives when the collectives'
cost to a step is measured (about 1.5 and 6 ms per core, the range of a layer's work between its collectives): the
first prices the calls and their bytes, the two the growth of the wait and the CPU with the compute between the
calls (a call's CPU measured no higher after 27 ms than after 6)."""

BUSY_CALLS = (16, 8)
"""Iterations per timed block of :func:`_busy_rounds` with a one-element collective (and the blocks without one) at
each of :data:`BUSY_ROWS` (more of the short ones, which are cheap and price every call's CPU and wait)."""

BUSY_ROUNDS, BUSY_GROUPS = 30, 5
"""Rounds of :func:`_busy_rounds` (each times one block of every kind), and the groups of consecutive rounds whose
means :func:`median_of_means` takes the median of."""


def median_of_means(values, groups: int) -> float:
    """Median over ``groups`` consecutive, near-equal groups of ``values`` of each group's mean.

    The collectives' per-call costs where every core computes are skewed: most calls wait well under 0.1 ms, a
    quarter to a third wait about a scheduler slice (1.5-3.5 ms, a gloo thread woken behind a computing thread),
    so a step pays their mean, which the median call underprices 5-8x and the median of ten-call blocks' means by
    up to 40%.  A group's mean pays the tail its share; the median over groups keeps a burst of load on the shared machine (a group a
    few-fold off) from moving the result, as one such burst moves a plain mean."""
    values = list(values)
    if not 1 <= groups <= len(values):
        raise ValueError(f"median_of_means needs 1 to {len(values)} groups, got {groups}")
    bounds = [len(values) * g // groups for g in range(groups + 1)]
    return statistics.median(statistics.mean(values[a:b]) for a, b in zip(bounds, bounds[1:]))


def _busy_rounds(kinds: dict, rounds: int) -> dict:
    """``{kind: [(process CPU seconds, wall seconds beyond them) per iteration, one per round]}`` of blocks of
    iterations in which every rank computes, then calls a collective (or not), as in a step where every core
    computes.  ``kinds`` maps each kind to ``(compute, collective or None, iterations)``.  Every round times one
    block of each kind, in an order rotated round by round, so a drift of the machine's load hits every kind
    alike, and a kind's cost is its difference from the block without a collective of the same round and
    compute.  Each block starts where both ranks are (a barrier) and is timed without the barriers."""
    import torch.distributed as dist

    def block(compute, op, calls: int) -> tuple[float, float]:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            compute()
            if op is not None:
                op()
        cpu = time.process_time() - cpu
        wall = time.perf_counter() - start
        dist.barrier()
        return cpu / calls, (wall - cpu) / calls

    order = list(kinds)
    for kind in order:  # warm-up
        block(*kinds[kind])
    out = {kind: [] for kind in order}
    for r in range(rounds):
        for kind in order[r % len(order):] + order[:r % len(order)]:
            out[kind].append(block(*kinds[kind]))
    return out


def _busy_costs(rounds: dict, names, calls: dict) -> tuple[dict, float, float, float]:
    """From :func:`_busy_rounds`' blocks (kinds ``"alone", i`` and ``name, i`` at the compute of ``BUSY_ROWS[i]``,
    ``name, "buffer", elements`` with each of :data:`COLLECTIVE_ELEMENTS`' sizes at the first): ``{name: (CPU
    table, wait table)}``, each ``[[bytes, seconds per call], ...]`` from 0 bytes (the one-element call) up, taken
    at no compute between the calls (``calls[name]`` collectives per blocking call); the seconds a call's wait grows
    by per second of compute between the calls; the CPU seconds it grows by per second of it; and the compute it
    was measured to grow over (the second of ``BUSY_ROWS``).  Each figure is the :func:`median_of_means` over the
    rounds of the difference from the round's block without a collective.  The one-element calls' waits and both
    growths are taken over every collective (each blocking call's, an exchange's for ``send_recv``): the waits are the
    scheduler's, a gloo thread woken beside a computing one, and came out alike for the four collectives within
    their sampling noise, which pooling them quarters; their CPU and every buffer's cost are each collective's
    own.  A table never falls with more bytes (a point below the one before it is sampling noise)."""
    elements = sorted(kind[2] for kind in rounds if kind[0] == names[0] and kind[1] == "buffer")

    def diff(kind, i: int, field: int) -> list:
        return [a[field] - b[field] for a, b in zip(rounds[kind], rounds["alone", i])]

    def typical(values) -> float:
        return median_of_means(values, BUSY_GROUPS)

    def over_names(i: int, field: int) -> list:  # per round: the one-element calls' cost at BUSY_ROWS[i]
        return [statistics.mean(costs) for costs in zip(*(diff((name, i), i, field) for name in names))]

    segments = [statistics.mean(cpu for cpu, _ in rounds["alone", i]) for i in range(2)]
    slopes = [max(typical([long - short for long, short in zip(over_names(1, field), over_names(0, field))])
                  / (segments[1] - segments[0]), 0.0) for field in (0, 1)]
    call_wait = typical(over_names(0, 1))
    # the wait at no compute between the calls
    base_wait = max(call_wait - slopes[1] * segments[0], 0.0)

    def table(costs: list, slope: float) -> list:
        points, floor = [], 0.0
        for nbytes, cost in zip([0] + [4 * e for e in elements], costs):
            floor = max(floor, cost - slope * segments[0])
            points.append([nbytes, floor])
        return points

    costs = {}
    for name in names:
        buffers = [(name, "buffer", e) for e in elements]
        cpu = table([typical(diff((name, 0), 0, 0))] + [typical(diff(kind, 0, 0)) for kind in buffers], slopes[0])
        # each buffer's wait beyond the one element's (the pooled one) at the same compute
        wait = [[nbytes, base_wait + max(extra - call_wait, 0.0)] for nbytes, extra in
                table([call_wait] + [typical(diff(kind, 0, 1)) for kind in buffers], 0.0)]
        costs[name] = tuple([[nbytes, cost / calls[name]] for nbytes, cost in points] for points in (cpu, wait))
    return costs, slopes[1], slopes[0], segments[1]


def _collective_times(size: int, rounds: int, elements: dict) -> tuple:
    import torch
    import torch.distributed as dist

    from megalite.collectives import all_gather_single, reduce_scatter_single

    big, small = torch.ones(size), torch.ones(1)
    times = (_timed(lambda: dist.all_reduce(big), clock=time.perf_counter, pick=min),
             _timed(lambda: dist.all_reduce(small), clock=time.perf_counter, pick=min))
    rank = dist.get_rank()

    def ops(n: int) -> dict:
        whole, half, out = torch.ones(n), torch.ones(n // 2 or 1), torch.empty(2 * (n // 2 or 1))
        received = torch.empty(n)

        def exchange():
            # as the CP ring and the pipeline exchange: one batch of a send to the other rank and a receive from it
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, whole, 1 - rank),
                                                dist.P2POp(dist.irecv, received, 1 - rank)]):
                work.wait()

        return {"all_reduce": lambda: dist.all_reduce(whole),
                "all_gather": lambda: all_gather_single(out, half),
                "reduce_scatter": lambda: reduce_scatter_single(half, out),
                "send_recv": exchange}

    w = torch.randn(1024, 512)
    computes = [lambda x=torch.randn(rows, 512): torch.matmul(x, w.t()) for rows in BUSY_ROWS]
    buffers, one = {e: ops(e) for e in elements}, ops(2)
    kinds = {("alone", i): (compute, None, BUSY_CALLS[i]) for i, compute in enumerate(computes)}
    for name in one:
        kinds |= {(name, i): (compute, one[name], BUSY_CALLS[i]) for i, compute in enumerate(computes)}
        kinds |= {(name, "buffer", e): (computes[0], buffers[e][name], iterations)
                  for e, iterations in elements.items()}
    # an exchange is a send and a receive on each rank: the profile's send_recv is one of them
    calls = {name: 2 if name == "send_recv" else 1 for name in one}
    return times + _busy_costs(_busy_rounds(kinds, rounds), list(one), calls)


def measure_link(size: int = 1 << 20, rounds: int | None = None) -> dict:
    """The link's fields of a :class:`~megalite.hardware.Hardware` profile, by name: ``intra_node_bandwidth``
    (bytes/s) and ``intra_node_latency_s`` of a two-rank gloo all-reduce of ``size`` fp32 elements (the best of ten
    wall-clock runs: the least preempted), and what each collective a step runs costs a rank where every core
    computes (:func:`_busy_costs`, on one element and on each of :data:`COLLECTIVE_ELEMENTS`, averaged over the
    two ranks; ``send_recv`` is half of an exchange, a send and a receive on each rank, and its bytes those sent):
    ``{op: [[bytes, seconds per call], ...]}`` of CPU (``collective_cpu``) and of waiting beyond it
    (``collective_wait``), both at no compute between the calls, the seconds a call's wait grows by per second of
    compute between the calls (``collective_wait_per_compute``), the CPU seconds it grows by
    (``collective_cpu_per_compute``) and over how much compute (``collective_cpu_compute_s``), from ``rounds`` of
    :func:`_busy_rounds` (:data:`BUSY_ROUNDS`)."""
    from megalite.testing import run_distributed

    ranks = run_distributed(_collective_times, 2, size, BUSY_ROUNDS if rounds is None else rounds,
                            COLLECTIVE_ELEMENTS, timeout=300)
    big, small = ranks[0][:2]

    def mean_table(op: str, i: int) -> list:
        return [[nbytes, statistics.mean(r[2][op][i][p][1] for r in ranks)]
                for p, (nbytes, _) in enumerate(ranks[0][2][op][i])]

    wait_per_compute, cpu_per_compute, compute = (statistics.mean(r[i] for r in ranks) for i in (3, 4, 5))
    # A two-rank ring all-reduce moves 2 * (n-1)/n = 1 x the buffer over the link.
    return {"intra_node_bandwidth": size * 4 / max(big - small, 1e-9), "intra_node_latency_s": small,
            "collective_cpu": {op: mean_table(op, 0) for op in ranks[0][2]},
            "collective_wait": {op: mean_table(op, 1) for op in ranks[0][2]},
            "collective_wait_per_compute": wait_per_compute, "collective_cpu_per_compute": cpu_per_compute,
            "collective_cpu_compute_s": compute}


def calibrate(path: str) -> Hardware:
    """Measure this machine and write its profile to ``path``."""
    import os

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copy_src = torch.ones(1 << 24)
        copy_dst = torch.empty_like(copy_src)
        hbm = 2 * copy_src.numel() * 4 / _timed(lambda: copy_dst.copy_(copy_src))
        fp32_peak, half_rows = fit_gemm_curve(CALIBRATION_ROWS, [step_gemm_flops(r) for r in CALIBRATION_ROWS])
        # The other precisions: their square GEMM's rate relative to fp32's, on the fp32 layer curve's peak.
        peaks = {"fp32": fp32_peak} | {p: fp32_peak * gemm_flops(p) / gemm_flops("fp32") for p in ("bf16", "fp16")}
        attention_rate, score_s = fit_attention()
        attention = attention_rate / fp32_peak
        overhead = op_overhead()
        exps = exp_rate()
    finally:
        torch.set_num_threads(threads)
    link = measure_link()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    # One machine: the "inter-node" link of its ranks is the same loopback as the intra-node one.
    hw = Hardware(name="calibrated CPU", source=f"python -m megalite.plan --calibrate on {cores} cores",
                  peak_flops=peaks, efficiency=1.0, gemm_half_rows=half_rows, hbm_bytes=memory, hbm_bandwidth=hbm,
                  gpus_per_node=cores, inter_node_bandwidth=link["intra_node_bandwidth"],
                  inter_node_latency_s=link["intra_node_latency_s"], attention_efficiency=attention,
                  attention_score_s=score_s, op_overhead_s=overhead, cores=cores, exp_rate=exps, **link)
    save_hardware(hw, path)
    print(f"wrote {path}: per core GEMM fp32 {fp32_peak / 1e9:.1f} GFLOP/s (half of it at {half_rows:.0f} rows), "
          f"attention {attention:.2f} of it and {score_s * 1e9:.2f} ns per score, memory {hbm / 1e9:.1f} GB/s, "
          f"{overhead * 1e6:.1f} us per op, "
          f"exp {exps / 1e9:.2f} G elements/s, {cores} cores; all-reduce {hw.intra_node_bandwidth / 1e9:.2f} GB/s, "
          f"latency {hw.intra_node_latency_s * 1e6:.0f} us; per collective call at "
          + " / ".join(f"{nbytes / 1024:.0f}" for nbytes, _ in hw.collective_cpu["all_reduce"])
          + " KiB, CPU + wait beyond it in us, every core computing: "
          + ", ".join(f"{op} " + " / ".join(f"{c * 1e6:.0f} + {w * 1e6:.0f}" for (_, c), (_, w) in
                                            zip(hw.collective_cpu[op], hw.collective_wait[op]))
                     for op in hw.collective_cpu)
          + f"; per ms of compute between the calls (up to {hw.collective_cpu_compute_s * 1e3:.1f} ms for the CPU), "
          f"CPU {hw.collective_cpu_per_compute * 1e3:.0f} us and wait {hw.collective_wait_per_compute * 1e3:.0f} us")
    return hw
