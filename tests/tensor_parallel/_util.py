"""Helpers shared by the tensor-parallel tests."""

import torch


def block(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Contiguous block ``rank`` of ``parts`` along ``dim``."""
    return t.chunk(parts, dim)[rank]


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference (CPU), infinite on a shape mismatch so it can never pass."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        return float("inf")
    return (got - want).abs().max().item()


def master(shape, seed: int) -> torch.Tensor:
    """The full weight the layers' default init draws right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return torch.nn.init.normal_(torch.empty(shape), 0.0, 0.02)


def assert_all_small(results, count: int, tol: float = 1e-5) -> None:
    """``results`` is a list (per rank) of {check name: error}; every rank ran ``count`` checks."""
    for rank, errors in enumerate(results):
        assert len(errors) == count, (rank, len(errors), count)
        bad = {k: v for k, v in errors.items() if not v <= tol}
        assert not bad, f"rank {rank}: {bad}"
