"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor."""

from __future__ import annotations

import math

DECAY_STYLES = ("constant", "linear", "cosine")


class LRScheduler:
    """Sets each optimizer param group's ``lr`` for the iteration about to run.

    Iteration ``i`` (1-based) warms up linearly to ``max_lr`` over the first
    ``warmup_iters`` iterations, then decays from ``max_lr`` to ``min_lr`` over
    iterations ``warmup_iters+1 .. decay_iters`` and stays at ``min_lr``.
    ``step()`` advances by one iteration; ``state_dict`` holds only the count,
    so a resumed run picks up the same schedule.
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 decay_style: str):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if not 0 <= warmup_iters <= decay_iters:
            raise ValueError(f"warmup iterations {warmup_iters} must be between 0 and decay iterations "
                             f"{decay_iters}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"min lr {min_lr} must be between 0 and max lr {max_lr}")
        self.optimizer = optimizer
        self.max_lr = max_lr
        self.min_lr = min_lr
        self.warmup_iters = warmup_iters
        self.decay_iters = decay_iters
        self.decay_style = decay_style
        self.num_steps = 0
        self._apply()

    def lr_at(self, iteration: int) -> float:
        """Learning rate of 1-based ``iteration``."""
        if self.warmup_iters and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        span = self.decay_iters - self.warmup_iters
        ratio = 1.0 if span <= 0 else min(1.0, (iteration - self.warmup_iters) / span)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_lr(self) -> float:
        """Learning rate of the next iteration to run."""
        return self.lr_at(self.num_steps + 1)

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
