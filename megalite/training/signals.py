"""SIGTERM handling: note the signal, and let the loop save and stop at an iteration boundary."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class SigtermFlag:
    """Records a SIGTERM instead of dying; ``agreed()`` tells every rank whether any rank got one.

    The handler only sets a flag, so no work happens inside signal context.
    Ranks may receive the signal at different iterations; ``agreed`` takes the
    maximum over ``group`` so all ranks stop, and save, at the same iteration.
    """

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._previous = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def agreed(self, group=None) -> bool:
        if not (dist.is_available() and dist.is_initialized()):
            return self.received
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def restore(self) -> None:
        """Reinstall the handler that was active before."""
        signal.signal(self.sig, self._previous)


def _device():
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
