"""One-GPU GPT pretraining throughput and MFU, megalite beside Megatron-Core, in one run.

    python benchmarks/gpu_gpt.py [--micro-batch-size 4 ...] [--megalite-only] [--profile]

Trains the issue's 1.3B model (h=2048, 24 layers, 16 heads, seq 2048, vocab
50304, bf16, Adam with fp32 main weights) on --mock-data: first megalite's
examples/pretrain_gpt.py, then Megatron-Core's GPTModel through
benchmarks/megatron_core_gpt.py, each in its own process on the same GPU with
the same batch.  megalite reports its last logged interval (the last --warmup
iterations); Megatron-Core the mean over all --iters iterations after its warm-up.
Prints tokens/s, TFLOP/s and MFU (Megatron's model-FLOPs formula with
attention, against the bf16 peak of the running GPU's megalite.hardware
profile: 989 TFLOP/s on an H100) for each, then the ratio, and writes them to
benchmarks/results/gpu_gpt_mfu.json.

With --torchtitan the peer is torchtitan instead (pip ``torchtitan`` 0.2.2, through benchmarks/torchtitan_gpt.py):
its Llama 3 at the same size (RMSNorm, SwiGLU 5632, RoPE, untied output, SDPA causal attention) with FSDP
degree 1, eager and with its per-block torch.compile, beside megalite's GPT in the same Llama form (the
flags in LLAMA_FLAGS, no dropout), each at the same micro- and global batch; the JSON gains
``torchtitan_tokens_per_sec`` and ``torchtitan_compiled_tokens_per_sec``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048, "vocab_size": 50304}
LLAMA_FFN = 5632  # torchtitan's compute_ffn_hidden_dim(2048, multiple_of=256): 2/3 of 4h, rounded up
LLAMA_FLAGS = ["--swiglu", "--ffn-hidden-size", str(LLAMA_FFN), "--normalization", "RMSNorm",
               "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--hidden-dropout", "0", "--attention-dropout", "0"]


def model_flops_per_token(num_layers: int, hidden_size: int, seq_length: int, vocab_size: int,
                          swiglu_ffn: int | None = None) -> float:
    """Megatron's training FLOPs per token without recompute: 72 l h^2 (1 + s/(6h) + V/(12hl)) for the GPT MLP
    (4h, two matrices); with ``swiglu_ffn`` the MLP's 16 h^2 multiply-adds become three matrices of h x f."""
    l, h, s, v = num_layers, hidden_size, seq_length, vocab_size
    gpt = 72.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l))
    if swiglu_ffn is None:
        return gpt
    return gpt + 6.0 * l * (3 * h * swiglu_ffn - 8 * h * h)


