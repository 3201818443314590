"""Taking a Hugging Face checkpoint's tensors one by one, so the converter can name any it did not use."""

from __future__ import annotations

import torch

from megalite.checkpoint.hf.files import LazyTensors


def key_prefix(tensors, prefix: str) -> str:
    """``prefix`` when the checkpoint's names carry it (``model.``, ``transformer.``), else ""."""
    return prefix if any(k.startswith(prefix) for k in tensors.keys()) else ""


class Taker:
    """Takes named tensors out of a dict or :class:`LazyTensors`; :meth:`finish` reports leftovers."""

    def __init__(self, tensors, source: str):
        self.tensors = tensors if isinstance(tensors, LazyTensors) else dict(tensors)
        self.source = source

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"{self.source} has no tensor {name!r}")
        return self.tensors.pop(name)

    def finish(self) -> None:
        left = sorted(self.tensors.keys())
        if left:
            raise ValueError(f"{self.source} has tensors this converter does not know: {left[:5]}")


def output_info(take: Taker, pre: str) -> dict:
    """The conversion info of a checkpoint's names: its key prefix and whether it stores ``lm_head.weight``
    (a tied one is written back only when the original had it)."""
    return {"prefix": pre, "lm_head_stored": "lm_head.weight" in take}


def embedding_group(take: Taker, tied: bool, embedding_name: str) -> dict:
    """The megalite embedding of ``embedding_name``; a stored tied lm_head is checked against it here, while
    both are at hand (ValueError when they differ)."""
    embedding = take(embedding_name)
    if tied and "lm_head.weight" in take:
        head = take("lm_head.weight")
        if not head.is_meta and not torch.equal(head, embedding):
            raise ValueError(f"tie_word_embeddings is true but lm_head.weight differs from {embedding_name}")
    return {"embedding.word_embeddings.weight": embedding}


def output_group(take: Taker, tied: bool, out: dict) -> dict:
    """``out`` (the last tensors) plus the untied lm_head, after checking that every tensor was used."""
    if not tied:
        out["output_layer.weight"] = take("lm_head.weight")
    take.finish()
    return out
