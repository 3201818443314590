"""The GPTModel inside a data-parallel (or similar ``.module``) wrapper."""

from __future__ import annotations

from megalite.models.gpt import GPTModel


def unwrap(model) -> GPTModel:
    """The GPTModel inside a DDP (or similar ``.module``) wrapper, for its config and process groups."""
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise ValueError(f"expected a GPTModel (optionally wrapped), got {type(model).__name__}")
    return model
