"""Context parallelism: communication volume, load balance, activation memory and ring overlap, in one run.

1. Bytes each rank sends per attention layer (forward + backward) for p2p, all_gather and a2a at cp 2
   and 4, counted at the collectives megalite calls, beside the analytic amount (target ratio 1.00).
2. Attention FLOPs per rank (the tiles actually computed), max/min over the CP ranks, with the
   2*cp-chunk load balancing and with contiguous blocks (target <= 1.05 balanced).
3. Activation memory per rank at seq 8192 for a tiny GPT (bytes autograd saves for backward,
   parameters excluded), cp 1/2/4, beside cp1/cp (target: within 10%).
4. Ring (p2p) at cp2: seconds waiting on receives as a share of the attention's time, by sequence
   length (target < 10% once blocks are large).

    python benchmarks/context_parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.context_parallel import chunk_indices, context_parallel_attention
from megalite.context_parallel.blockwise import Tokens, attention_forward
from megalite.testing import run_distributed

BYTES = 4  # fp32


# 1. communication volume -------------------------------------------------------------------------

def _count_bytes(counter: dict):
    """Wrap the collectives the CP attention uses so each call adds the bytes this rank sends."""
    originals = {name: getattr(dist, name) for name in
                 ("batch_isend_irecv", "all_gather_single", "reduce_scatter_single", "all_to_all_single")}

    def nbytes(t):
        return t.numel() * t.element_size()

    def batch_isend_irecv(ops):
        counter["bytes"] += sum(nbytes(op.tensor) for op in ops if op.op is dist.isend)
        return originals["batch_isend_irecv"](ops)

    def all_gather_single(out, x, group=None, async_op=False):
        counter["bytes"] += (dist.get_world_size(group) - 1) * nbytes(x)
        return originals["all_gather_single"](out, x, group=group, async_op=async_op)

    def reduce_scatter_single(out, x, group=None, async_op=False):
        counter["bytes"] += (dist.get_world_size(group) - 1) * nbytes(out)
        return originals["reduce_scatter_single"](out, x, group=group, async_op=async_op)

    def all_to_all_single(out, x, group=None, **kwargs):
        size = dist.get_world_size(group)
        counter["bytes"] += nbytes(x) * (size - 1) // size
        return originals["all_to_all_single"](out, x, group=group, **kwargs)

    for name, fn in (("batch_isend_irecv", batch_isend_irecv), ("all_gather_single", all_gather_single),
                     ("reduce_scatter_single", reduce_scatter_single), ("all_to_all_single", all_to_all_single)):
        setattr(dist, name, fn)
    return originals


def analytic_bytes(comm: str, cp: int, seq: int, b: int, heads: int, groups: int, d: int) -> int:
    """What one rank must send for one attention layer's forward and backward."""
    q = seq // cp * b * heads * d * BYTES
    kv = 2 * seq // cp * b * groups * d * BYTES
    if comm == "p2p":  # K,V around the ring (cp-1 hops) twice, plus the dK,dV accumulators' full turn
        return 2 * (cp - 1) * kv + cp * kv
    if comm == "all_gather":  # gather K,V, then reduce-scatter dK,dV
        return 2 * (cp - 1) * kv
    return 2 * (cp - 1) * (2 * q + kv) // cp  # a2a: q,k,v in and the output back, twice (forward, backward)


