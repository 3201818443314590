"""The training step's backward allocates no zero-filled copy of the fused QKV output or the padded vocabulary.

Slicing q/k/v out of the fused QKV projection (or the real rows out of the padded output-layer table) makes
each slice's backward zero-fill a tensor of the whole input's size; on CPU those fills (and the adds that
sum them) were a visible share of a small model's step.  ``torch.split`` writes the pieces' gradients into
one tensor instead.  Values are unchanged (the model parity tests cover that); this checks the graph.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.models import GPTModel
from tests.models.common import batch, config

ZERO_FILLS = {"zeros", "new_zeros", "zeros_like", "zero_", "fill_", "slice_backward", "select_backward"}


class _ZeroFills(TorchDispatchMode):
    """Records the output shape of every op that creates or fills a tensor with a constant."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ZERO_FILLS and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_backward_zero_fills_no_qkv_or_vocab_sized_tensor(kind):
    torch.manual_seed(0)
    cfg = config(kind, untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg)
    tokens, labels = batch(b=2, s=8)
    loss = model(tokens, labels=labels).mean()
    attention = model.decoder.layers["0"].self_attention
    qkv = (8, 2, attention.num_groups_local, attention.heads_per_group + 2, attention.head_dim)
    table = tuple(model.output_layer.weight.shape)
    assert table[0] > cfg.vocab_size, "the test needs a padded vocabulary"
    with _ZeroFills() as fills:
        loss.backward()
    assert qkv not in fills.shapes
    assert table not in fills.shapes
    assert all(p.grad is not None for p in model.parameters())
