"""A target network kept on CPU and updated by chunked Polyak averaging: ``target <- (1 - tau) target + tau source``.

The target (e.g. a target critic) never occupies accelerator memory between its uses: its fp32 copy of
this rank's parameter shards lives in CPU memory (pinned when CUDA is present).  An update streams the
source parameters through one reusable staging buffer of ``chunk_numel`` elements, so the extra memory is
one chunk, whatever the model size.  ``load_into(module)`` copies the target into a module for scoring.
"""

from __future__ import annotations

import torch


class PolyakTarget:
    """CPU fp32 copy of ``source``'s parameters, moved towards them by ``update()`` with rate ``tau``."""

    def __init__(self, source: torch.nn.Module, tau: float, chunk_numel: int = 1 << 20):
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"Polyak rate tau must be in (0, 1], got {tau}")
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
        self.tau, self.chunk_numel = tau, chunk_numel
        pin = torch.cuda.is_available()
        self.params = {name: torch.empty(p.shape, dtype=torch.float32, pin_memory=pin).copy_(p.detach())
                       for name, p in source.named_parameters()}
        self._staging = torch.empty(chunk_numel, dtype=torch.float32, pin_memory=pin)

    def update(self, source: torch.nn.Module) -> None:
        """One Polyak step towards ``source`` (same parameter names and shapes), chunk by chunk."""
        params = dict(source.named_parameters())
        if params.keys() != self.params.keys():
            raise ValueError(f"source parameters {sorted(set(params) ^ set(self.params))[:5]} do not match the target")
        with torch.no_grad():
            for name, target in self.params.items():
                flat_source, flat_target = params[name].detach().reshape(-1), target.view(-1)
                for start in range(0, flat_target.numel(), self.chunk_numel):
                    stop = min(start + self.chunk_numel, flat_target.numel())
                    staging = self._staging[:stop - start]
                    staging.copy_(flat_source[start:stop], non_blocking=True)
                    if flat_source.is_cuda:
                        torch.cuda.current_stream(flat_source.device).synchronize()
                    flat_target[start:stop].lerp_(staging, self.tau)

    def load_into(self, module: torch.nn.Module) -> None:
        """Copy the target's values into ``module``'s parameters (e.g. a scoring copy on the device)."""
        with torch.no_grad():
            for name, param in module.named_parameters():
                param.copy_(self.params[name], non_blocking=True)

    def host_tensors(self) -> list[torch.Tensor]:
        """The host tensors held: the target's and the staging chunk (for memory accounting)."""
        return [*self.params.values(), self._staging]

    def resident_bytes(self) -> int:
        """CPU bytes held: the target tensors and the staging chunk."""
        return sum(t.numel() * t.element_size() for t in self.host_tensors())
