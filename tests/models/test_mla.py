"""Multi-latent attention: equal to transformers' DeepseekV3Attention, and TP/SP/recompute parity with one rank."""

from __future__ import annotations

import pytest
import torch

from megalite.models import GPTConfig, GPTModel
from megalite.models.mla import MultiLatentAttention
from megalite.models.rotary import RotaryEmbedding
from megalite.testing import run_distributed
from tests.models.common import batch, config
from tests.models.test_gpt_parallel import _check_tp_parity


def _hf_attention(cfg: GPTConfig):
    """transformers' DeepseekV3Attention and rotary embedding for ``cfg``'s sizes (SDPA, causal)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope = {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position_embeddings,
            "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow, "mscale": cfg.yarn_mscale,
            "mscale_all_dim": cfg.yarn_mscale_all_dim}
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps, rope_interleave=False,
        rope_parameters=rope, attention_bias=False)
    hf_cfg._attn_implementation = "sdpa"
    return hf.DeepseekV3Attention(hf_cfg, layer_idx=0).eval(), hf.DeepseekV3RotaryEmbedding(hf_cfg)


def _copy_weights(ours: MultiLatentAttention, theirs) -> None:
    names = {"linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
             "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj", "linear_q_proj": "q_proj",
             "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj"}
    with torch.no_grad():
        for name, param in ours.named_parameters():
            module, leaf = name.split(".")
            source = getattr(getattr(theirs, names[module]), leaf)
            source.copy_(torch.randn_like(source) * 0.3 + (1.0 if "layernorm" in module else 0.0))
            param.copy_(source)


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_mla_equals_transformers_deepseek_v3_attention(q_lora_rank):
    cfg = config("mla", q_lora_rank=q_lora_rank)
    theirs, hf_rotary = _hf_attention(cfg)
    ours = MultiLatentAttention(cfg, 0).eval()
    _copy_weights(ours, theirs)
    rotary = RotaryEmbedding(cfg)
    b, s = 2, 12
    x = torch.randn(b, s, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(s)
    cos, sin = hf_rotary(x, positions[None].expand(b, s))
    ours_cos, ours_sin = rotary(positions)
    torch.testing.assert_close(ours_cos, cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_sin, sin[0], rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        expected, _ = theirs(x, (cos, sin), None)
        out, bias = ours(x.transpose(0, 1).contiguous(), (ours_cos, ours_sin))
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=1e-5, atol=1e-6)


def test_mla_tensor_and_sequence_parallel_match_single_rank():
    run_distributed(_check_tp_parity, 2, ("mla",), timeout=240)


def test_mla_recompute_and_kv_cache_match_plain_forward():
    ids, labels = batch()
    results = {}
    for granularity in (None, "selective", "full"):
        model = GPTModel(config("mla", recompute_granularity=granularity))
        loss = model(ids, labels=labels)
        loss.sum().backward()
        results[granularity] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    for granularity in ("selective", "full"):
        torch.testing.assert_close(results[granularity][0], results[None][0], rtol=0, atol=1e-6)
        for name, grad in results[None][1].items():
            torch.testing.assert_close(results[granularity][1][name], grad, rtol=0, atol=1e-6, msg=name)
    from megalite.models.kv_cache import KVCache

    model.eval()
    cache = KVCache()
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :5], kv_cache=cache)] + [model(ids[:, i:i + 1], kv_cache=cache) for i in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    ({"num_query_groups": 2}, "no query groups"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
    ({"position_embedding_type": "learned_absolute", "rope_scaling": None},
     "multi-latent attention needs position_embedding_type 'rope'"),
    ({"rope_scaling_factor": 0.5}, "rope_scaling_factor must be >= 1"),
])
def test_mla_bad_config_is_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        config("mla", **overrides).validate()


def _mla_context_parallel():
    from megalite import topology
    from megalite.context_parallel import document_ids
    from tests.context_parallel.test_model import EOD, SEQ, _compare, _packed_batch, _references

    ids, labels = _packed_batch()
    docs = document_ids(ids, EOD)
    cfg = config("mla", max_position_embeddings=SEQ)
    references = _references(cfg, ids, labels, docs)
    topo = topology.initialize(cp=2)
    errors = {}
    for comm in ("p2p", "all_gather", "a2a"):
        errors.update(_compare(cfg, ids, labels, docs, references, topo, comm))
    return errors


def test_mla_context_parallel_matches_single_rank():
    """Values with their own head dim (v_head_dim != qk dims) through every CP comm type, plain and packed."""
    for errors in run_distributed(_mla_context_parallel, 2, timeout=240):
        assert len(errors) == 3 * 4
        for key, error in errors.items():
            assert error < 1e-5, (key, error)
