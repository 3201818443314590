"""Step time of megalite's GPTModel at tp=pp=dp=1 against a plain torch GPT of the same architecture.

Both models hold the same weights (the plain one is loaded from megalite's)
and run the same AdamW training step on the same batches; rounds alternate
between the two so machine noise hits both alike.  Prints the median step
times and the ratio megalite / plain (target <= 1.05).

    python benchmarks/gpt_overhead.py [--steps 20] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.models import GPTConfig, GPTModel  # noqa: E402
from tests.models.plain_gpt import PlainGPT  # noqa: E402

SHAPES = {
    "cpu": dict(hidden_size=256, num_layers=4, num_attention_heads=8, vocab_size=8000, batch=4, seq=128),
    "cuda": dict(hidden_size=1024, num_layers=8, num_attention_heads=16, vocab_size=32000, batch=8, seq=1024),
}
ARCHITECTURES = {
    "gpt2 (LayerNorm, GELU, learned positions, tied)": dict(),
    "llama (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied)": dict(
        normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", add_bias_linear=False,
        untie_embeddings_and_output_weights=True),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(model, optimizer, ids, labels):
    optimizer.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def compare(arch: dict, shape: dict, device, dtype, steps: int, warmup: int):
    """Median wall and CPU seconds per step of megalite and plain, and the first-step loss difference."""
    shape = dict(shape)
    batch, seq = shape.pop("batch"), shape.pop("seq")
    heads = shape["num_attention_heads"]
    groups = heads // 4 if arch.get("position_embedding_type") == "rope" else None
    config = GPTConfig(**shape, **arch, num_query_groups=groups, max_position_embeddings=seq)
    megalite = GPTModel(config).to(device=device, dtype=dtype)
    plain = PlainGPT(config).to(device=device, dtype=dtype)
    plain.load_megalite(megalite)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in (("megalite", megalite),
                                                                                   ("plain", plain))}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g).to(device)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    first = {name: _step(m, optimizers[name], ids, labels).item() for name, m in (("megalite", megalite),
                                                                                   ("plain", plain))}
    wall, cpu = {"megalite": [], "plain": []}, {"megalite": [], "plain": []}
    for i in range(warmup + steps):
        order = (("megalite", megalite), ("plain", plain)) if i % 2 else (("plain", plain), ("megalite", megalite))
        for name, model in order:
            _sync(device)
            start, start_cpu = time.perf_counter(), time.thread_time()
            _step(model, optimizers[name], ids, labels)
            _sync(device)
            if i >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.thread_time() - start_cpu)
    medians = {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in wall}
    return medians, abs(first["megalite"] - first["plain"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    shape = SHAPES[device.type]
    print(f"device={device} dtype={dtype} threads={torch.get_num_threads()} shape={shape} steps={args.steps}")
    for name, arch in ARCHITECTURES.items():
        medians, diff = compare(arch, shape, device, dtype, args.steps, args.warmup)
        (ours, ours_cpu), (plain, plain_cpu) = medians["megalite"], medians["plain"]
        print(f"{name}:\n  wall: megalite {ours * 1e3:.1f} ms/step, plain torch {plain * 1e3:.1f} ms/step, "
              f"ratio {ours / plain:.3f}")
        if device.type == "cpu":
            print(f"  CPU time of the rank's thread: megalite {ours_cpu * 1e3:.1f} ms/step, plain torch "
                  f"{plain_cpu * 1e3:.1f} ms/step, ratio {ours_cpu / plain_cpu:.3f}")
        print(f"  first-step loss difference {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
