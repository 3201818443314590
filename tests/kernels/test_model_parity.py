"""A GPT with fused kernels against the same GPT on the plain-torch references: loss and every gradient."""

import pytest
import torch

import megalite.kernels as K
from megalite.kernels import fused
from megalite.models import GPTConfig, GPTModel
from megalite.moe import MoEConfig

pytestmark = pytest.mark.usefixtures("require_extension")

VOCAB = 50
# fp32 to 1e-5; bf16 to about one unit in its last place (2^-7), relative to the largest gradient entry.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _config(kind):
    """gpt2: LayerNorm, tanh-GELU, learned positions, hidden dropout.  llama: RMSNorm, SwiGLU, RoPE, MoE layer."""
    base = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                make_vocab_size_divisible_by=8)
    if kind == "gpt2":
        return GPTConfig(**base, activation="gelu_tanh", hidden_dropout=0.2)
    moe = MoEConfig(num_experts=4, ffn_hidden_size=16, topk=2, activation="swiglu", init_method_std=0.2)
    return GPTConfig(**base, normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                     num_query_groups=2, add_bias_linear=False, ffn_hidden_size=48, moe=moe, moe_layer_freq=2)


FUSED_OPS = {"gpt2": {"layer_norm", "bias_gelu", "bias_dropout_add"},
             "llama": {"rms_norm", "bias_swiglu", "apply_rotary", "bias_dropout_add", "permute", "unpermute"}}


def _loss_and_grads(kind, dtype, use_fused, calls):
    K.set_fused(use_fused)
    try:
        model = GPTModel(_config(kind)).to(dtype).train()
        tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
        torch.manual_seed(5)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        loss.backward()
    finally:
        K.set_fused(True)
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}, set(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gpt_loss_and_grads_with_fused_kernels_equal_unfused(kind, dtype, monkeypatch):
    calls = []
    for name in fused.OPS:
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    ref_loss, ref_grads, ref_calls = _loss_and_grads(kind, dtype, False, calls)
    assert ref_calls == set()
    loss, grads, used = _loss_and_grads(kind, dtype, True, calls)
    assert FUSED_OPS[kind] <= used, f"fused ops not exercised: {FUSED_OPS[kind] - used}"
    assert abs(loss - ref_loss).item() <= TOL[dtype] * max(1.0, abs(ref_loss.item()))
    for name, grad in grads.items():
        scale = max(1.0, ref_grads[name].abs().max().item())
        assert (grad - ref_grads[name]).abs().max().item() <= TOL[dtype] * scale, name
