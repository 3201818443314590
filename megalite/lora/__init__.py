"""LoRA: low-rank adapters on a model's linear layers, TP-aware, with adapter-only checkpoints and PEFT I/O.

- :mod:`config`: :class:`LoRAConfig` (rank, alpha, dropout, target modules).
- :mod:`adapter`: :func:`apply_lora` freezes the model and hooks adapters onto its layers;
  :class:`LoRAModel` holds them and merges them into the base for export; :func:`adapters_disabled` runs the
  base model alone (the DPO reference of a LoRA run).
- :mod:`state`: adapters as global tensors; adapter-only checkpoints (megalite's format) that load under any layout.
- :mod:`peft`: export to and import from PEFT's adapter format for the converted Hugging Face model.
"""

from megalite.lora.adapter import LoRAAdapter, LoRAModel, adapters_disabled, apply_lora
from megalite.lora.config import TARGETS, LoRAConfig

__all__ = ["LoRAAdapter", "LoRAConfig", "LoRAModel", "TARGETS", "adapters_disabled", "apply_lora"]
