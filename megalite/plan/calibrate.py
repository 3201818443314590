"""``--calibrate``: measure this machine's GEMM throughput, memory bandwidth and collective bandwidth.

GEMMs of a few row counts (``[rows, 512] x [512, 512]``) give how the rate falls with fewer rows: the fit of
``seconds per FLOP = (1 + gemm_half_rows / rows) / peak`` gives the profile's peak (with ``efficiency`` 1: the
model's large GEMMs run at what this machine's do) and ``gemm_half_rows``; the all-reduce of a few MiB
between two gloo ranks gives the link bandwidth and the all-reduce of one element its latency.  Timings
take the best of ten runs (on a shared machine the best is the least preempted).
"""

from __future__ import annotations

import time

from megalite.hardware import Hardware, save_hardware


def _best(fn, repeats: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


CALIBRATION_ROWS = (16, 64, 256, 1024)


def gemm_flops(dtype_name: str, n: int = 512, rows: int | None = None) -> float:
    """FLOP/s of a ``[rows, n] x [n, n]`` GEMM (square without ``rows``)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    rows = n if rows is None else rows
    a, b = torch.randn(rows, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * rows * n * n / _best(lambda: torch.matmul(a, b))


def fit_gemm_curve(rows, flops) -> tuple[float, float]:
    """``(peak, half_rows)`` of ``flops[i] = peak * rows[i] / (rows[i] + half_rows)``, least squares on
    ``1 / flops``, which is linear in ``1 / rows``."""
    xs, ys = [1 / r for r in rows], [1 / f for f in flops]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    return 1 / intercept, max(0.0, slope / intercept)


def _collective_times(size: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    big, small = torch.ones(size), torch.ones(1)
    return _best(lambda: dist.all_reduce(big)), _best(lambda: dist.all_reduce(small))


def measure_link(size: int = 1 << 20) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a two-rank gloo all-reduce of ``size`` fp32 elements."""
    from megalite.testing import run_distributed

    big, small = run_distributed(_collective_times, 2, size, timeout=120)[0]
    # A two-rank ring all-reduce moves 2 * (n-1)/n = 1 x the buffer over the link.
    return size * 4 / max(big - small, 1e-9), small


def calibrate(path: str) -> Hardware:
    """Measure this machine and write its profile to ``path``."""
    import os

    import torch

    copy_src = torch.ones(1 << 24)
    copy_dst = torch.empty_like(copy_src)
    hbm = 2 * copy_src.numel() * 4 / _best(lambda: copy_dst.copy_(copy_src))
    bandwidth, latency = measure_link()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fp32_peak, half_rows = fit_gemm_curve(CALIBRATION_ROWS, [gemm_flops("fp32", rows=r) for r in CALIBRATION_ROWS])
    # The other precisions: their square GEMM's rate, raised to the large-GEMM limit along the fp32 curve.
    scale = (512 + half_rows) / 512
    hw = Hardware(name="calibrated CPU", source=f"python -m megalite.plan --calibrate on {os.cpu_count()} cores",
                  peak_flops={"fp32": fp32_peak} | {p: gemm_flops(p) * scale for p in ("bf16", "fp16")},
                  efficiency=1.0, gemm_half_rows=half_rows, hbm_bytes=memory, hbm_bandwidth=hbm,
                  gpus_per_node=os.cpu_count() or 1,
                  intra_node_bandwidth=bandwidth, intra_node_latency_s=latency, inter_node_bandwidth=bandwidth,
                  inter_node_latency_s=latency)
    save_hardware(hw, path)
    print(f"wrote {path}: GEMM fp32 {hw.peak_flops['fp32'] / 1e9:.1f} GFLOP/s (half of it at {half_rows:.0f} rows), "
          f"memory {hbm / 1e9:.1f} GB/s, all-reduce {bandwidth / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} us")
    return hw
