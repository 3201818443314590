"""Loss scalers for fp16 training."""

from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """A loss scale that backs off on overflow and grows after a window of clean steps.

    An overflow only lowers the scale (by ``backoff_factor``, never below ``min_scale``) once
    ``hysteresis`` overflows have occurred since the last growth; ``growth_interval`` clean steps
    in a row multiply it by ``growth_factor`` and restore the hysteresis budget.
    """

    def __init__(self, initial_scale: float, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale <= initial_scale, got min_scale={min_scale}, "
                             f"initial_scale={initial_scale}")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor} and "
                             f"{backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval and hysteresis must be >= 1, got {growth_interval} and {hysteresis}")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = state["growth_tracker"]
        self._hysteresis_tracker = state["hysteresis_tracker"]
