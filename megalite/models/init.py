"""Weight initialization for the GPT model: per-part RNG streams and init methods.

Every part of the model (the embedding, each transformer layer by its global
index, the final norm, the output layer) is built inside its own RNG stream
seeded from ``(config.seed, part)`` only.  A pipeline chunk that builds layers
4..7 therefore draws the same weights as the full model, and tensor-parallel
layers, which draw the full master weight and keep their shard, agree under
every TP size.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

EMBEDDING_STREAM = 0
FINAL_NORM_STREAM = 1
OUTPUT_LAYER_STREAM = 2
FIRST_LAYER_STREAM = 3


def stream_seed(seed: int, stream: int) -> int:
    """A seed that depends only on the model seed and the part's stream number."""
    return (seed * 1_000_003 + stream * 7_919 + 17) % (2 ** 63)


@contextmanager
def init_stream(seed: int, stream: int):
    """Seed the default generators for one model part; restore them afterwards."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(stream_seed(seed, stream))
        yield


def layer_stream(layer_number: int) -> int:
    """Stream number of the transformer layer with this global (0-based) index."""
    return FIRST_LAYER_STREAM + layer_number


def normal_init(std: float):
    """In-place N(0, std) init of a full master weight."""

    def init(weight: torch.Tensor) -> None:
        torch.nn.init.normal_(weight, mean=0.0, std=std)

    return init


def scaled_normal_init(std: float, num_layers: int):
    """N(0, std / sqrt(2 * num_layers)) for the layers that write into the residual stream (GPT-2)."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


def vocab_init(std: float, vocab_size: int):
    """N(0, std) for the real vocabulary rows and zeros for the padding rows.

    Only ``vocab_size`` rows are drawn, so the real rows do not depend on how
    much padding a TP size adds.
    """

    def init(weight: torch.Tensor) -> None:
        with torch.no_grad():
            weight.zero_()
            torch.nn.init.normal_(weight[:vocab_size], mean=0.0, std=std)

    return init
