"""RoPE variants against their peers: scaled frequencies equal transformers' (llama3, linear, yarn) and
interleaved-pair rotation equals Megatron-Core's ``--rotary-interleaved``."""

import pytest
import torch

from megalite.models import GPTConfig
from megalite.models.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies


def _config(**kwargs):
    return GPTConfig(vocab_size=64, num_layers=1, hidden_size=64, num_attention_heads=2, kv_channels=64,
                     position_embedding_type="rope", rotary_base=500000.0, max_position_embeddings=256, **kwargs)


ROPE_CASES = {
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64},
               {"rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rope_original_max_position_embeddings": 64}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"rope_scaling": "linear", "rope_scaling_factor": 4.0}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
             {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_position_embeddings": 64}),
    "yarn_untruncated": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                          "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "attention_factor": 1.3},
                         {"rope_scaling": "yarn", "rope_scaling_factor": 2.0,
                          "rope_original_max_position_embeddings": 32, "yarn_beta_fast": 16.0,
                          "yarn_beta_slow": 2.0, "yarn_truncate": False, "yarn_attention_factor": 1.3}),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.9,
                     "mscale_all_dim": 0.7},
                    {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_position_embeddings": 64,
                     "yarn_mscale": 0.9, "yarn_mscale_all_dim": 0.7}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_scaled_frequencies_equal_transformers(case):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_rope, ours = ROPE_CASES[case]
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=64, max_position_embeddings=256,
                                  rope_parameters={**hf_rope, "rope_theta": 500000.0})
    expected, expected_scale = ROPE_INIT_FUNCTIONS[hf_rope["rope_type"]](hf)
    inv_freq, scale = inverse_frequencies(_config(**ours))
    assert torch.equal(inv_freq, expected.float())
    assert scale == pytest.approx(expected_scale, rel=1e-12)
    assert not torch.equal(inv_freq, inverse_frequencies(_config())[0])  # the scaling changed something
    positions = torch.arange(200)
    cos, sin = RotaryEmbedding(_config(**ours))(positions)
    angles = positions[:, None].float() * expected.float()
    angles = torch.cat([angles, angles], -1)
    torch.testing.assert_close(cos, angles.cos() * expected_scale, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, angles.sin() * expected_scale, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mscales", [{"mscale": 0.9, "mscale_all_dim": 0.7}, {"mscale": 0.7}, {"mscale_all_dim": 0.7},
                                     {"mscale": 1.0, "mscale_all_dim": 1.0}])
def test_yarn_mscale_keys_read_as_transformers_computes_them(mscales):
    """DeepSeek's mscale/mscale_all_dim (transformers takes their ratio only when both are non-zero) read
    through the one HF RoPE reader give transformers' tables, and write back to the same keys."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megalite.checkpoint.hf.rope import rope_config, rope_fields

    rope = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            **mscales}
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=64, max_position_embeddings=256,
                                  rope_parameters=dict(rope))
    expected, expected_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    config = _config(**{k: v for k, v in rope_fields({"rope_parameters": rope}).items() if k != "rotary_base"})
    inv_freq, scale = inverse_frequencies(config)
    assert torch.equal(inv_freq, expected.float())
    assert scale == pytest.approx(expected_scale, rel=1e-12)
    written = rope_config(config, {"rope_parameters": rope})["rope_parameters"]
    assert {k: written[k] for k in mscales} == mscales


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_interleaved_rotation_equals_megatron_core(rotary_percent):
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding as McoreRotary

    d, s = 16, 7
    config = GPTConfig(vocab_size=64, num_layers=1, hidden_size=32, num_attention_heads=2, kv_channels=d,
                       position_embedding_type="rope", rotary_percent=rotary_percent, rotary_interleaved=True)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(s, 2, 4, d, generator=g), torch.randn(s, 2, 2, d, generator=g)
    cos, sin = RotaryEmbedding(config)(torch.arange(s))
    q_out, k_out = apply_rotary(q, k, cos, sin, interleaved=True)
    mcore = McoreRotary(d, rotary_percent, rotary_interleaved=True, rotary_base=10000, use_cpu_initialization=True)
    # Megatron's interleaved table (get_emb without its move to the GPU): each angle twice, side by side.
    freqs = mcore.get_freqs_non_repeated(s).repeat_interleave(2, dim=-1)[:, None, None, :]
    torch.testing.assert_close(q_out, _apply_rotary_pos_emb_bshd(q, freqs, rotary_interleaved=True),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, _apply_rotary_pos_emb_bshd(k, freqs, rotary_interleaved=True),
                               rtol=1e-6, atol=1e-6)
    plain_q, _ = apply_rotary(q, k, cos, sin)
    assert not torch.allclose(plain_q, q_out)


def test_bad_scaling_is_one_clear_error():
    with pytest.raises(ValueError, match="rope_scaling='linear' needs position_embedding_type 'rope'"):
        GPTConfig(vocab_size=8, num_layers=1, hidden_size=8, num_attention_heads=2, rope_scaling="linear").validate()
    with pytest.raises(ValueError, match="rope_low_freq_factor=4.0 and rope_high_freq_factor=1.0"):
        _config(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0).validate()
    with pytest.raises(ValueError, match="GPTConfig.rope_scaling must be one of"):
        _config(rope_scaling="dynamic").validate()
