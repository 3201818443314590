"""Exported weights load into Hugging Face models that reproduce megalite's logits; tp=2 x pp=2 equals tp=1, and an
MoE model at tp=2 x ep=2 exports the single-rank model's global tensors (experts included), and as Mixtral."""

import json

import pytest
import torch

from megalite import topology
from megalite.models import GPTModel
from megalite.checkpoint.sharding import VOCAB_PARAMS
from megalite.rlhf.export import export_global_weights, export_hf_weights
from megalite.testing import run_distributed
from megalite.topology import device
from tests.moe.test_gpt_moe import _config as moe_config
from tests.rlhf.common import config, padded_prompts

transformers = pytest.importorskip("transformers")


def _hf_model(kind, cfg):
    if kind == "gpt2":
        hf_config = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings,
                                            n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                                            n_head=cfg.num_attention_heads, activation_function="gelu_new",
                                            layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=True)
        return transformers.GPT2LMHeadModel(hf_config)
    hf_config = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                         intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                                         num_attention_heads=cfg.num_attention_heads,
                                         num_key_value_heads=cfg.num_query_groups, rms_norm_eps=cfg.norm_eps,
                                         max_position_embeddings=cfg.max_position_embeddings,
                                         rope_theta=cfg.rotary_base, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(hf_config)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_exported_weights_reproduce_logits_in_hugging_face(kind):
    cfg = config(kind, activation="gelu_tanh") if kind == "gpt2" else config(kind)
    model = GPTModel(cfg).eval()
    exported = dict(export_hf_weights(model))
    hf = _hf_model(kind, cfg).eval()
    expected = {k for k in hf.state_dict() if k != "lm_head.weight" and not k.endswith(".attn.bias")
                and not k.endswith("masked_bias")}
    assert set(exported) == expected
    hf.load_state_dict(exported, strict=False)
    ids, _ = padded_prompts()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)


def _parallel_rank():
    kinds = ("gpt2", "llama")
    expected = {kind: {k: v.clone() for k, v in export_hf_weights(GPTModel(config(kind)).to(device()))}
                for kind in kinds}
    topo = topology.initialize(tp=2, pp=2)
    first, last = topo.is_first_stage(), topo.is_last_stage()
    for kind in kinds:
        chunk = GPTModel(config(kind), pre_process=first, post_process=last,
                         layer_range=(0, 1) if first else (1, 2)).to(device())
        got = dict(export_hf_weights(chunk))
        assert sorted(got) == sorted(expected[kind])
        for name, tensor in got.items():
            assert torch.equal(tensor, expected[kind][name]), (kind, name)


def test_export_tp2_pp2_equals_single_rank():
    run_distributed(_parallel_rank, 4, timeout=180)


def _single_rank_tensors(cfg) -> dict[str, torch.Tensor]:
    """The one-rank model's parameters without vocabulary padding (the tied output layer is the embedding)."""
    model = GPTModel(cfg)
    tied = not cfg.untie_embeddings_and_output_weights
    return {name: (param[:cfg.vocab_size] if name in VOCAB_PARAMS else param).detach().clone()
            for name, param in model.named_parameters() if not (tied and name == "output_layer.weight")}


def _moe_rank(kinds):
    expected = {kind: _single_rank_tensors(moe_config(kind)) for kind in kinds}
    topology.initialize(tp=2, ep=2)
    for kind in kinds:
        got = dict(export_global_weights(GPTModel(moe_config(kind)).to(device())))
        assert sorted(got) == sorted(expected[kind])
        assert any(".experts." in name for name in got)
        for name, tensor in got.items():
            assert torch.equal(tensor.cpu(), expected[kind][name]), (kind, name)


def test_moe_export_at_tp2_ep2_equals_single_rank():
    """Expert tensors are gathered over EP and expert-TP (SwiGLU and GELU experts), dense ones over TP."""
    run_distributed(_moe_rank, 4, ("gpt2", "llama"), timeout=180)


def test_moe_exports_as_mixtral_and_an_unexportable_moe_is_refused_before_any_collective(tmp_path):
    """An MoE model with Mixtral's architecture exports the converter's Mixtral tensors, which transformers loads to
    megalite's logits; GELU experts with biases (no Hugging Face family) are one error before any collective."""
    from megalite.checkpoint.hf import megalite_to_hf, write_hf_tensors

    cfg = moe_config("llama")
    model = GPTModel(cfg).eval()
    exported = dict(export_hf_weights(model))
    hf_config, expected = megalite_to_hf(cfg, dict(export_global_weights(model)))
    assert hf_config["model_type"] == "mixtral" and sorted(exported) == sorted(expected)
    assert any(".block_sparse_moe.experts." in name for name in exported)
    write_hf_tensors(str(tmp_path), exported.items(), 1 << 30)
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path)).eval()(ids).logits
        torch.testing.assert_close(logits, model(ids)[..., :cfg.vocab_size], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="no Hugging Face family fits"):
        next(export_hf_weights(GPTModel(moe_config("gpt2"))))
