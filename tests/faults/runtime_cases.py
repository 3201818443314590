"""Campaign cases on running jobs: the TrainingService (a failed call, NaN, bad input, a second service on one
``checkpoint_dir``, its driver killed), ``tools/supervise.py`` signalled while it waits to restart, and a stale
dataset index cache."""

import asyncio
import json
import os
import signal

import torch

from megalite.training.nan_guard import NanGuardConfig
from tests.data.test_gpt_dataset import cached_samples, make_indexed
from tests.faults.campaign import Case, in_scratch, outcome
from tests.rlhf.common import VOCAB
from tests.rlhf.test_service import stopped_worker
from tests.rlhf.test_service_faults import (assert_same_step, flagged_batch, left_after_signalling_the_driver,
                                            open_service)
from tests.run_once import run_once
from tests.training.test_supervise import sigterm_during_the_restart_delay


async def _async_outcome(awaitable) -> str:
    try:
        await awaitable
    except Exception as err:  # noqa: BLE001 - the failure is the observation
        return f"{type(err).__name__}: {err}"
    return "returned"


async def _nan_loss_mask(service) -> str:
    poisoned = flagged_batch(1)
    poisoned["loss_mask"][1, 2] = float("nan")
    before = await service.get_weights()
    await service.forward_backward(poisoned)
    error = await _async_outcome(service.optim_step())
    unchanged = all(torch.equal(v, before[k]) for k, v in (await service.get_weights()).items())
    return f"weights {'unchanged' if unchanged else 'CHANGED'}; {error}"


@run_once
async def _service_faults(scratch) -> dict[str, str]:
    """The service cases' observations, from two one-worker services started once for all of them (a start is
    seconds of worker imports): ``guarded`` stops on a non-finite step (the default), ``skipping`` skips one.
    In order: a NaN in loss_mask on each; then a call failing in its second micro-batch on ``guarded``, and a
    retry that must equal ``skipping``'s step (neither kept a gradient); then the bad input the driver refuses."""
    guarded, skipping = await asyncio.gather(open_service(scratch / "service"), open_service(
        scratch / "skipping", nan_guard=NanGuardConfig(skip_nan_iterations=1)))
    try:
        seen = {"nan": await _nan_loss_mask(guarded), "nan, skip": await _nan_loss_mask(skipping)}
        error = await _async_outcome(guarded.forward_backward(flagged_batch(0, failing_rows=(2, 3))))
        same = await _async_outcome(assert_same_step(guarded, skipping, flagged_batch(0)))
        seen["retry"] = f"{error.split(':')[0]}; retry {'equals a fresh step' if same == 'returned' else same}"
        outside = flagged_batch(0)
        outside["input_ids"][3, 1] = VOCAB
        seen["out of vocab"] = outcome(lambda: guarded.forward_backward(outside))
        seen["save(-1)"] = outcome(lambda: guarded.save(-1))
        second = await _async_outcome(open_service(scratch / "service"))
        seen["second service"] = second.replace(str(scratch), "DIR").replace(f"pid {os.getpid()}", "pid DRIVER")
        return seen
    finally:
        await asyncio.gather(guarded.shutdown(), skipping.shutdown())


def _service_fault(name: str):
    """A ``run()``: the observation ``name`` of :func:`_service_faults` (run by the first such case)."""
    return in_scratch(lambda scratch: asyncio.run(_service_faults(scratch))[name])


def _stalled_worker(scratch) -> str:
    error, alive = asyncio.run(stopped_worker(scratch))
    return f"{len(alive)} workers left after shutdown; {type(error).__name__}: {error}"


def _driver_killed(scratch) -> str:
    _, left = left_after_signalling_the_driver(scratch, signal.SIGKILL)
    return f"processes it started left running: {', '.join(sorted(left.values())) or 'none'}"


def _supervise_sigterm(scratch) -> str:
    code, err, attempts = sigterm_during_the_restart_delay(scratch / "attempts")
    said = "SIGTERM received; not restarting" if "supervise: SIGTERM received; not restarting" in err else err
    return f"exit {code}, {said}, {attempts} attempt(s)"


def _stale_cache(scratch) -> str:
    """The data file changes (mtime) after its index cache was built: the cache is rebuilt."""
    make_indexed(scratch / "ds", seed=1)
    cache = scratch / "cache"
    cached_samples(scratch / "ds", cache)
    (record,) = cache.glob("*-megalite.json")
    before = json.loads(record.read_text())["files"]
    os.utime(scratch / "ds.bin", ns=(1, 1))
    samples = cached_samples(scratch / "ds", cache)
    rebuilt = json.loads(record.read_text())["files"] != before
    return f"cache {'rebuilt' if rebuilt else 'reused'}; samples " \
           f"{'equal' if samples == cached_samples(scratch / 'ds') else 'differ from'} an uncached dataset's"


CASES = [
    Case("stale dataset index cache", "cache rebuilt; samples equal an uncached dataset's", in_scratch(_stale_cache),
         fast=True),
    Case("service: forward_backward fails, then retry", "RuntimeError; retry equals a fresh step",
         _service_fault("retry")),
    Case("service: NaN in loss_mask", "weights unchanged; RuntimeError: optim_step failed on worker 0: "
         "NonFiniteError: iteration 1: the loss is nan and gradients hold nan/inf on ranks [0]; stopping before the "
         "update", _service_fault("nan")),
    Case("service: NaN in loss_mask, skip_nan_iterations=1", "weights unchanged; returned",
         _service_fault("nan, skip")),
    Case("service: out-of-vocab token id", f"ValueError: batch['input_ids'] holds token id {VOCAB}, outside the "
         f"vocabulary of {VOCAB} ids", _service_fault("out of vocab")),
    Case("service: save(-1)", "ValueError: save step must be a non-negative integer, got -1",
         _service_fault("save(-1)")),
    Case("service: two services on one checkpoint_dir", "ValueError: checkpoint_dir DIR/service is in use by another "
         "job (pid DRIVER on", _service_fault("second service")),
    Case("service worker stalled (SIGSTOP), the other waits", "0 workers left after shutdown; RuntimeError: "
         "training worker 1 did not answer forward_backward #", in_scratch(_stalled_worker)),
    Case("service driver killed (kill -9)", "processes it started left running: none",
         in_scratch(_driver_killed)),
    Case("SIGTERM to supervise during --restart-delay", f"exit {128 + signal.SIGTERM}, SIGTERM received; not "
         "restarting, 1 attempt(s)", in_scratch(_supervise_sigterm)),
]
