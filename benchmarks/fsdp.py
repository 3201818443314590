"""megalite + FSDP2 vs megalite + ZeRO-1 vs a plain torch GPT under ``fully_shard``, same ranks, one run.

The same GPT (gpt2-style, fp32, dropout off) trains with AdamW and global-norm clipping at 1.0 on
``--data-parallel-size`` ranks (gloo on CPU, NCCL with one GPU per rank).  Three sides live on the same ranks:

- megalite GPTModel wrapped by ``FullyShardedDataParallel`` (fully_shard per layer, then the model),
  stepped through the pipeline schedule, ``finalize_model_grads`` and megalite's optimizer, as in training;
- the same model under megalite DDP with the ZeRO-1 distributed optimizer;
- ``tests/models/plain_gpt.PlainGPT`` (nn.Linear, SDPA) under torch ``fully_shard`` per block, then the
  model, with ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``.

Each side is built and warmed up (2 steps), then their steps alternate; the script prints the median
step time of the slowest rank, the CPU time summed over ranks, and each side's resident parameter +
gradient + optimizer bytes per rank (the distinct storages actually held, not a formula), plus the
ratios megalite-FSDP2 / plain-FSDP2 (target <= 1.05) and megalite-FSDP2 / ZeRO-1.

    python benchmarks/fsdp.py [--data-parallel-size 4] [--steps 8] [--hidden 256] [--layers 4] [--seq-length 128] [--batch 4]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp import time_interleaved  # noqa: E402
from megalite import topology  # noqa: E402
from megalite.distributed import (DDPConfig, DistributedDataParallel, FullyShardedDataParallel,  # noqa: E402
                                  finalize_model_grads)
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.optim import OptimizerConfig, get_optimizer  # noqa: E402
from megalite.pipeline import forward_backward  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402
from megalite.topology import device  # noqa: E402
from tests.models.plain_gpt import PlainGPT  # noqa: E402

LR, CLIP = 1e-4, 1.0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each counted once)."""
    storages = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = _local(t).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _config(hidden, layers, vocab, seq) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                     max_position_embeddings=seq, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                     attention_dropout=0.0)


def megalite_side(config, tokens, fsdp: bool):
    torch.manual_seed(0)
    model = GPTModel(config).to(device())
    if fsdp:
        chunk = FullyShardedDataParallel(model)
    else:
        chunk = DistributedDataParallel(model, DDPConfig(use_distributed_optimizer=True))
    opt = get_optimizer(OptimizerConfig(lr=LR, clip_grad=CLIP), [chunk])

    def forward_step(iterator, chunk):
        batch = next(iterator)
        per_token = chunk(input_ids=batch[:, :-1], labels=batch[:, 1:])
        return per_token, lambda out: (out.mean(), {})

    def step():
        opt.zero_grad()
        forward_backward(forward_step, iter([tokens]), [chunk], 1,
                         finalize_grads_func=lambda chunks: finalize_model_grads(chunks))
        opt.step()

    def resident():
        tensors = [p for p in chunk.module.parameters()] + [p.main_grad for p in chunk.module.parameters()]
        for s in opt.shards:
            tensors += [s.main, *opt.optimizer.state[s.main].values()]
        return resident_bytes(t for t in tensors if t.dim() > 0)

    return step, resident


def plain_side(config, tokens):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = PlainGPT(config).to(device())
    mesh = DeviceMesh.from_group(dist.group.WORLD, device().type)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        opt = torch.optim.AdamW(groups, lr=LR, weight_decay=0.01, fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(groups, lr=LR, weight_decay=0.01, foreach=True)

    def step():
        opt.zero_grad(set_to_none=False)
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()

    def resident():
        tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
        for state in opt.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        return resident_bytes(t for t in tensors if t is not None and t.dim() > 0)

    return step, resident


def compare(hidden, layers, vocab, seq, batch, steps):
    """Rank function: build and warm up each side, then time them interleaved."""
    torch.set_num_threads(1)
    topo = topology.initialize()
    config = _config(hidden, layers, vocab, seq)
    g = torch.Generator().manual_seed(100 + topo.dp.rank)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device())
    step_fns, memory = {}, {}
    for name, build in (("plain_fsdp2", lambda: plain_side(config, tokens)),
                        ("megalite_fsdp2", lambda: megalite_side(config, tokens, True)),
                        ("megalite_zero1", lambda: megalite_side(config, tokens, False))):
        step, resident = build()
        for _ in range(2):
            step()
        step_fns[name], memory[name] = step, resident()
    times = time_interleaved(step_fns, steps)
    params = sum(p.numel() for p in GPTModel(config).parameters())
    return {"times": times, "memory": memory, "params": params, "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-parallel-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    args = parser.parse_args()
    per_rank = run_distributed(compare, args.data_parallel_size, args.hidden, args.layers, args.vocab, args.seq_length, args.batch,
                               args.steps, timeout=900)
    r0 = per_rank[0]
    print(f"GPT h={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq_length} batch/rank={args.batch}: "
          f"{r0['params'] / 1e6:.2f}M params, dp={args.data_parallel_size}, {device().type}, load average {r0['load']:.1f}")
    for name in ("plain_fsdp2", "megalite_fsdp2", "megalite_zero1"):
        wall, cpu = r0["times"][name]
        mib = max(r["memory"][name] for r in per_rank) / 2**20
        print(f"  {name:15s} step {wall * 1e3:8.1f} ms   CPU/step (all ranks) {cpu * 1e3:8.1f} ms   "
              f"params+grads+optimizer/rank {mib:7.2f} MiB")
    t = {k: v[0] for k, v in r0["times"].items()}
    c = {k: v[1] for k, v in r0["times"].items()}
    m = {k: max(r["memory"][k] for r in per_rank) for k in r0["memory"]}
    print(f"  megalite FSDP2 / plain torch FSDP2: step {t['megalite_fsdp2'] / t['plain_fsdp2']:.3f} "
          f"(target <= 1.05), CPU {c['megalite_fsdp2'] / c['plain_fsdp2']:.3f}")
    print(f"  megalite FSDP2 / megalite ZeRO-1: step {t['megalite_fsdp2'] / t['megalite_zero1']:.3f}, "
          f"CPU {c['megalite_fsdp2'] / c['megalite_zero1']:.3f}, "
          f"memory {m['megalite_fsdp2'] / m['megalite_zero1']:.3f}")


if __name__ == "__main__":
    main()
