"""The LoRA settings: rank, alpha, dropout and the layers adapters attach to.

The dataclass is the source of every default (``--lora-*`` flags read them).
"""

from __future__ import annotations

from dataclasses import dataclass

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The transformer-layer linear layers an adapter can attach to (megalite's module names)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters ``W + (alpha / rank) * B @ A`` on the layers named in ``target_modules``."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = TARGETS
    seed: int = 1234
    """Seeds each adapter's A from its module name, so one seed gives one adapter set under any layout."""

    def __post_init__(self):
        if isinstance(self.target_modules, str):
            self.target_modules = tuple(t.strip() for t in self.target_modules.split(",") if t.strip())
        self.target_modules = tuple(self.target_modules)
        unknown = [t for t in self.target_modules if t not in TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(f"LoRA target module(s) {unknown or '(none)'} match no layer; the available ones are "
                             f"{', '.join(TARGETS)}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    def targets(self, module_name: str) -> bool:
        """Whether an adapter attaches to the model's module ``module_name``: a target layer of a transformer layer."""
        return module_name.rsplit(".", 1)[-1] in self.target_modules and ".layers." in f".{module_name}"

    def check_rank(self, module_name: str, out_features: int, in_features: int) -> None:
        """ValueError when the rank is larger than target layer ``module_name`` (weight ``[out, in]``) allows."""
        if self.rank > min(in_features, out_features):
            raise ValueError(f"LoRA rank {self.rank} is larger than layer {module_name} ([{out_features}, "
                             f"{in_features}]) allows: at most {min(in_features, out_features)}")

    @property
    def scaling(self) -> float:
        """``alpha / rank``, PEFT's scaling of the adapter output."""
        return self.alpha / self.rank
