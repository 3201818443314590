"""Deterministic micro-batching whose global batches do not depend on the data-parallel size.

Global batch g is samples ``[g*G, (g+1)*G)`` of the (already shuffled)
dataset.  Data-parallel rank r owns the contiguous slice
``[g*G + r*G/dp, g*G + (r+1)*G/dp)`` and cuts it into micro-batches in order,
so concatenating every rank's micro-batches gives the global batch in order
for any dp size.  Resuming is a matter of passing ``consumed_samples``.  Under a batch-size ramp
(``batch_size_at``) global batch g starts where batch g-1 ended and holds ``batch_size_at(start)`` samples.
"""

from __future__ import annotations

from typing import Callable

import torch


class MicroBatchSampler:
    """Yields this rank's micro-batches (lists of sample indices), global batch after global batch.

    Only whole global batches are used: samples past the last full one are dropped.
    ``batch_size_at(consumed_samples)``, when given, is the size of the global batch that starts after
    ``consumed_samples`` samples (a multiple of ``micro_batch_size * dp_size``); else every global batch holds
    ``global_batch_size``.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int,
                 batch_size_at: Callable[[int], int] | None = None):
        for label, value in (("total_samples", total_samples), ("micro_batch_size", micro_batch_size),
                             ("global_batch_size", global_batch_size), ("dp_size", dp_size)):
            if value < 1:
                raise ValueError(f"{label} must be positive, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global batch size {global_batch_size} is not divisible by micro batch size "
                             f"{micro_batch_size} x dp size {dp_size} = {micro_batch_size * dp_size}")
        if consumed_samples < 0 or (batch_size_at is None and consumed_samples % global_batch_size):
            raise ValueError(f"consumed_samples {consumed_samples} must be a non-negative multiple of the "
                             f"global batch size {global_batch_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batch_size_at = batch_size_at or (lambda consumed: global_batch_size)
        self.ramped = batch_size_at is not None

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per ``global_batch_size`` batch on each rank (the gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _global_batches(self):
        """(first sample, size) of every whole global batch from ``consumed_samples`` on."""
        start = self.consumed_samples
        while True:
            size = self.batch_size_at(start)
            if size % (self.micro_batch_size * self.dp_size):
                raise ValueError(f"the global batch of {size} samples after {start} is not divisible by micro "
                                 f"batch size {self.micro_batch_size} x dp size {self.dp_size}")
            if start + size > self.total_samples:
                return
            yield start, size
            start += size

    def __len__(self) -> int:
        if self.ramped:
            return sum(size for _, size in self._global_batches()) // (self.micro_batch_size * self.dp_size)
        remaining = self.total_samples // self.global_batch_size - self.consumed_samples // self.global_batch_size
        return max(0, remaining) * self.num_micro_batches

    def __iter__(self):
        for start, size in self._global_batches():
            mine = start + self.dp_rank * (size // self.dp_size)
            for j in range(size // (self.micro_batch_size * self.dp_size)):
                first = mine + j * self.micro_batch_size
                yield list(range(first, first + self.micro_batch_size))


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts into one dict of batched tensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def _iterate(dataset, sampler):
    for indices in sampler:
        yield collate([dataset[i] for i in indices])


def build_data_iterator(dataset, sampler: MicroBatchSampler):
    """An iterator of collated micro-batches ``{"tokens": [micro_batch, seq_length + 1]}`` in the sampler's order.

    Checks up front that the dataset holds every sample the sampler can ask for.
    """
    if sampler.total_samples > len(dataset):
        raise ValueError(f"the sampler covers {sampler.total_samples} samples but the dataset holds "
                         f"{len(dataset)}")
    return _iterate(dataset, sampler)
