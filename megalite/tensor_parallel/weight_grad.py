"""Split backward: defer the weight-gradient half (W) of parallel linear layers.

A zero-bubble pipeline schedule runs a layer's backward in two parts: B, the
input gradient (on the critical path to the previous stage), and W, the weight
gradient (which nothing downstream waits for).  The schedule owns a
:class:`WeightGradStore` per backward and enters :func:`defer_weight_grads`
around the forward and the B of a micro-batch; the layers in this package (and
the MoE experts) ask :func:`current_weight_grad_store` in forward whether to
use their splittable backward, and in backward where to push the W closure.
Outside the context nothing changes.

A W closure accumulates its gradient with ``torch.autograd.backward`` on the
parameter itself, so ``.grad`` accumulation and post-accumulate-grad hooks
(DDP's ``main_grad`` and bucket readiness) behave as in a plain backward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable


class WeightGradStore:
    """The weight-gradient computations one backward deferred, run later by :meth:`run`."""

    def __init__(self):
        self._pending: list[Callable[[], None]] = []

    def push(self, compute: Callable[[], None]) -> None:
        self._pending.append(compute)

    def run(self) -> None:
        """Compute and accumulate every deferred weight gradient, in the order they were deferred."""
        pending, self._pending = self._pending, []
        for compute in pending:
            compute()

    def __len__(self) -> int:
        return len(self._pending)


_active: list[WeightGradStore] = []


@contextmanager
def defer_weight_grads(store: WeightGradStore):
    """Within this block, splittable layers defer their weight gradients to ``store``.

    Enter it around the forward of a micro-batch (so layers pick the splittable
    backward) and around its backward (so the W closures land in ``store``).
    """
    _active.append(store)
    try:
        yield store
    finally:
        _active.pop()


def current_weight_grad_store() -> WeightGradStore | None:
    """The store of the innermost :func:`defer_weight_grads` block, or None outside any."""
    return _active[-1] if _active else None
