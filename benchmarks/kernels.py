"""Fused kernels against eager torch and torch.compile of the same reference, forward + backward.

    python benchmarks/kernels.py [--dtype float32|bfloat16] [--no-compile] [--threads 1] [--repeats 10]

Times every megalite.kernels op (fused path) on one process next to its plain
torch reference (megalite.kernels.reference) run eagerly and compiled with
torch.compile, and prints the times and the eager/fused and compiled/fused
ratios (> 1 means the fused op is faster).  On a GPU it also prints the fused
op's forward bandwidth in GB/s next to a measured device copy bandwidth, twice:
as Python calls it (CUDA events around one call: custom-op dispatch and the
host's launch included, which at GPU shapes can exceed the kernel) and as the
device runs it (the kernel durations of ten no-grad forward calls, as the CUDA
profiler records them, so the host's gaps are out of the time), with
torch.compile of the reference timed the same way.  bias_dropout_add's compiled peer
is torch's own dropout expression (COMPILED_PEERS says why).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import torch

import megalite.kernels as K
from megalite.kernels import reference as R


def _cases(device, dtype, small):
    """name -> (fused fn, reference fn, make_args); tensors needing grads are created with requires_grad."""
    if small:
        (rows, h), (b, heads, s), (tokens, top_k, experts) = (256, 256), (2, 2, 64), (256, 2, 4)
    elif device.type == "cuda":  # large enough that each kernel, not its launch, sets the time
        (rows, h), (b, heads, s), (tokens, top_k, experts) = (16384, 4096), (4, 16, 2048), (16384, 2, 8)
    else:
        (rows, h), (b, heads, s), (tokens, top_k, experts) = (2048, 1024), (4, 8, 256), (4096, 2, 8)

    def t(*shape, grad=True, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt).requires_grad_(grad)

    def rotary_args():
        angles = torch.randn(s, 32, device=device)
        emb = torch.cat((angles, angles), -1)
        return t(s, b, heads, 64), t(s, b, heads // 2, 64), emb.cos(), emb.sin()

    def unpermute_args():
        idx = torch.randint(0, experts, (tokens, top_k), device=device)
        permuted, row_map = R.permute(torch.randn(tokens, h // 2, device=device, dtype=dtype), idx)
        return permuted.requires_grad_(), row_map, torch.rand(tokens, top_k, device=device, requires_grad=True), tokens

    return {
        "layer_norm": (K.layer_norm, R.layer_norm,
                       lambda: (t(rows, h), t(h, dt=torch.float32), t(h, dt=torch.float32), 1e-5)),
        "rms_norm": (K.rms_norm, R.rms_norm, lambda: (t(rows, h), t(h, dt=torch.float32), 1e-5)),
        "bias_gelu": (K.bias_gelu, R.bias_gelu, lambda: (t(rows, h), t(h))),
        "bias_swiglu": (K.bias_swiglu, R.bias_swiglu, lambda: (t(rows, h), t(h))),
        "apply_rotary": (K.apply_rotary, R.apply_rotary, rotary_args),
        "bias_dropout_add": (K.bias_dropout_add, R.bias_dropout_add, lambda: (t(rows, h), t(h), t(rows, h), 0.1, True)),
        "causal_softmax": (K.scaled_upper_triang_masked_softmax, R.scaled_upper_triang_masked_softmax,
                           lambda: (t(b, heads, s, s), 0.125)),
        "masked_softmax": (K.scaled_masked_softmax, R.scaled_masked_softmax,
                           lambda: (t(b, heads, s, s), torch.rand(b, 1, s, s, device=device) < 0.3, 0.125)),
        "permute": (K.permute, R.permute,
                    lambda: (t(tokens, h // 2), torch.randint(0, experts, (tokens, top_k), device=device))),
        "unpermute": (K.unpermute, R.unpermute, unpermute_args),
    }


def _torch_bias_dropout_add(x, bias, residual, p, training):
    """torch's own dropout as a user writes it, the compiled peer of bias_dropout_add: inductor draws its mask
    inside its one fused kernel.  The reference's mask on CUDA (megalite.kernels.philox's Triton draw, the one the
    fused kernel makes) would compile to a kernel of its own and a mask in memory: a slower peer than torch's."""
    return residual + torch.nn.functional.dropout(x + bias, p, training)


# op -> what torch.compile compiles for the compile columns, where that is not the op's reference.
COMPILED_PEERS = {"bias_dropout_add": _torch_bias_dropout_add}


