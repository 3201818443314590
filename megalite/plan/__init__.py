"""Planning a training run: memory and step time of every parallel layout, ranked (``python -m megalite.plan``)."""

from megalite.plan.layout import Layout
from megalite.plan.memory import ParamSpec, StateBytes, rank_state_bytes

__all__ = ["Layout", "ParamSpec", "StateBytes", "rank_state_bytes"]
