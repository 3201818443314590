"""``--calibrate``: measure this machine's compute rates, memory bandwidth and collective bandwidth, per rank.

A CPU rank runs one thread on a core of its own, so every rate is one thread's.  The GEMMs of a micro-batch through
a one-layer megalite GPT of width 512 (QKV, projection, MLP and output layer; forward, input gradient and weight
gradient), timed op by op as the step runs them between its other ops, at a few row counts give how the rate
falls with fewer rows: the fit of ``seconds per FLOP = (1 + gemm_half_rows / rows) / peak`` gives the profile's
peak (with ``efficiency`` 1: the model's large GEMMs run at what this machine's do inside a step) and
``gemm_half_rows``; the other precisions scale it by their square GEMM's rate over fp32's.  Torch's fused causal
attention, forward and backward, gives ``attention_efficiency`` (its rate over that peak); a 64 MiB copy the memory
bandwidth; ``torch.exp`` over a score tile ``exp_rate``; a chain of one-element multiplications through autograd,
forward and backward, the time an op costs beyond its work (``op_overhead_s``); the core count how many ranks run
at once (``cores``).  The all-reduce of a few MiB between two gloo ranks gives the link bandwidth and the
all-reduce of one element its latency; each collective a step runs (all-reduce, all-gather, reduce-scatter,
send/recv), timed in process CPU time at one element and at 8 MiB (the least of ten), its CPU cost per call and
per byte (``collective_cpu``).  The compute timings take the median of ten runs in the process's CPU time (what an op
typically costs as a step pays it, not the luckiest run; the time it ran, not the time it waited for a core on a
shared machine); the link timings the best of ten wall-clock runs (the least preempted).
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


COLLECTIVE_ELEMENTS = 1 << 21
"""fp32 elements of the buffer the collectives' per-byte CPU cost is measured with (8 MiB)."""


def _collective_times(size: int) -> tuple[float, float, dict]:
    import torch
    import torch.distributed as dist

    from megalite.collectives import all_gather_single, reduce_scatter_single

    big, small = torch.ones(size), torch.ones(1)
    times = (_timed(lambda: dist.all_reduce(big), clock=time.perf_counter, pick=min),
             _timed(lambda: dist.all_reduce(small), clock=time.perf_counter, pick=min))
    rank = dist.get_rank()

    def ops(n: int) -> dict:
        whole, half, out = torch.ones(n), torch.ones(n // 2 or 1), torch.empty(2 * (n // 2 or 1))
        return {"all_reduce": lambda: dist.all_reduce(whole),
                "all_gather": lambda: all_gather_single(out, half),
                "reduce_scatter": lambda: reduce_scatter_single(half, out),
                "send_recv": lambda: dist.send(whole, 1) if rank == 0 else dist.recv(whole, 0)}

    def cpu(fn) -> float:
        def synced():
            dist.barrier()
            start = time.process_time()
            fn()
            return time.process_time() - start
        return min(synced() for _ in range(10))

    large, one = ops(COLLECTIVE_ELEMENTS), ops(2)
    costs = {}
    for name in large:
        large[name]()
        per_call = cpu(one[name])
        costs[name] = (per_call, max(cpu(large[name]) - per_call, 0.0) / (COLLECTIVE_ELEMENTS * 4))
    return times + (costs,)


def measure_link(size: int = 1 << 20) -> tuple[float, float, dict]:
    """(bandwidth bytes/s, latency s) of a two-rank gloo all-reduce of ``size`` fp32 elements, and the CPU each
    collective a step runs costs a rank: ``{op: [seconds per call, seconds per byte]}`` from its least process
    time of ten (gloo's threads included; a rank waiting for its partner costs none) on one element and on
    :data:`COLLECTIVE_ELEMENTS`, averaged over the two ranks (a send costs the sender, a receive the receiver).
    The least, as for the link: on a loaded machine a run's kernel socket work can be charged the time of other
    jobs' interrupts, and a per-call median moved 5-15x between runs."""
    from megalite.testing import run_distributed

    ranks = run_distributed(_collective_times, 2, size, timeout=300)
    big, small, _ = ranks[0]
    costs = {op: [statistics.mean(r[2][op][i] for r in ranks) for i in range(2)] for op in ranks[0][2]}
    # A two-rank ring all-reduce moves 2 * (n-1)/n = 1 x the buffer over the link.
    return size * 4 / max(big - small, 1e-9), small, costs


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
        attention = attention_flops() / fp32_peak
        overhead = op_overhead()
        exps = exp_rate()
    finally:
        torch.set_num_threads(threads)
    bandwidth, latency, collective_cpu = measure_link()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    hw = Hardware(name="calibrated CPU", source=f"python -m megalite.plan --calibrate on {cores} cores",
                  peak_flops=peaks, efficiency=1.0, gemm_half_rows=half_rows, hbm_bytes=memory, hbm_bandwidth=hbm,
                  gpus_per_node=cores, intra_node_bandwidth=bandwidth, intra_node_latency_s=latency,
                  inter_node_bandwidth=bandwidth, inter_node_latency_s=latency, attention_efficiency=attention,
                  op_overhead_s=overhead, cores=cores, exp_rate=exps, collective_cpu=collective_cpu)
    save_hardware(hw, path)
    print(f"wrote {path}: per core GEMM fp32 {fp32_peak / 1e9:.1f} GFLOP/s (half of it at {half_rows:.0f} rows), "
          f"attention {attention:.2f} of it, memory {hbm / 1e9:.1f} GB/s, {overhead * 1e6:.1f} us per op, "
          f"exp {exps / 1e9:.2f} G elements/s, {cores} cores; all-reduce {bandwidth / 1e9:.2f} GB/s, latency "
          f"{latency * 1e6:.0f} us; CPU per collective call / GB: "
          + ", ".join(f"{op} {c * 1e6:.0f} us / {b * 1e9:.2f} s" for op, (c, b) in collective_cpu.items()))
    return hw
