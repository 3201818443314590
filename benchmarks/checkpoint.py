"""Checkpoint save/load: the DCP format vs the format before it (commit 3b80930), side by side in one run.

A ~100M-parameter GPT (hidden 768, 12 layers, vocab 32000) at tp=2 x dp=2 with ZeRO-1 on 4 CPU ranks,
after one optimizer step (so Adam state is saved too).  The old format's modules are taken from
``git show 3b80930:megalite/checkpoint/...`` and imported under another package name, so both run in the
same processes on the same model.  Each repeat alternates which side goes first; a time is the slowest
rank's, and the medians are printed with their ratios.  Loading is the trainer's: all ranks load together
(``group=WORLD``), sharing the data files' hash checks and agreeing before any parameter changes.
``--async-save``'s stall is the time the save call blocks training (copying the tensors into the saver's
staging buffers, kept from the previous save); the write, hashing and publishing run in the background.
Per-process CPU seconds (median over repeats, summed over the 4 ranks) are printed too: wall times on a
shared machine swing with the other load, CPU time much less.

    python benchmarks/checkpoint.py [--repeats 5] [--dir /tmp/megalite_ckpt_bench]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OLD_COMMIT = "3b80930"


def _old_package(directory):
    """The old checkpoint format's modules as package ``megalite_old_checkpoint`` (imports rewritten)."""
    package = os.path.join(directory, "megalite_old_checkpoint")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w"):
        pass
    for name in ("format", "sharding", "state"):
        text = subprocess.run(["git", "-C", ROOT, "show", f"{OLD_COMMIT}:megalite/checkpoint/{name}.py"],
                              check=True, capture_output=True, text=True).stdout
        with open(os.path.join(package, f"{name}.py"), "w") as f:
            f.write(text.replace("megalite.checkpoint.", "megalite_old_checkpoint."))
    return directory


def _build():
    import torch

    from megalite.distributed import DDPConfig, DistributedDataParallel
    from megalite.models import GPTConfig, GPTModel
    from megalite.optim import OptimizerConfig, get_optimizer

    config = GPTConfig(vocab_size=32000, num_layers=12, hidden_size=768, num_attention_heads=12,
                       max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    chunk = DistributedDataParallel(GPTModel(config), DDPConfig(use_distributed_optimizer=True))
    optimizer = get_optimizer(OptimizerConfig(lr=1e-4), [chunk])
    ids = torch.randint(0, 32000, (1, 17), generator=torch.Generator().manual_seed(0))
    optimizer.zero_grad()
    chunk(ids[:, :-1], ids[:, 1:]).mean().backward()
    chunk.finish_grad_sync()
    optimizer.step()
    return chunk, optimizer


def _timed(fn, cpu=None):
    """The slowest rank's wall seconds of ``fn()``; with a ``cpu`` list, also append the CPU seconds of all ranks."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start, used = time.perf_counter(), time.process_time()
    fn()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    used = torch.tensor([time.process_time() - used], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(used)
    if cpu is not None:
        cpu.append(used.item())
    return seconds.item()


def _rank(old_dir, work, repeats):
    sys.path.insert(0, old_dir)
    import torch.distributed as dist

    from megalite import checkpoint, topology
    from megalite_old_checkpoint import format as old_format
    from megalite_old_checkpoint import state as old_state

    topology.initialize(tp=2)
    chunk, optimizer = _build()
    params = sum(p.numel() for p in chunk.module.parameters())
    saver = checkpoint.AsyncSaver()
    rank0 = dist.get_rank() == 0

    def fresh(name):
        path = os.path.join(work, name)
        if rank0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return path

    def old_save(path):
        return lambda: old_state.save_checkpoint(path, 1, [chunk], optimizer)

    def old_load(path):
        return lambda: old_state.load_into(old_format.CheckpointReader(path), [chunk], optimizer)

    def new_save(path):
        return lambda: checkpoint.save_sharded(path, 1, [chunk], optimizer)

    def new_load(path):
        return lambda: checkpoint.load_sharded(path, [chunk], optimizer, group=dist.group.WORLD)

    times = {key: [] for key in ("old_save", "new_save", "old_load", "new_load", "async_stall", "async_total")}
    cpu = {key: [] for key in ("old_save", "new_save", "old_load", "new_load")}
    for repeat in range(repeats + 1):
        order = ("old", "new") if repeat % 2 == 0 else ("new", "old")
        result, used = {}, {key: [] for key in cpu}
        for side in order:
            path = fresh(side)
            save, load = (old_save, old_load) if side == "old" else (new_save, new_load)
            result[f"{side}_save"] = _timed(save(path), used[f"{side}_save"])
            result[f"{side}_load"] = _timed(load(path), used[f"{side}_load"])
        path = fresh("async")
        start = time.perf_counter()
        result["async_stall"] = _timed(lambda: checkpoint.save_sharded(path, 1, [chunk], optimizer, saver=saver))
        saver.wait()
        result["async_total"] = _timed(lambda: None) + time.perf_counter() - start
        if repeat > 0:  # the first round warms the page cache and allocator
            for key, value in result.items():
                times[key].append(value)
            for key, value in used.items():
                cpu[key] += value
    saver.close()
    dist.barrier()
    return {"params": params, "times": times, "cpu": cpu} if rank0 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary dir)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megalite.testing import run_distributed

    with tempfile.TemporaryDirectory() as old_dir:
        work = args.dir or tempfile.mkdtemp(prefix="megalite_ckpt_bench_")
        try:
            result = run_distributed(_rank, 4, _old_package(old_dir), work, args.repeats, timeout=3600)[0]
        finally:
            if args.dir is None:
                shutil.rmtree(work, ignore_errors=True)
    times = {k: statistics.median(v) for k, v in result["times"].items()}
    print(f"GPT with {result['params'] * 2 / 1e6:.0f}M parameters (tp=2 x dp=2, ZeRO-1, fp32 + Adam state), "
          f"{args.repeats} repeats, medians of the slowest rank:")
    print(f"  save: old {times['old_save']:.3f} s, DCP {times['new_save']:.3f} s, "
          f"ratio {times['new_save'] / times['old_save']:.3f}")
    print(f"  load: old {times['old_load']:.3f} s, DCP {times['new_load']:.3f} s, "
          f"ratio {times['new_load'] / times['old_load']:.3f}")
    cpu = {k: statistics.median(v) for k, v in result["cpu"].items()}
    for op in ("save", "load"):
        print(f"  {op} CPU seconds (4 ranks): old {cpu[f'old_{op}']:.2f}, DCP {cpu[f'new_{op}']:.2f}, "
              f"ratio {cpu[f'new_{op}'] / cpu[f'old_{op}']:.3f}")
    print(f"  --async-save stall {times['async_stall']:.3f} s = {times['async_stall'] / times['new_save']:.1%} "
          f"of the sync save (background write finished after {times['async_total']:.3f} s)")
    print("  per repeat:", {k: [round(x, 3) for x in v] for k, v in result["times"].items()})
    print("  CPU per repeat:", {k: [round(x, 2) for x in v] for k, v in result["cpu"].items()})


if __name__ == "__main__":
    main()
