"""Run a function on N ranks in separate processes, for multi-rank tests.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes,
initializes the default process group in each (gloo on CPU, NCCL when there
are enough GPUs), calls ``fn(*args)`` on every rank and returns the list of
per-rank results.  If any rank raises, or the whole run exceeds ``timeout``,
every rank is killed and an AssertionError reports each failing rank's
traceback and the ranks that hung.  A failing test never hangs the suite.
Each rank leads a process group of its own, so whatever it started (a
Megatron-Core save's Manager process, a subprocess) is stopped with it: a run
leaves no process behind.

Processes come from a fork server that has imported torch once (and whatever
``preload`` named), so starting ranks is cheap; ``fn`` and its arguments must be
picklable (module-level).
Results travel as pickled bytes, so CPU tensors can be returned even though
the rank process exits before the parent reads them.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback

_GRACE_S = 5.0
_PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "megalite.topology"]


def preload(*modules: str) -> None:
    """Have the fork server also import ``modules`` (names; one that raises ImportError is skipped), so every rank
    starts with them imported instead of importing them itself: a test suite's common imports cost each rank a
    fraction of a second otherwise, each run.  Call it before this process's first ``run_distributed``, which
    starts the fork server."""
    _PRELOAD.extend(name for name in modules if name not in _PRELOAD)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def use_gpus(world_size: int) -> bool:
    """True when the harness would run ``world_size`` ranks on NCCL."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def _worker(rank, world_size, host, port, backend, timeout_s, fn, args, kwargs, results):
    os.setpgrp()  # the rank's group: what it starts is stopped with it (_stop)
    os.environ.update({
        "MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
    })
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(*args, **kwargs)
            # No rank tears its groups down while a peer may still be connecting them.
            dist.barrier()
        finally:
            from megalite import topology

            topology.destroy()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _stop(procs, exit_by: float) -> None:
    """Let the ranks exit on their own until ``exit_by`` (``time.monotonic()``): their multiprocessing finalizers
    stop what they started (a Manager's server process would outlive a rank killed during its exit), then kill each
    rank's process group: the rank if still running and anything it started that is."""
    for p in procs:
        p.join(timeout=max(0.0, exit_by - time.monotonic()))
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:  # the rank and all it started have exited (or it never made its group)
            pass
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, backend: str | None = None,
                    **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result."""
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if use_gpus(world_size) else "gloo"
    ctx = _context()
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, host, store.port, backend, timeout, fn, args, kwargs, results))
             for r in range(world_size)]
    for p in procs:
        p.start()

    outcome: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    first_error = None
    try:
        while len(outcome) < world_size:
            now = time.monotonic()
            limit = deadline if first_error is None else min(deadline, first_error + _GRACE_S)
            if now >= limit:
                break
            try:
                rank, status, value = results.get(timeout=min(0.2, limit - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode not in (None, 0)]
                for r in dead:
                    outcome[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode}\n")
                    first_error = first_error or time.monotonic()
                continue
            outcome[rank] = (status, value)
            if status == "error" and first_error is None:
                first_error = time.monotonic()
    finally:  # also on KeyboardInterrupt: the ranks are in groups of their own, out of a terminal's reach
        _stop(procs, exit_by=time.monotonic() + _GRACE_S if len(outcome) == world_size else 0.0)
    del store

    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    hung = [r for r in range(world_size) if r not in outcome]
    if errors or hung:
        parts = [f"{fn.__name__} on {world_size} ranks failed"]
        if hung:
            why = "after another rank failed" if errors else f"after the {timeout:.0f}s timeout"
            parts.append(f"ranks {hung} did not finish and were killed {why}")
        for r in sorted(errors):
            parts.append(f"--- rank {r} ---\n{errors[r]}")
        raise AssertionError("\n".join(parts))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
