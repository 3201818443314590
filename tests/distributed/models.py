"""Tiny models and data shared by the data-parallel and optimizer tests."""

import torch
from torch import nn


def mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    return model.to(dtype)


def batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def local_rows(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    per = x.shape[0] // size
    return x[rank * per:(rank + 1) * per]


def reference_adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW with megalite's default grouping: no decay for 1-D parameters."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, weight_decay=weight_decay)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()
