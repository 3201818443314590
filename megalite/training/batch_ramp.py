"""Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES``: a global batch that grows with the samples seen.

Megatron-Core's ``RampupBatchsizeNumMicroBatchesCalculator`` starts at ``START`` samples per
iteration and adds ``INCREMENT`` each time another ``SAMPLES / ((GLOBAL - START) / INCREMENT)``
samples have been consumed, reaching ``--global-batch-size`` once more than ``SAMPLES`` have been.
Each iteration runs ``batch / (micro batch * dp)`` micro-batches, advances the consumed samples
and the learning-rate schedule by its own batch, and Megatron-LM counts the run's iterations
from ``--train-samples`` by walking the ramp.  :class:`BatchSizeRamp` is that arithmetic, with
Megatron's float division, so every iteration's batch equals Megatron's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizeRamp:
    """The ramp from ``start`` to ``global_batch_size`` in steps of ``increment`` over ``ramp_samples`` samples."""

    start: int
    increment: int
    ramp_samples: int
    global_batch_size: int

    def __post_init__(self):
        flag = f"--rampup-batch-size {self.start} {self.increment} {self.ramp_samples}"
        if self.start < 1 or self.increment < 1 or self.ramp_samples < 1:
            raise ValueError(f"{flag}: the start batch size, increment and ramp-up samples must be positive")
        if not self.start < self.global_batch_size:
            raise ValueError(f"{flag}: the start batch size must be below --global-batch-size "
                             f"{self.global_batch_size}")
        if (self.global_batch_size - self.start) % self.increment:
            raise ValueError(f"{flag}: --global-batch-size {self.global_batch_size} minus the start batch size "
                             f"({self.global_batch_size - self.start}) is not divisible by the increment")

    @property
    def samples_per_increment(self) -> float:
        """Samples between two increments (a float, as Megatron-Core divides)."""
        return self.ramp_samples / ((self.global_batch_size - self.start) // self.increment)

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples."""
        if consumed_samples > self.ramp_samples:
            return self.global_batch_size
        return self.start + int(consumed_samples / self.samples_per_increment) * self.increment

    def batch_sizes(self) -> list[int]:
        """Every global batch size the ramp can use, from ``start`` to ``global_batch_size`` (a run skips some
        when one batch holds more samples than an increment's share)."""
        return list(range(self.start, self.global_batch_size + 1, self.increment))

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run, counted as Megatron-LM counts them.

        The ramp's iterations run while at most ``ramp_samples`` (and at most ``train_samples``) samples
        are consumed; then whole global batches follow, a partial last one dropped.
        """
        iterations, consumed = 0, 0
        while consumed <= self.ramp_samples and consumed <= train_samples:
            consumed += self.batch_size(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


def batch_ramp(args) -> BatchSizeRamp | None:
    """The ramp of ``--rampup-batch-size`` (None without it); ``args.global_batch_size`` must be set."""
    if args.rampup_batch_size is None:
        return None
    start, increment, samples = args.rampup_batch_size
    return BatchSizeRamp(start, increment, samples, args.global_batch_size)
