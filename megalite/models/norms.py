"""LayerNorm and RMSNorm over the hidden dimension, on megalite.kernels."""

from __future__ import annotations

import torch
from torch import nn

from megalite import kernels


def _mark_sequence_parallel(module: nn.Module, sequence_parallel: bool) -> None:
    # Under sequence parallelism each TP rank sees different tokens, so the
    # gradients of these replicated weights are partial and summed over TP.
    for param in module.parameters():
        param.sequence_parallel = sequence_parallel


class LayerNorm(nn.Module):
    """LayerNorm with a weight (ones) and bias (zeros)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))
        _mark_sequence_parallel(self, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a weight (ones) and no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        _mark_sequence_parallel(self, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


def build_norm(normalization: str, hidden_size: int, eps: float, **kwargs) -> nn.Module:
    """The norm named by ``normalization`` ("LayerNorm" or "RMSNorm")."""
    if normalization not in NORMS:
        raise ValueError(f"normalization must be one of {sorted(NORMS)}, got {normalization!r}")
    return NORMS[normalization](hidden_size, eps, **kwargs)
