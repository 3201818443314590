"""Non-finite loss and gradient guard (``--check-for-nan-in-loss-and-grad``) and loss-spike warnings.

Every iteration, after the backward and before the optimizer step, each rank checks the reduced
loss and its own gradient buffers for nan/inf, and one small all-reduce over the world tells every
rank which ranks saw one.  By default the run then stops with one error naming the iteration and
those ranks, before the update: non-finite values never reach the weights, so no checkpoint (and
no ``latest``) can hold them.  ``--skip-nan-iterations K`` drops the update instead, up to K
consecutive times, as fp16's loss scaler does for overflows (under fp16 the scaler keeps handling
gradient overflows; the guard then checks the loss only).

``--loss-spike-factor F`` warns when an iteration's loss exceeds F times the median of the
previous ``loss_spike_window`` losses, naming the iteration and the samples it consumed, so a bad
stretch of data can be found.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import topology


@dataclass
class NanGuardConfig:
    """What the guard checks and how it reacts; the flags of the same names set it."""

    check_for_nan_in_loss_and_grad: bool = True
    skip_nan_iterations: int = 0
    loss_spike_factor: float | None = None
    loss_spike_window: int = 20

    def validate(self) -> None:
        if self.skip_nan_iterations < 0:
            raise ValueError(f"--skip-nan-iterations must be >= 0, got {self.skip_nan_iterations}")
        if self.loss_spike_factor is not None and not self.loss_spike_factor > 1.0:
            raise ValueError(f"--loss-spike-factor must be greater than 1, got {self.loss_spike_factor}")
        if self.loss_spike_window < 1:
            raise ValueError(f"loss_spike_window must be >= 1, got {self.loss_spike_window}")


class NonFiniteError(ValueError):
    """The loss or the gradients (or weights about to be saved) hold nan or inf."""


_LOSS, _GRAD = 1, 2


def _ranks_with(flags: torch.Tensor, bit: int) -> list[int]:
    return [r for r, f in enumerate(flags.tolist()) if int(f) & bit]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no nan/inf.  A nan or inf element makes the sum nan or inf, so a finite sum
    answers in one pass without a boolean copy (~40x cheaper on a CPU); only a non-finite sum (which a huge
    but finite buffer can give) is checked element by element."""
    tensor = tensor.detach()
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _world_flags(local: int) -> torch.Tensor:
    """Every rank's ``local`` bit mask, gathered with one all-reduce (a no-op without a process group)."""
    if not dist.is_initialized():
        return torch.tensor([local], dtype=torch.int32)
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=topology.device())
    flags[dist.get_rank()] = local
    dist.all_reduce(flags)
    return flags.cpu()


class NanGuard:
    """Per-run state of the guard: consecutive skips and the recent losses for spike detection."""

    def __init__(self, config: NanGuardConfig, *, check_grads: bool = True, log: bool = True):
        config.validate()
        self.config = config
        self.check_grads = check_grads
        self.log = log
        self.consecutive = 0
        self.recent: deque[float] = deque(maxlen=config.loss_spike_window)

    def check(self, iteration: int, loss: float | None, grad_buffers) -> bool:
        """True when the update may be applied, False when it is to be skipped; raises to stop.

        Collective over the default group: every rank calls it every iteration.
        """
        if not self.config.check_for_nan_in_loss_and_grad:
            return True
        local = _LOSS if loss is not None and not math.isfinite(loss) else 0
        if self.check_grads and not all(all_finite(b) for b in grad_buffers):
            local |= _GRAD
        flags = _world_flags(local)
        if not bool(flags.any()):
            self.consecutive = 0
            return True
        self.consecutive += 1
        parts = []
        if _ranks_with(flags, _LOSS):
            parts.append(f"the loss is {loss}")
        grad_ranks = _ranks_with(flags, _GRAD)
        if grad_ranks:
            parts.append(f"gradients hold nan/inf on ranks {grad_ranks}")
        what = f"iteration {iteration}: {' and '.join(parts)}"
        limit = self.config.skip_nan_iterations
        if self.consecutive <= limit:
            if self.log:
                print(f"warning: {what}; skipping the update ({self.consecutive} of at most {limit} consecutive, "
                      f"--skip-nan-iterations)", file=sys.stderr, flush=True)
            return False
        if limit:
            raise NonFiniteError(f"{what}; {self.consecutive} consecutive non-finite iterations exceed "
                                 f"--skip-nan-iterations {limit}; stopping before the update")
        raise NonFiniteError(f"{what}; stopping before the update so no non-finite weights are saved "
                             "(--check-for-nan-in-loss-and-grad; --skip-nan-iterations K skips such updates instead)")

    def observe_loss(self, iteration: int, loss: float | None, first_sample: int, end_sample: int) -> None:
        """Warn (once, on the logging rank) when ``loss`` spikes above the running median."""
        factor = self.config.loss_spike_factor
        if factor is None or loss is None or not math.isfinite(loss):
            return
        if len(self.recent) >= min(5, self.recent.maxlen):
            median = statistics.median(self.recent)
            if loss > factor * median and self.log:
                print(f"warning: loss spike at iteration {iteration}: loss {loss:.4f} is {loss / median:.1f}x the "
                      f"median {median:.4f} of the previous {len(self.recent)} iterations (--loss-spike-factor "
                      f"{factor}); this batch is global samples [{first_sample}, {end_sample})",
                      file=sys.stderr, flush=True)
        self.recent.append(loss)


def check_finite_weights(model_chunks, iteration: int) -> None:
    """Raise NonFiniteError on every rank when any rank's parameters hold nan/inf (collective)."""
    local = 0
    for chunk in model_chunks:
        if not all(all_finite(p) for p in chunk.parameters()):
            local = 1
    flags = _world_flags(local)
    if bool(flags.any()):
        raise NonFiniteError(f"not saving iteration {iteration}: the weights hold nan/inf on ranks "
                             f"{_ranks_with(flags, 1)}")
