"""megalite's MoE layer against transformers' own Mixtral / Qwen2-MoE / Qwen3-MoE sparse MoE blocks.

Tiny random blocks built with transformers' classes; their weights go through megalite.moe.hf's
mapping into an MoELayer, which must give the same output (fp32, 1e-5 relative) and route every
token to the same experts with the same weights.  The on-disk names come from transformers'
own save_pretrained.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402  (installed with transformers)
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from megalite.models import GPTConfig  # noqa: E402
from megalite.models.mlp import MLP  # noqa: E402
from megalite.moe import (MoELayer, moe_config_from_hf, moe_config_to_hf, moe_tensor_to_hf,  # noqa: E402
                          moe_tensors_from_hf)

H, LAYERS, T = 16, 4, 40
MODULES = {"mixtral": modeling_mixtral, "qwen2_moe": modeling_qwen2_moe, "qwen3_moe": modeling_qwen3_moe}
CASES = [("mixtral", {}),
         ("qwen2_moe", dict(norm_topk_prob=False, decoder_sparse_step=2)),
         ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[0, 3])),
         ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1])),
         ("qwen3_moe", dict(norm_topk_prob=False))]


def _hf_config(kind: str, **extra):
    common = dict(vocab_size=32, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=2, intermediate_size=24)
    if kind == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, **extra)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(**common, moe_intermediate_size=8, shared_expert_intermediate_size=12, num_experts=4,
                              **extra)
    return Qwen3MoeConfig(**common, moe_intermediate_size=8, num_experts=4, **extra)


def _hf_block(kind: str, hf_config):
    cls = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
           "qwen3_moe": "Qwen3MoeSparseMoeBlock"}[kind]
    torch.manual_seed(0)
    block = getattr(MODULES[kind], cls)(hf_config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block


def _megalite_layer(moe):
    shared = None
    if moe.shared_expert_intermediate_size is not None:
        dense = GPTConfig(vocab_size=32, num_layers=LAYERS, hidden_size=H, num_attention_heads=2, activation="swiglu",
                          add_bias_linear=False)
        shared = MLP(dense, ffn_hidden_size=moe.shared_expert_intermediate_size)
    return MoELayer(H, moe, shared_experts=shared).eval()


@pytest.mark.parametrize("kind, extra", CASES)
def test_moe_layer_equals_transformers_block(kind, extra):
    hf_config = _hf_config(kind, **extra)
    block = _hf_block(kind, hf_config)
    moe, freq = moe_config_from_hf(hf_config.to_dict())
    assert moe.capacity_factor is None

    # Which layers are MoE: as transformers' own decoder layers decide.
    layer_cls = {"mixtral": "MixtralDecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer",
                 "qwen3_moe": "Qwen3MoeDecoderLayer"}[kind]
    dense = GPTConfig(vocab_size=32, num_layers=LAYERS, hidden_size=H, num_attention_heads=2, moe=moe,
                      moe_layer_freq=freq)
    hf_sparse = [type(getattr(MODULES[kind], layer_cls)(hf_config, i).mlp) is type(block) for i in range(LAYERS)]
    assert [dense.is_moe_layer(i) for i in range(LAYERS)] == hf_sparse

    layer = _megalite_layer(moe)
    state = {f"model.layers.1.mlp.{k}": v for k, v in block.state_dict().items()}
    tensors = moe_tensors_from_hf(state.__getitem__, state, "model.layers.1.", kind, moe)
    layer.load_state_dict(tensors, strict=True)

    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x)
        got = layer(x.transpose(0, 1)).transpose(0, 1)
        _, hf_weights, hf_experts = block.gate(x.view(T, H))
        routing = layer.router(x.view(T, H))
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(routing.indices, hf_experts)
    assert (routing.probs - hf_weights).abs().max() <= 1e-6
    if not moe.pre_softmax:
        assert torch.allclose(routing.probs.sum(-1), torch.ones(T))


@pytest.mark.parametrize("kind, extra", CASES[:2] + CASES[3:4])
def test_on_disk_names_both_ways_and_config_round_trip(tmp_path, kind, extra):
    """The files transformers writes map to the weights it holds, and megalite writes those files' tensors."""
    hf_config = _hf_config(kind, **extra)
    model_cls = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}[kind]
    torch.manual_seed(0)
    model = getattr(MODULES[kind], model_cls)(hf_config)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        on_disk = {name: f.get_tensor(name) for name in f.keys()}
    held = dict(model.state_dict())
    moe, freq = moe_config_from_hf(hf_config.to_dict())
    dense = GPTConfig(vocab_size=32, num_layers=LAYERS, hidden_size=H, num_attention_heads=2, moe=moe,
                      moe_layer_freq=freq)
    for i in [i for i in range(LAYERS) if dense.is_moe_layer(i)]:
        prefix = f"model.layers.{i}."
        from_disk = moe_tensors_from_hf(on_disk.__getitem__, on_disk, prefix, kind, moe)
        from_memory = moe_tensors_from_hf(held.__getitem__, held, prefix, kind, moe)
        assert from_disk.keys() == from_memory.keys()
        for name, tensor in from_disk.items():
            assert torch.equal(tensor, from_memory[name]), name
        written = dict(pair for name, tensor in from_disk.items() for pair in moe_tensor_to_hf(name, tensor, prefix, kind))
        block = ("block_sparse_moe." if kind == "mixtral" else "mlp.")
        expected = {n for n in on_disk if n.startswith(prefix + block)}
        assert set(written) == expected
        for name in expected:
            assert torch.equal(written[name], on_disk[name]), name

    keys = moe_config_to_hf(moe, freq, LAYERS, kind)
    again = type(hf_config)(vocab_size=32, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=2,
                            num_key_value_heads=1, **keys)
    assert moe_config_from_hf(again.to_dict()) == moe_config_from_hf(hf_config.to_dict())


def test_what_a_family_cannot_represent_is_named():
    moe, _ = moe_config_from_hf(_hf_config("qwen3_moe", norm_topk_prob=False).to_dict())
    with pytest.raises(ValueError, match="mixtral cannot represent MoE pre_softmax=True"):
        moe_config_to_hf(moe, 1, LAYERS, "mixtral")
    with pytest.raises(ValueError, match="Qwen2-MoE has a gated shared expert"):
        moe_config_to_hf(moe, 1, LAYERS, "qwen2_moe")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        moe_config_from_hf(_hf_config("mixtral", hidden_act="gelu").to_dict())
    with pytest.raises(ValueError, match="model_type 'llama' is not a Hugging Face MoE family"):
        moe_config_from_hf({"model_type": "llama"})
