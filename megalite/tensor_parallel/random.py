"""Named RNG states, so dropout can differ across TP ranks where it must.

Inside a TP region (e.g. attention dropout on split heads) each rank owns
different activations and needs its own dropout stream: the "model-parallel"
state, seeded with a tp-rank-dependent offset.  Outside, the default torch
state is the same on every TP rank, so replicated activations get identical
masks.  A state covers the CPU generator and, when CUDA is available, the
current device's generator.
"""

from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel"
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _cuda() -> bool:
    return torch.cuda.is_available()


def get_device_states() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default CPU generator state and the current CUDA device's (or None)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda() else None)


def set_device_states(states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Restore states captured by :func:`get_device_states`."""
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class RNGStatesTracker:
    """Holds named generator states and swaps them in with :meth:`fork`."""

    def __init__(self):
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every named state."""
        self.states.clear()
        self.seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed``; the current states are left unchanged."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self.seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state")
        outer = get_device_states()
        torch.default_generator.manual_seed(seed)
        if _cuda():
            torch.cuda.manual_seed(seed)
        self.states[name] = get_device_states()
        set_device_states(outer)
        self.seeds.add(seed)

    def get_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """A copy of every named state (for checkpointing and recompute)."""
        return dict(self.states)

    def set_states(self, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Replace the named states with ``states`` (from :meth:`get_states`)."""
        self.states = dict(states)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on state ``name``, then save its advance and restore the default state."""
        if name not in self.states:
            raise ValueError(f"RNG state {name!r} was never added (known: {sorted(self.states)})")
        outer = get_device_states()
        set_device_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = get_device_states()
            set_device_states(outer)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (RNG state is process-wide, as in torch)."""
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, tracker: RNGStatesTracker | None = None) -> None:
    """Seed the default generators with ``seed`` and the model-parallel state per TP rank.

    The default state (same on every TP rank) gets ``seed``; the tracker's
    "model-parallel" state gets ``seed + 2718 + tp_rank``.
    """
    tracker = get_rng_tracker() if tracker is None else tracker
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