def _bytes_rank(cp, seq, b, heads, groups, d):
    topo = topology.initialize(cp=cp)
    counter = {"bytes": 0}
    results = {}
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq // cp, b, heads, d, generator=gen, requires_grad=True)
    k = torch.randn(seq // cp, b, groups, d, generator=gen, requires_grad=True)
    v = torch.randn(seq // cp, b, groups, d, generator=gen, requires_grad=True)
    originals = _count_bytes(counter)
    try:
        for comm in ("p2p", "all_gather", "a2a"):
            counter["bytes"] = 0
            context_parallel_attention(q, k, v, group=topo.cp.group, comm_type=comm).sum().backward()
            results[comm] = counter["bytes"]
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return results


def bench_bytes(seq: int) -> None:
    b, heads, groups, d = 1, 8, 8, 32
    print(f"\n1. bytes sent per rank per attention layer (fwd+bwd), seq {seq}, {heads} heads, d {d}, fp32")
    print(f"{'cp':>3} {'comm':>11} {'measured MiB':>13} {'analytic MiB':>13} {'ratio':>6}")
    for cp in (2, 4):
        measured = run_distributed(_bytes_rank, cp, cp, seq, b, heads, groups, d, timeout=600)
        for comm in ("p2p", "all_gather", "a2a"):
            worst = max(r[comm] for r in measured)
            want = analytic_bytes(comm, cp, seq, b, heads, groups, d)
            print(f"{cp:>3} {comm:>11} {worst / 2**20:>13.3f} {want / 2**20:>13.3f} {worst / want:>6.3f}")


# 2. load balance ---------------------------------------------------------------------------------

def bench_flops(seq: int, tile: int) -> None:
    print(f"\n2. attention FLOPs per rank (tiles computed, tile {tile}), seq {seq}: max/min over CP ranks")
    print(f"{'cp':>3} {'balanced':>9} {'contiguous':>11}")
    q = torch.zeros(1, 1, seq, 8)
    for cp in (2, 4, 8):
        ratios = []
        for balance in (True, False):
            flops = []
            for rank in range(cp):
                positions = chunk_indices(seq, cp, rank, load_balance=balance)
                stats = {}
                attention_forward(q[:, :, positions], q, q, Tokens(positions, None, tile),
                                  Tokens(torch.arange(seq), None, tile), 1.0, stats)
                flops.append(stats["forward_flops"])
            ratios.append(max(flops) / min(flops))
        print(f"{cp:>3} {ratios[0]:>9.3f} {ratios[1]:>11.3f}")


# 3. activation memory ----------------------------------------------------------------------------

def _memory_rank(seq):
    from megalite.models import GPTConfig, GPTModel

    topo = topology.initialize(cp=dist.get_world_size())
    cp = topo.cp.size
    config = GPTConfig(vocab_size=100, num_layers=1, hidden_size=64, num_attention_heads=4,
                       position_embedding_type="rope", make_vocab_size_divisible_by=8, max_position_embeddings=seq)
    model = GPTModel(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(0))
    index = chunk_indices(seq, cp, topo.cp.rank)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids[:, index], ids[:, index])
    loss.sum().backward()
    return sum(saved.values())


def bench_memory(seq: int) -> None:
    print(f"\n3. activation memory per rank (autograd-saved bytes, weights excluded), tiny GPT, seq {seq}")
    print(f"{'cp':>3} {'MiB (max rank)':>15} {'cp1/cp MiB':>11} {'ratio':>6}")
    base = None
    for cp in (1, 2, 4):
        worst = max(run_distributed(_memory_rank, cp, seq, timeout=600))
        base = worst if base is None else base
        print(f"{cp:>3} {worst / 2**20:>15.2f} {base / cp / 2**20:>11.2f} {worst / (base / cp):>6.3f}")


# 4. ring overlap ---------------------------------------------------------------------------------

def _ring_rank(seq, heads, d, repeats):
    topo = topology.initialize(cp=dist.get_world_size())
    cp = topo.cp.size
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seq // cp, 1, heads, d, generator=gen, requires_grad=True) for _ in range(3))
    context_parallel_attention(q, k, v, group=topo.cp.group).sum().backward()  # warm-up
    stats = {}
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        context_parallel_attention(q, k, v, group=topo.cp.group, stats=stats).sum().backward()
    wall = (time.perf_counter() - start) / repeats
    return stats["wait_s"] / stats["total_s"], wall


def bench_ring(seqs: list[int]) -> None:
    heads, d = 4, 64
    print(f"\n4. ring (p2p) at cp2: receive-wait share of attention time (fwd+bwd), {heads} heads, d {d}")
    print(f"{'seq':>6} {'block tokens':>13} {'wait share (max rank)':>22} {'ms/step':>8}")
    for seq in seqs:
        results = run_distributed(_ring_rank, 2, seq, heads, d, 3 if seq <= 4096 else 1, timeout=600)
        share = max(r[0] for r in results)
        wall = max(r[1] for r in results)
        print(f"{seq:>6} {seq // 2:>13} {share:>22.3f} {1000 * wall:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    quick = args.quick
    bench_bytes(256 if quick else 2048)
    bench_flops(1024 if quick else 8192, 128)
    bench_memory(1024 if quick else 8192)
    bench_ring([256, 1024] if quick else [256, 1024, 4096, 8192])


if __name__ == "__main__":
    main()