def _keep_freed_memory() -> None:
    """Ask glibc malloc to keep freed blocks instead of returning them to the OS.

    Otherwise every multi-MB tensor is a fresh mmap whose page faults cost
    more than the kernels being compared (and, on a loaded machine, vary a
    lot); a long-running training process reaches this steady state anyway.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_trim_threshold, 2**30)
    libc.mallopt(m_mmap_threshold, 2**30)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(fn, args):
    """Forward and backward of fn(*args) with unit upstream gradients; returns the forward outputs."""
    out = fn(*args)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
    return outs


def _time(fn, args, device, repeats, forward_only=False):
    """Median seconds per call after two warm-up calls.

    On CPU this is process CPU time, not wall time: the benchmark machine is
    shared, and with --threads 1 CPU time is the op's own cost whatever else
    runs.  On GPU it is device time between CUDA events around the call.
    """
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    run = (lambda: fn(*args)) if forward_only else (lambda: _step(fn, args))
    for _ in range(2):
        run()
    samples = []
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)
    for _ in range(repeats):
        _sync(device)
        start = clock()
        run()
        _sync(device)
        samples.append(clock() - start)
    return statistics.median(samples)


def _device_seconds(fn, args, calls=10):
    """Device seconds per no-grad forward call: the summed durations of the kernels that ``calls`` calls ran, as
    the CUDA profiler records them (the host's dispatch and launch gaps between kernels are not in it)."""
    def run():
        with torch.no_grad():
            for _ in range(calls):
                fn(*args)

    run()  # warm-up: compiles, allocator, lazy initialisation
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    micros = sum(event.self_device_time_total for event in profile.key_averages())
    return micros / 1e6 / calls


def _copy_bandwidth(device):
    """Device-to-device copy bandwidth in GB/s (read + write), the practical peak."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), (), device, 20, forward_only=True)
    return 2 * src.numel() / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a quick smoke run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _keep_freed_memory()
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    peak = _copy_bandwidth(device) if device.type == "cuda" else None

    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else f'{args.threads} thread(s)'}), "
          f"dtype {args.dtype}, fused ops built: {K.fused_enabled()}, forward + backward, median of {args.repeats} "
          f"({'CUDA event' if device.type == 'cuda' else 'process CPU'} time)")
    if peak:
        print(f"measured copy bandwidth: {peak:.0f} GB/s")
    header = f"{'op':18s} {'fused ms':>9s} {'eager ms':>9s} {'eager/fused':>11s}"
    header += "" if args.no_compile else f" {'compile ms':>10s} {'compile/fused':>13s}"
    header += "" if not peak else f" {'fwd GB/s':>9s} {'% of copy':>9s} {'dev GB/s':>9s} {'dev % copy':>10s}"
    header += "" if not peak or args.no_compile else f" {'compile dev %':>13s}"
    print(header)
    results = {}
    for name, (fused_fn, reference_fn, make_args) in _cases(device, dtype, args.small).items():
        inputs = make_args()
        fused_s = _time(fused_fn, inputs, device, args.repeats)
        eager_s = _time(reference_fn, inputs, device, args.repeats)
        line = f"{name:18s} {fused_s * 1e3:9.3f} {eager_s * 1e3:9.3f} {eager_s / fused_s:11.2f}"
        results[name] = {"fused_ms": fused_s * 1e3, "eager_ms": eager_s * 1e3}
        if not args.no_compile:
            torch._dynamo.reset()
            compiled_s = _time(torch.compile(COMPILED_PEERS.get(name, reference_fn)), inputs, device, args.repeats)
            line += f" {compiled_s * 1e3:10.3f} {compiled_s / fused_s:13.2f}"
            results[name]["compiled_ms"] = compiled_s * 1e3
        if peak:
            with torch.no_grad():
                outs = fused_fn(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            moved = sum(t.numel() * t.element_size() for t in (*inputs, *outs) if isinstance(t, torch.Tensor))
            forward_s = _time(fused_fn, inputs, device, args.repeats, forward_only=True)
            gb_per_s = moved / forward_s / 1e9
            line += f" {gb_per_s:9.0f} {100 * gb_per_s / peak:8.0f}%"
            results[name].update(forward_gb_per_s=gb_per_s, fraction_of_copy=gb_per_s / peak)
            device_s = _device_seconds(fused_fn, inputs)
            device_gb = moved / device_s / 1e9
            line += f" {device_gb:9.0f} {100 * device_gb / peak:9.0f}%"
            results[name].update(device_forward_ms=device_s * 1e3, device_forward_gb_per_s=device_gb,
                                 device_fraction_of_copy=device_gb / peak)
            if not args.no_compile:
                torch._dynamo.reset()
                compiled_device_s = _device_seconds(torch.compile(COMPILED_PEERS.get(name, reference_fn)), inputs)
                line += f" {100 * moved / compiled_device_s / 1e9 / peak:12.0f}%"
                results[name].update(compiled_device_forward_ms=compiled_device_s * 1e3)
        print(line, flush=True)
    if device.type == "cuda":
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"gpu_kernels_{args.dtype}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
                       "copy_gb_per_s": peak, "ops": results}, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
