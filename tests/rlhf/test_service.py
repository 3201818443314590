"""TrainingService: workers at tp2 train exactly like one worker (same seed, same batches, pipelined calls),
weights and checkpoints move between layouts, a killed worker fails pending and later calls with its name and last
message (so does one that hangs past the timeout: the stopped one, not the one waiting for it), shutdown leaves no
process, and bad input is one clear error.  More faults: test_service_faults.py."""

import asyncio
import os
import re
import signal

import pytest
import torch

from megalite.optim import OptimizerConfig
from megalite.rlhf import ParallelLayout, TrainingService
from tests.rlhf.common import config
from tests.run_once import run_once

OPTIM = OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0)


def toy_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 40, (4, 7), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(4, 6)}


def alive_pids(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


async def _service(procs, layout, path):
    return await TrainingService.options(procs=procs, with_gpus=False, backend="local").as_service(
        model=config(), optimizer=OPTIM, loss_fn="language_model", parallel=layout, checkpoint_dir=str(path))


async def _losses(service, batches) -> list[float]:
    """Pipelined training steps: every call is queued before the first is awaited; the losses."""
    calls = []
    for batch in batches:
        calls += [service.forward_backward(batch), service.optim_step()]
    return [m["lm_loss"] for m in (await asyncio.gather(*calls))[::2]]


async def _parity(tmp_path):
    tp2 = await _service(2, ParallelLayout(tp=2, micro_batch_size=2), tmp_path / "tp2")
    one = await _service(1, ParallelLayout(micro_batch_size=2), tmp_path / "one")
    losses = {name: await _losses(service, [toy_batch(0)] * 2) for name, service in (("tp2", tp2), ("one", one))}
    assert losses["tp2"] == pytest.approx(losses["one"], rel=1e-5, abs=1e-6)
    assert losses["one"][1] < losses["one"][0]
    weights_tp2, weights_one = await tp2.get_weights(), await one.get_weights()
    assert sorted(weights_tp2) == sorted(weights_one)
    for name in weights_one:
        torch.testing.assert_close(weights_tp2[name], weights_one[name], rtol=0, atol=1e-5)
    # A checkpoint of the tp2 service (model + optimizer) loads into the single worker and trains identically.
    saved = await tp2.save(2)
    await one.load(saved)
    next_tp2, next_one = (await asyncio.gather(tp2.forward_backward(toy_batch(5)), one.forward_backward(toy_batch(5))))
    assert next_one["lm_loss"] == pytest.approx(next_tp2["lm_loss"], rel=1e-5)
    await asyncio.gather(tp2.optim_step(), one.optim_step())
    # Weights loaded from a dict reach every worker.
    shifted = {k: v + 0.01 for k, v in weights_one.items()}
    await tp2.load_weights(shifted)
    for name, value in (await tp2.get_weights()).items():
        torch.testing.assert_close(value, shifted[name], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"batch\['loss_mask'\] has shape \(3, 6\)"):
        tp2.forward_backward({**toy_batch(0), "loss_mask": torch.ones(3, 6)})
    with pytest.raises(ValueError, match="batch of 3 sequences is not divisible by dp=1 x micro_batch_size=2"):
        tp2.forward_backward({k: v[:3] for k, v in toy_batch(0).items()})
    pids = tp2.pids + one.pids
    await asyncio.gather(tp2.shutdown(), one.shutdown())
    assert alive_pids(pids) == []
    with pytest.raises(RuntimeError, match="optim_step called after shutdown"):
        tp2.optim_step()


def test_service_tp2_equals_one_worker_and_moves_weights(tmp_path):
    asyncio.run(_parity(tmp_path))


async def _pipelined(tmp_path):
    """Two pipeline stages (chunks from ``pipeline.build_chunks``) train like one worker; weights agree."""
    pp2 = await _service(2, ParallelLayout(pp=2, micro_batch_size=2), tmp_path / "pp2")
    one = await _service(1, ParallelLayout(micro_batch_size=2), tmp_path / "one")
    losses = {name: await _losses(service, [toy_batch(0), toy_batch(1)])
              for name, service in (("pp2", pp2), ("one", one))}
    assert losses["pp2"] == pytest.approx(losses["one"], rel=1e-5, abs=1e-6)
    weights_pp2, weights_one = await pp2.get_weights(), await one.get_weights()
    assert sorted(weights_pp2) == sorted(weights_one)
    for name in weights_one:
        torch.testing.assert_close(weights_pp2[name], weights_one[name], rtol=0, atol=1e-5)
    await asyncio.gather(pp2.shutdown(), one.shutdown())


def test_service_pp2_equals_one_worker(tmp_path):
    asyncio.run(_pipelined(tmp_path))


async def _killed(tmp_path):
    service = await _service(2, ParallelLayout(dp=2, micro_batch_size=2), tmp_path)
    await service.optim_step()
    os.kill(service.pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"training worker 1 \(pid \d+\) exited with code -9; its last message: "
                                           r"optim_step #\d+ \(ok\)"):
        await service.forward_backward(toy_batch(0))
    with pytest.raises(RuntimeError, match="training worker 1"):
        await service.optim_step()
    pids = service.pids
    await service.shutdown()
    assert alive_pids(pids) == []


def test_killed_worker_fails_pending_and_later_calls(tmp_path):
    asyncio.run(_killed(tmp_path))


@run_once
async def stopped_worker(tmp_path) -> tuple[Exception | None, list[int]]:
    """Stop (SIGSTOP) worker 1 of a two-worker service with a 3 s timeout, then call forward_backward: worker 0
    waits for it in a collective.  Returns the call's exception (None if it returned) and the workers still alive
    after shutdown.  Worker 1 is silent for the whole timeout, longer than the service's SILENT_SECONDS (2 s)."""
    service = await TrainingService.options(procs=2, timeout=3.0).as_service(
        model=config(), optimizer=OPTIM, loss_fn="language_model", parallel=ParallelLayout(dp=2, micro_batch_size=2),
        checkpoint_dir=str(tmp_path))
    os.kill(service.pids[1], signal.SIGSTOP)
    error = None
    try:
        await service.forward_backward(toy_batch(0))
    except Exception as err:  # noqa: BLE001 - the caller checks which error it is
        error = err
    pids = service.pids
    await service.shutdown()
    return error, alive_pids(pids)


def test_hung_worker_times_out(tmp_path):
    # The stopped one is named, by its silent heartbeat.
    error, alive = asyncio.run(stopped_worker(tmp_path))
    assert isinstance(error, RuntimeError) and re.search(
        r"training worker 1 did not answer forward_backward #\d+ within 3 s and sent no heartbeat for \d+ s \(stopped "
        r"or frozen\); its last message: ready #\d+ \(ok\)", str(error)), error
    assert alive == []


def test_procs_must_match_layout(tmp_path):
    with pytest.raises(ValueError, match=r"procs=3 does not match the layout tp=2 x pp=1 x dp=1 = 2 processes"):
        asyncio.run(_service(3, ParallelLayout(tp=2), tmp_path))


@pytest.mark.slow
def test_the_service_example_trains_as_pretraining_does(tmp_path):
    """The journey's seam: examples/training_service.py, as a user runs it, gets pretrain_gpt.py's losses
    (it exits non-zero when they differ).  Its pretraining run takes the example's default schedule flags,
    so a schedule change that the service's fixed learning rate does not follow fails here."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, os.path.join(root, "examples", "training_service.py"), "--train-iters", "2"],
                         cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "losses match" in run.stdout
