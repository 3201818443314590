"""What a training step of the GPT should not spend: zero-filled buffers in the backward, reference kernels.

The backward allocates no zero-filled copy of the fused QKV output or the padded vocabulary: slicing q/k/v out of the fused QKV projection (or the real rows out of the padded output-layer table) makes
each slice's backward zero-fill a tensor of the whole input's size; on CPU those fills (and the adds that
sum them) were a visible share of a small model's step.  ``torch.split`` writes the pieces' gradients into
one tensor instead.  The per-head q/k norms both run on the fused kernel (the key, a strided view of the
QKV output, took the reference's several passes).  Values are unchanged (the model parity tests cover that);
these check the graph and the kernels called.
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


class _Calls(TorchDispatchMode):
    """Counts the calls of each op."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_qk_norms_run_on_the_fused_kernel():
    cfg = config("qwen")
    model = GPTModel(cfg)
    tokens, _ = batch(b=2, s=8)
    with _Calls() as calls:
        model(tokens)
    # per layer: input, pre-MLP, query and key norms; then the final norm
    assert calls.counts.get("rms_norm_fwd") == 4 * cfg.num_layers + 1
