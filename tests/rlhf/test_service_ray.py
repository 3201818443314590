"""TrainingService with ``backend="ray"`` on a local CPU Ray cluster: the same calls give exactly the local
backend's losses, weights and checkpoints; a killed actor fails pending and later calls with the worker's name
and last message; shutdown leaves no worker process and stops Ray only when the last service on a cluster the
services started closes; the NaN guard keeps a non-finite step out of the weights; a cluster too small for the
workers is one clear error."""

import asyncio
import os
import signal

import pytest
import torch

from megalite.rlhf import ParallelLayout, TrainingService
from megalite.rlhf.service_ray_reaper import children
from tests.rlhf.test_service import OPTIM, alive_pids, toy_batch
from tests.rlhf.common import config

ray = pytest.importorskip("ray")

DEADLINE = 240  # seconds for the whole scenario: a failure, never a hang


def watchers() -> list[int]:
    """This process's children that watch a Ray cluster a service started (``service_ray_reaper.py``)."""
    found = []
    for pid in children(os.getpid()):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"service_ray_reaper.py" in f.read():
                found.append(pid)
    return found


async def _service(backend, path, layout=ParallelLayout(tp=2, micro_batch_size=2)):
    return await TrainingService.options(procs=layout.world_size, backend=backend).as_service(
        model=config(), optimizer=OPTIM, loss_fn="language_model", parallel=layout, checkpoint_dir=str(path))


async def _ray_equals_local(tmp_path):
    remote, local = await asyncio.gather(_service("ray", tmp_path / "ray"), _service("local", tmp_path / "local"))
    assert watchers() == []  # a cluster the service did not start is not its to stop
    losses = {}
    for name, service in (("ray", remote), ("local", local)):
        calls = []
        for step in range(2):  # pipelined: every call is queued before the first is awaited
            calls += [service.forward_backward(toy_batch(step)), service.optim_step()]
        losses[name] = [m["lm_loss"] for m in (await asyncio.gather(*calls))[::2]]
    assert losses["ray"] == losses["local"]
    weights_ray, weights_local = await asyncio.gather(remote.get_weights(), local.get_weights())
    assert sorted(weights_ray) == sorted(weights_local)
    for name, value in weights_local.items():
        assert torch.equal(weights_ray[name], value), name
    # A checkpoint the Ray workers wrote (model + optimizer) continues identically in the local workers.
    await local.load(await remote.save(2))
    after = await asyncio.gather(remote.forward_backward(toy_batch(5)), local.forward_backward(toy_batch(5)))
    assert after[0]["lm_loss"] == after[1]["lm_loss"]
    await local.shutdown()

    pid = remote.pids[1]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"training worker 1 \(pid {pid}, Ray actor \w+\) died: .+; its last "
                                           r"message: forward_backward #\d+ \(ok\)"):
        await remote.optim_step()
    with pytest.raises(RuntimeError, match=rf"training worker 1 \(pid {pid}, "):
        await remote.forward_backward(toy_batch(0))
    pids = remote.pids
    await remote.shutdown()
    assert alive_pids(pids) == []  # the surviving actor was killed too
    assert ray.is_initialized()  # the service leaves a Ray connection it found


def test_ray_backend_equals_local_and_reports_a_killed_actor(tmp_path):
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        asyncio.run(asyncio.wait_for(_ray_equals_local(tmp_path), DEADLINE))
    finally:
        ray.shutdown()


async def _shared_ray(tmp_path):
    one = ParallelLayout(micro_batch_size=2)
    first, second = await asyncio.gather(_service("ray", tmp_path / "a", one), _service("ray", tmp_path / "b", one))
    watcher = watchers()
    assert len(watcher) == 1  # one watcher for the cluster they started, which it kills if this process dies
    with pytest.raises(ValueError, match=r"backend='ray' needs 4 CPUs \(one per worker\), the Ray cluster has 2"):
        await _service("ray", tmp_path / "big", ParallelLayout(tp=2, dp=2))
    pids = first.pids + second.pids
    await first.shutdown()
    assert ray.is_initialized()  # the second service still uses the cluster
    # The NaN guard runs in Ray actors as in local workers: no update from a non-finite step.
    poisoned = toy_batch(1)
    poisoned["loss_mask"][0, 0] = float("nan")
    before = await second.get_weights()
    await second.forward_backward(poisoned)
    with pytest.raises(RuntimeError, match=r"optim_step failed on worker 0: NonFiniteError: iteration 1: the loss is "
                                           r"nan"):
        await second.optim_step()
    for name, value in (await second.get_weights()).items():
        assert torch.equal(value, before[name]), name
    await second.shutdown()
    assert alive_pids(pids) == []
    assert not ray.is_initialized()  # the last service on the cluster they started stopped it
    assert alive_pids(watcher) == []  # and let its watcher go


def test_services_share_the_ray_they_start(tmp_path):
    assert not ray.is_initialized()
    try:
        asyncio.run(asyncio.wait_for(_shared_ray(tmp_path), DEADLINE))
    finally:
        ray.shutdown()
