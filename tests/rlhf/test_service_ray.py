"""TrainingService with ``backend="ray"`` on a local CPU Ray cluster: the same calls give exactly the local
backend's losses, weights and checkpoints; a killed actor fails pending and later calls with the worker's name
and last message; shutdown leaves no worker process, and stops Ray only if the service started it; a cluster
too small for the workers is one clear error."""

import asyncio
import os
import signal

import pytest
import torch

from megalite.rlhf import ParallelLayout, TrainingService
from tests.rlhf.test_service import OPTIM, _alive, _batch
from tests.rlhf.common import config

ray = pytest.importorskip("ray")

DEADLINE = 240  # seconds for the whole scenario: a failure, never a hang


async def _service(backend, path):
    return await TrainingService.options(procs=2, backend=backend).as_service(
        model=config(), optimizer=OPTIM, loss_fn="language_model", parallel=ParallelLayout(tp=2, micro_batch_size=2),
        checkpoint_dir=str(path))


async def _ray_equals_local(tmp_path):
    with pytest.raises(ValueError, match=r"backend='ray' needs 4 CPUs \(one per worker\), the Ray cluster has 2"):
        await TrainingService.options(procs=4, backend="ray").as_service(
            model=config(), optimizer=OPTIM, loss_fn="language_model", parallel=ParallelLayout(tp=2, dp=2),
            checkpoint_dir=str(tmp_path / "big"))
    remote, local = await asyncio.gather(_service("ray", tmp_path / "ray"), _service("local", tmp_path / "local"))
    losses = {}
    for name, service in (("ray", remote), ("local", local)):
        calls = []
        for step in range(2):  # pipelined: every call is queued before the first is awaited
            calls += [service.forward_backward(_batch(step)), service.optim_step()]
        losses[name] = [m["lm_loss"] for m in (await asyncio.gather(*calls))[::2]]
    assert losses["ray"] == losses["local"]
    weights_ray, weights_local = await asyncio.gather(remote.get_weights(), local.get_weights())
    assert sorted(weights_ray) == sorted(weights_local)
    for name, value in weights_local.items():
        assert torch.equal(weights_ray[name], value), name
    # A checkpoint the Ray workers wrote (model + optimizer) continues identically in the local workers.
    await local.load(await remote.save(2))
    after = await asyncio.gather(remote.forward_backward(_batch(5)), local.forward_backward(_batch(5)))
    assert after[0]["lm_loss"] == after[1]["lm_loss"]
    pids = remote.pids
    await asyncio.gather(remote.shutdown(), local.shutdown())
    assert _alive(pids) == []
    assert ray.is_initialized()  # the service leaves a cluster it found running


def test_ray_backend_equals_local(tmp_path):
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        asyncio.run(asyncio.wait_for(_ray_equals_local(tmp_path), DEADLINE))
    finally:
        ray.shutdown()


async def _killed_actor(tmp_path):
    service = await _service("ray", tmp_path)  # starts a local Ray cluster itself
    await service.optim_step()
    pid = service.pids[1]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"training worker 1 \(pid {pid}, Ray actor \w+\) died: .+; its last "
                                           r"message: optim_step #\d+ \(ok\)"):
        await service.forward_backward(_batch(0))
    with pytest.raises(RuntimeError, match=rf"training worker 1 \(pid {pid}, "):
        await service.optim_step()
    pids = service.pids
    await service.shutdown()
    assert _alive(pids) == []
    assert not ray.is_initialized()  # and stops the one it started


def test_killed_actor_fails_pending_and_later_calls(tmp_path):
    assert not ray.is_initialized()
    try:
        asyncio.run(asyncio.wait_for(_killed_actor(tmp_path), DEADLINE))
    finally:
        ray.shutdown()
