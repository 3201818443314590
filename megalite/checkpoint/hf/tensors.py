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


def finish_output_layer(take: Taker, out: dict, tied: bool, pre: str, embedding_name: str) -> dict:
    """Read the untied lm_head (a tied one must equal the embedding) and check every tensor was used."""
    lm_head_stored = "lm_head.weight" in take
    if tied:
        if lm_head_stored and not torch.equal(take("lm_head.weight"), out["embedding.word_embeddings.weight"]):
            raise ValueError(f"tie_word_embeddings is true but lm_head.weight differs from {embedding_name}")
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    take.finish()
    return {"prefix": pre, "lm_head_stored": lm_head_stored}
