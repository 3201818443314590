"""A tiny transformers DeepseekV3ForCausalLM read into megalite computes the same logits."""

from __future__ import annotations

import pytest
import torch

from megalite.checkpoint import load_model
from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf

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
