"""A tiny transformers DeepseekV3ForCausalLM read into megalite computes the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from megalite.checkpoint import load_model
from megalite.checkpoint.hf import (convert_hf_to_megalite, convert_megalite_to_hf, hf_to_megalite, megalite_to_hf,
                                    read_hf_checkpoint, write_hf_tensors)
from megalite.checkpoint.sharding import VOCAB_PARAMS
from megalite.models import GPTModel

transformers = pytest.importorskip("transformers")


def _tiny(q_lora_rank=16, interleave=True):
    """Random DeepSeek-V3: 3 layers (the first dense), 8 experts in 4 groups (2 chosen), top-4, one shared
    expert, YaRN 4x past 16 positions; router weights and biases drawn so routing is not degenerate."""
    config = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=12, q_lora_rank=q_lora_rank, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=64,
        rope_interleave=interleave, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 16, "mscale": 1.0,
                                                     "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.rand(8))
    return model


@pytest.mark.parametrize("q_lora_rank, interleave", [(16, True), (None, False)])
def test_converted_deepseek_v3_matches_transformers_logits_both_ways(q_lora_rank, interleave, tmp_path):
    model = _tiny(q_lora_rank, interleave)
    model.save_pretrained(tmp_path / "hf")
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "megalite"))
    ours = load_model(str(tmp_path / "megalite")).eval()
    config = ours.config
    assert config.multi_latent_attention and config.moe_layer_freq == [0, 1, 1] and config.rope_scaling == "yarn"
    assert (config.yarn_mscale, config.yarn_mscale_all_dim) == (1.0, 0.8)
    assert (config.moe.num_groups, config.moe.group_topk, config.moe.shared_expert_intermediate_size) == (4, 2, 16)
    router = ours.decoder.layers["1"].mlp.router
    torch.testing.assert_close(router.expert_bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        logits = ours(ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    convert_megalite_to_hf(str(tmp_path / "megalite"), str(tmp_path / "back"))
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert back.config.rope_interleave is False
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_deepseek_v3_settings_megalite_cannot_compute_are_one_error(tmp_path):
    model = _tiny()
    model.config.norm_topk_prob = False
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="norm_topk_prob=false is not supported"):
        convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "megalite"))


def test_mtp_layer_converts_both_ways_in_the_published_layout_and_matches_transformers_mtp_model(tmp_path):
    """A prediction depth is written as layer ``num_hidden_layers`` with DeepSeek-V3's names (transformers'
    DeepseekV3ForCausalLM skips it, its MtpModel loads it and computes the same logits) and read back exactly."""
    from transformers.modeling_layers import MtpModel

    model = _tiny()
    config, tensors, info = hf_to_megalite(*_saved(model, tmp_path))
    assert config.mtp_num_layers is None  # transformers saves no MTP layer
    config.mtp_num_layers = 1
    ours = GPTModel(config).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, value in ours.state_dict().items():
            if name in tensors:
                value[:tensors[name].shape[0]].copy_(tensors[name])
            elif name.endswith("norm.weight"):
                value.copy_(1.0 + 0.2 * torch.randn_like(value))
            elif name.endswith("expert_bias"):
                value.copy_(0.1 * torch.rand_like(value))
            else:
                value.copy_(0.2 * torch.randn_like(value))
    ours_tensors = {name: value[:config.vocab_size] if name in VOCAB_PARAMS else value
                    for name, value in ours.state_dict().items()}
    hf_config, hf_tensors = megalite_to_hf(config, ours_tensors, info)
    assert hf_config["num_nextn_predict_layers"] == 1
    depth = {k[len("model.layers.3."):] for k in hf_tensors if k.startswith("model.layers.3.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias", "input_layernorm.weight"} <= depth
    (tmp_path / "back").mkdir()
    write_hf_tensors(str(tmp_path / "back"), hf_tensors, 1 << 30)
    (tmp_path / "back" / "config.json").write_text(json.dumps(hf_config))

    main = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3.*"]  # transformers names DeepSeek-V3's layer 61
    mtp = MtpModel.from_pretrained(main).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    s = ids.shape[1]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), main(ids).logits, rtol=1e-5, atol=1e-5)
        last = main.model(ids).last_hidden_state
        expected = mtp._project_to_logits(mtp.forward_layer(0, last[:, :-1], torch.arange(1, s).expand(2, s - 1), None,
                                                            input_ids=ids[:, 1:]))
        hidden = ours(ids, return_hidden=True).transpose(0, 1)[:-1]
        states = ours.mtp.layers[0](hidden, ours.embedding(ids[:, 1:], None), ours.rotary(torch.arange(s - 1)))
        torch.testing.assert_close(ours.output_logits(states).transpose(0, 1), expected, rtol=1e-5, atol=1e-5)

    back_config, back_tensors, _ = hf_to_megalite(*read_hf_checkpoint(str(tmp_path / "back")))
    assert back_config == config
    assert sorted(back_tensors) == sorted(ours_tensors)
    for name, value in ours_tensors.items():
        assert torch.equal(back_tensors[name], value), name


def test_mtp_copies_of_the_shared_weights_must_be_copies(tmp_path):
    model = _tiny()
    config, tensors, info = hf_to_megalite(*_saved(model, tmp_path))
    config.mtp_num_layers = 1
    ours = GPTModel(config)
    ours_tensors = {name: value[:config.vocab_size] if name in VOCAB_PARAMS else value
                    for name, value in ours.state_dict().items()}
    hf_config, hf_tensors = megalite_to_hf(config, ours_tensors, info)
    hf_tensors["model.layers.3.shared_head.head.weight"] = hf_tensors["model.layers.3.shared_head.head.weight"] + 1
    with pytest.raises(ValueError, match="model.layers.3.shared_head.head.weight differs from the model's output"):
        hf_to_megalite(hf_config, hf_tensors)


def _saved(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    return read_hf_checkpoint(str(tmp_path / "hf"))


@pytest.mark.parametrize("kind, message", [
    ("mla", "deepseek_v3 cannot represent this model: its multi-token prediction layers would be dense"),
    ("llama", "llama cannot store multi-token prediction layers"),
])
def test_mtp_layers_hugging_face_cannot_store_are_one_error(kind, message):
    from tests.models.common import config

    with pytest.raises(ValueError, match=message):
        megalite_to_hf(config(kind, mtp_num_layers=1), {})