def run_megalite(micro_batch: int, global_batch: int, iters: int, warmup: int, profile: bool,
                 extra: list[str]) -> dict | None:
    """Tokens/s and iteration time of the last logged interval, or None when the run failed."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        # NullTokenizer ids 0..V-2 plus eod make the model's vocabulary exactly V.
        flags = ["--num-layers", MODEL["num_layers"], "--hidden-size", MODEL["hidden_size"],
                 "--num-attention-heads", MODEL["num_attention_heads"], "--seq-length", MODEL["seq_length"],
                 "--max-position-embeddings", MODEL["seq_length"], "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", MODEL["vocab_size"] - 1, "--mock-data", "--bf16",
                 "--micro-batch-size", micro_batch, "--global-batch-size", global_batch,
                 "--train-iters", warmup + iters, "--log-interval", warmup, "--eval-iters", 0,
                 "--lr", 1e-4, "--min-lr", 1e-5, "--lr-warmup-iters", 0,
                 "--save", "", "--load", "", "--tensorboard-dir", "",
                 "--data-cache-path", tmp, "--log-throughput", "--metrics-file", metrics]
        flags += extra
        if profile:  # one warm-up iteration (the second), so the timed interval stays unprofiled
            flags += ["--profile", "--profile-step-start", 2, "--profile-step-end", 3, "--tensorboard-dir",
                      os.path.join(tmp, "tb")]
        cmd = [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py")] + [str(f) for f in flags]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("  ")))
        if done.returncode != 0:  # e.g. out of memory at a large micro-batch: the other sizes still count
            print(done.stderr[-4000:], file=sys.stderr)
            print(f"megalite micro-batch {micro_batch}: failed with exit code {done.returncode}", flush=True)
            return None
        records = [json.loads(line) for line in open(metrics)]
        if profile:
            print_device_time(os.path.join(tmp, "tb", "profile_iter2.json"))
    last = [r for r in records if "tokens_per_sec" in r][-1]
    return {"tokens_per_sec": last["tokens_per_sec"], "iter_ms": last["iter_ms"]}


KERNEL_KINDS = (  # (label, substrings of the kernel's name), first match wins
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matrix multiplies", ("gemm", "nvjet", "cutlass", "xmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("norm / softmax / activation (fused)", ("megalite", "layer_norm", "rms_norm", "softmax", "gelu", "swiglu",
                                             "rotary", "dropout")),
    ("copies and casts", ("copy", "memcpy", "memset", "cast", "convert", "fill")),
    ("reductions", ("reduce", "norm")),
)


def print_device_time(trace_path: str) -> None:
    """Where one profiled iteration's time went on the GPU: device time per kind of kernel (from the kernel's
    name), and the share of the iteration's span with no kernel running (host-bound or waiting)."""
    events = json.load(open(trace_path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        print(f"profile: no kernels in {trace_path}")
        return
    totals: dict[str, float] = {}
    for event in kernels:
        name = event["name"].lower()
        kind = next((label for label, keys in KERNEL_KINDS if any(k in name for k in keys)), "other")
        totals[kind] = totals.get(kind, 0.0) + event["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = spans[-1][1] - spans[0][0]
    print(f"profile of one iteration: {span / 1e3:.1f} ms from the first kernel to the last, GPU busy "
          f"{busy / span:.1%}")
    for kind, micros in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {kind:40s} {micros / 1e3:9.1f} ms  {micros / span:6.1%}")
    top: dict[str, float] = {}
    for event in kernels:
        top[event["name"][:90]] = top.get(event["name"][:90], 0.0) + event["dur"]
    for name, micros in sorted(top.items(), key=lambda item: -item[1])[:12]:
        print(f"    {micros / 1e3:8.1f} ms  {name}")


def run_torchtitan(micro_batch: int, global_batch: int, iters: int, warmup: int, compile: bool) -> dict | None:
    """torchtitan's tokens/s at the benchmark's model and batch (eager or compiled), or None when it failed."""
    cmd = [sys.executable, os.path.join(HERE, "torchtitan_gpt.py"), "--micro-batch-size", str(micro_batch),
           "--global-batch-size", str(global_batch), "--iters", str(iters), "--warmup", str(warmup),
           "--num-layers", str(MODEL["num_layers"]), "--hidden-size", str(MODEL["hidden_size"]),
           "--num-attention-heads", str(MODEL["num_attention_heads"]), "--seq-length", str(MODEL["seq_length"]),
           "--vocab-size", str(MODEL["vocab_size"])]
    if compile:
        cmd.append("--compile")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-6000:], file=sys.stderr)
        print(f"torchtitan ({'compiled' if compile else 'eager'}): failed with exit code {done.returncode}",
              flush=True)
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["ffn_hidden_size"] != LLAMA_FFN:
        raise SystemExit(f"error: torchtitan's MLP is {result['ffn_hidden_size']} wide, megalite's {LLAMA_FFN}")
    return result


def run_megatron_core(micro_batch: int, global_batch: int, iters: int, warmup: int) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "megatron_core_gpt.py"), "--micro-batch-size", str(micro_batch),
           "--global-batch-size", str(global_batch), "--iters", str(iters), "--warmup", str(warmup)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout[-3000:])
    if done.returncode != 0:
        print(done.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"Megatron-Core run failed with exit code {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, nargs="+", default=[4],
                        help="megalite runs one job per size; Megatron-Core runs the best one")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=6, help="timed iterations after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--megalite-only", action="store_true")
    parser.add_argument("--torchtitan", action="store_true",
                        help="the peer is torchtitan's Llama (eager and compiled); megalite runs the Llama form")
    parser.add_argument("--profile", action="store_true", help="profile megalite's first timed iteration")
    parser.add_argument("--extra-flags", default="",
                        help="more examples/pretrain_gpt.py flags for megalite, e.g. '--recompute-granularity selective'")
    parser.add_argument("--commit", default="", help="the megalite commit measured, recorded in the JSON")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "gpu_gpt_mfu.json"))
    args = parser.parse_args()

    import torch

    from megalite.hardware import detect

    hardware = detect()
    if hardware is None:
        sys.exit("error: no megalite.hardware profile names this GPU (or there is none)")
    peak_tflops = hardware.peak("bf16") / 1e12
    flops = model_flops_per_token(**{k: MODEL[k] for k in ("num_layers", "hidden_size", "seq_length",
                                                            "vocab_size")},
                                  swiglu_ffn=LLAMA_FFN if args.torchtitan else None)
    extra = args.extra_flags.split() + (LLAMA_FLAGS if args.torchtitan else [])

    def describe(name, result):
        tflops = result["tokens_per_sec"] * flops / 1e12
        result.update(tflops=tflops, mfu=tflops / peak_tflops)
        print(f"{name}: {result['tokens_per_sec']:.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {result['mfu']:.1%}",
              flush=True)

    best = None
    for micro_batch in args.micro_batch_size:
        result = run_megalite(micro_batch, args.global_batch_size, args.iters, args.warmup, args.profile, extra)
        if result is None:
            continue
        describe(f"megalite micro-batch {micro_batch}", result)
        if best is None or result["tokens_per_sec"] > best[1]["tokens_per_sec"]:
            best = (micro_batch, result)
    if best is None:
        raise SystemExit("error: every megalite run failed")
    micro_batch, ours = best
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "commit": args.commit, "model": MODEL,
              "extra_flags": " ".join(extra),
              "micro_batch_size": micro_batch, "global_batch_size": args.global_batch_size,
              "model_flops_per_token": flops, "peak_tflops": peak_tflops,
              "tokens_per_sec": ours["tokens_per_sec"], "tflops": ours["tflops"], "mfu": ours["mfu"]}
    if args.torchtitan:
        for compiled, key in ((False, "torchtitan_tokens_per_sec"), (True, "torchtitan_compiled_tokens_per_sec")):
            theirs = run_torchtitan(micro_batch, args.global_batch_size, args.iters, args.warmup, compiled)
            record[key] = None if theirs is None else theirs["tokens_per_sec"]
            if theirs is not None:
                name = "compiled" if compiled else "eager"
                describe(f"torchtitan {theirs['version']} {name}, micro-batch {micro_batch}", theirs)
                print(f"megalite / torchtitan {name} tokens/s: {ours['tokens_per_sec'] / theirs['tokens_per_sec']:.2f}x",
                      flush=True)
    elif not args.megalite_only:
        theirs = run_megatron_core(micro_batch, args.global_batch_size, args.iters, args.warmup)
        describe(f"Megatron-Core micro-batch {theirs['micro_batch_size']}", theirs)
        ratio = ours["tokens_per_sec"] / theirs["tokens_per_sec"]
        print(f"megalite / Megatron-Core tokens/s: {ratio:.2f}x")
        record.update(megatron_core_tokens_per_sec=theirs["tokens_per_sec"], megatron_core_mfu=theirs["mfu"],
                      megatron_core_micro_batch_size=theirs["micro_batch_size"],
                      megatron_core_version=theirs["version"], ratio=ratio)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
