"""The Llama-style families both ways with Hugging Face: Llama 3.1 (llama3 RoPE scaling, GQA, head dim
other than hidden/heads), Qwen2 (Q/K/V bias only, tied), Qwen3 (per-head Q/K RMSNorm, YaRN, head dim 16 at
hidden 32; and with a sliding window on every layer), Mistral (linear RoPE scaling, a sliding window shorter
than the sequences), and the MoE families
Mixtral (a window too), Qwen2-MoE (gated shared expert, top-k of the full softmax, a dense first layer) and
Qwen3-MoE (renormalised top-k, tied).

Tiny random models are built with transformers' own classes and saved sharded.  Converted, their logits
equal transformers' (fp32, 1e-5 relative) at tp=1, tp=2, (Llama) pp=2 and (MoE) ep=2; converted back, config.json,
generation_config.json, tokenizer files and tensors are the originals; greedy generation through
megalite's engine equals ``transformers.generate``.  A config the converter cannot represent is one
error naming the field.
"""

import json
import os

import pytest
import torch

from megalite.checkpoint import load_model
from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf
from megalite.testing import run_distributed
from tests.checkpoint.test_hf import assert_same_hf_model

transformers = pytest.importorskip("transformers")
VOCAB = 70
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, head_dim=16, tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 3],
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # a window on every layer, shorter than the sequences
    "qwen3_window": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, head_dim=16, use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SMALL, sliding_window=8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16,
        norm_topk_prob=False, mlp_only_layers=[0])),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True,
        tie_word_embeddings=True)),
}
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"model_max_length": 256}'}


def _hf_model(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model.eval()


def _ids(seed=1):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _close(logits, expected):
    return (logits - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def _saved(family, tmp_path):
    """The HF model, saved sharded with an instruct-style generation config and two tokenizer files."""
    model = _hf_model(family)
    model.generation_config.eos_token_id = [2, 3, 5]
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    for name, text in TOKENIZER_FILES.items():
        (tmp_path / "hf" / name).write_text(text)
    return model


def _files(directory, family):
    """The files of a model directory.  An MoE model's shard file names are left out: transformers sizes its
    shards by the experts it holds fused (one [E, 2f, h] tensor), so the same tensors fill another number of
    shards; the index's tensor names are compared instead."""
    names = sorted(os.listdir(directory))
    return [n for n in names if not n.startswith("model-")] if family in MOE_FAMILIES else names


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_converts_both_ways_exactly(family, tmp_path):
    model = _saved(family, tmp_path)
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")  # the input is sharded
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "megalite"))
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
        assert _close(load_model(str(tmp_path / "megalite"))(ids), expected)

    convert_megalite_to_hf(str(tmp_path / "megalite"), str(tmp_path / "back"), max_shard_size="40KB")
    assert _files(tmp_path / "back", family) == _files(tmp_path / "hf", family)
    for name in ["config.json", "generation_config.json", "model.safetensors.index.json"]:
        back, original = (json.loads((tmp_path / d / name).read_text()) for d in ("back", "hf"))
        if name == "model.safetensors.index.json":
            back, original = back["weight_map"].keys(), original["weight_map"].keys()
        assert back == original, name
    for name, text in TOKENIZER_FILES.items():
        assert (tmp_path / "back" / name).read_text() == text
    assert_same_hf_model(tmp_path / "hf", tmp_path / "back", type(model), ids, expected)


@pytest.mark.parametrize("family", ["mistral", "qwen3_window", *MOE_FAMILIES])
def test_a_model_without_its_original_config_exports_as_its_family(family, tmp_path):
    """With no Hugging Face config kept (a model megalite trained), the architecture picks the family (a window:
    Mistral, with Q/K norm Qwen3 windowed on every layer; MoE with a shared expert: Qwen2-MoE, with Q/K norm: Qwen3-MoE, else Mixtral) and the config.json
    written from scratch makes transformers compute the same logits."""
    from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf, write_hf_tensors

    model = _hf_model(family)
    config, tensors, _ = hf_to_megalite(model.config.to_dict(), dict(model.state_dict()))
    hf, out = megalite_to_hf(config, tensors)
    assert hf["model_type"] == model.config.model_type
    write_hf_tensors(str(tmp_path), out.items(), 1 << 30)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    ids = _ids(5)
    with torch.no_grad():
        assert _close(type(model).from_pretrained(str(tmp_path)).eval()(ids).logits, model(ids).logits)


def _parallel_logits(paths, ids, sizes):
    from megalite import checkpoint, topology
    from megalite.models import GPTModel
    from megalite.tensor_parallel import gather_from_tensor_parallel_region

    topo = topology.initialize(**sizes)
    out = []
    for path in paths:
        config = checkpoint.CheckpointReader(path).config
        model = GPTModel(config).eval()
        checkpoint.load_sharded(path, [model])
        with torch.no_grad():
            out.append(gather_from_tensor_parallel_region(model(ids), topo.tp.group)[..., :config.vocab_size])
    return out


def _pp2_logits(path, ids):
    import torch.distributed as dist

    from megalite import checkpoint, topology
    from megalite.models import GPTModel

    topo = topology.initialize(pp=2)
    config = checkpoint.CheckpointReader(path).config
    first = topo.pp.rank == 0
    model = GPTModel(config, pre_process=first, post_process=not first,
                     layer_range=(0, 1) if first else (1, config.num_layers)).eval()
    checkpoint.load_sharded(path, [model])
    with torch.no_grad():
        if first:
            dist.send(model(ids).contiguous(), topo.pp.ranks[1])
            return None
        hidden = torch.empty(ids.shape[1], ids.shape[0], config.hidden_size)
        dist.recv(hidden, topo.pp.ranks[0])
        model.set_input_tensor(hidden)
        return model(ids)


def _converted(families, ids, tmp_path):
    """``(megalite checkpoint paths, transformers' logits of ids)`` of the families' tiny models."""
    paths, expected = [], []
    for family in families:
        model = _hf_model(family)
        model.save_pretrained(tmp_path / family)
        convert_hf_to_megalite(str(tmp_path / family), str(tmp_path / f"{family}.megalite"))
        paths.append(str(tmp_path / f"{family}.megalite"))
        with torch.no_grad():
            expected.append(model(ids).logits)
    return paths, expected


@pytest.mark.slow
def test_every_family_at_tp2_and_llama_at_pp2(tmp_path):
    ids = _ids(2)
    paths, expected = _converted(sorted(FAMILIES), ids, tmp_path)
    for per_rank in run_distributed(_parallel_logits, 2, paths, ids, {"tp": 2}, timeout=240):
        for family, logits, want in zip(sorted(FAMILIES), per_rank, expected):
            assert _close(logits, want), family
    llama = sorted(FAMILIES).index("llama")
    last = run_distributed(_pp2_logits, 2, paths[llama], ids, timeout=240)[1]
    assert _close(last, expected[llama])


@pytest.mark.slow
def test_moe_families_load_at_ep2(tmp_path):
    """Each rank holds half the experts of every MoE layer; the logits are still transformers'."""
    ids = _ids(3)
    paths, expected = _converted(MOE_FAMILIES, ids, tmp_path)
    for per_rank in run_distributed(_parallel_logits, 2, paths, ids, {"ep": 2}, timeout=240):
        for family, logits, want in zip(MOE_FAMILIES, per_rank, expected):
            assert _close(logits, want), family


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_greedy_equals_transformers_generate(family, tmp_path):
    from megalite.inference import LLM, EngineConfig, SamplingParams

    model = _hf_model(family)
    model.save_pretrained(tmp_path / "hf")
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14)]
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    llm = LLM(str(tmp_path / "ckpt"), engine_config=EngineConfig(block_size=4, num_blocks=64))
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(prompts))
    assert [o.outputs[0].token_ids for o in outputs] == expected


BAD_CONFIGS = [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]},
     r"qwen2 layer_types asks for per-layer sliding-window attention \(sliding_window=16 < "
     r"max_position_embeddings=256 on layers \[1\] of 2\)"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None},
     r"qwen3 max_window_layers asks for per-layer sliding-window attention \(sliding_window=16 < "
     r"max_position_embeddings=256 on layers \[1\] of 2\)"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
     "qwen3_moe max_window_layers asks for per-layer"),
    ("mistral", {"sliding_window": 0}, "mistral sliding_window must be a positive integer or null, got 0"),
    ("mixtral", {"hidden_act": "gelu"}, "mixtral hidden_act 'gelu' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "rope_parameters.rope_type 'dynamic' is not supported"),
    ("qwen3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.7}},
     "rope_parameters.mscale is not supported with rope_type 'linear'"),
    ("qwen3", {"attention_bias": True}, "qwen3 attention_bias=true"),
    ("llama", {"mlp_bias": True}, "llama attention_bias=False with mlp_bias=True is not supported"),
    ("llama", {"hidden_act": "gelu"}, "llama hidden_act 'gelu' is not supported"),
]


@pytest.mark.parametrize("family,change,message", BAD_CONFIGS)
def test_a_config_it_cannot_represent_is_one_error_naming_the_field(family, change, message, tmp_path):
    _hf_model(family).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_missing_shard_is_named(tmp_path):
    _hf_model("qwen3").save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    shard = sorted(n for n in os.listdir(tmp_path / "hf") if n.startswith("model-"))[1]
    os.remove(tmp_path / "hf" / shard)
    with pytest.raises(ValueError, match=f"{shard}, listed in .*model.safetensors.index.json, does not exist"):
        convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "out"))


LLAMA31_INSTRUCT = {  # the shape of Llama-3.1-8B-Instruct's config.json (written by transformers 4.x)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0",
    "use_cache": True, "vocab_size": 128256}
QWEN25_YARN = {  # Qwen2.5-7B-Instruct's config.json with the YaRN block its model card adds for long context
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}


@pytest.mark.parametrize("published", [LLAMA31_INSTRUCT, QWEN25_YARN], ids=["llama3.1", "qwen2.5-yarn"])
def test_published_transformers4_configs_round_trip_exactly(published):
    from megalite.checkpoint.hf import llama

    config = llama.config_from_hf(published)
    assert config.rope_scaling == published["rope_scaling"].get("rope_type", published["rope_scaling"].get("type"))
    assert config.rope_scaling_factor == published["rope_scaling"]["factor"]
    assert llama.hf_config(config, published, published["model_type"]) == published
MIXTRAL_INSTRUCT = {  # the shape of Mixtral-8x7B-Instruct-v0.1's config.json (transformers 4.x)
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
    "vocab_size": 32000}
QWEN15_MOE = {  # the shape of Qwen1.5-MoE-A2.7B's config.json (no mlp_only_layers; a window longer than the context)
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001}
QWEN3_MOE = {  # the shape of Qwen3-30B-A3B's config.json (head_dim 128 at hidden 2048 / 32 heads)
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("published, experts, shared, pre_softmax",
                         [(MIXTRAL_INSTRUCT, 8, None, False), (QWEN15_MOE, 60, 5632, True),
                          (QWEN3_MOE, 128, None, False)], ids=["mixtral", "qwen1.5-moe", "qwen3-moe"])
def test_published_moe_configs_round_trip_exactly(published, experts, shared, pre_softmax):
    from megalite.checkpoint.hf import llama

    config = llama.config_from_hf(published)
    moe = config.moe
    assert (moe.num_experts, moe.topk, moe.shared_expert_intermediate_size, moe.pre_softmax) == (
        experts, published["num_experts_per_tok"], shared, pre_softmax)
    assert moe.capacity_factor is None and config.window_size is None
    assert all(config.is_moe_layer(i) for i in range(config.num_layers))
    assert llama.hf_config(config, published, published["model_type"]) == published


MISTRAL_V01 = {  # the shape of Mistral-7B-v0.1's config.json: a 4096-token window in a 32768-token context
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}


def test_published_mistral_window_round_trips_exactly():
    from megalite.checkpoint.hf import llama

    config = llama.config_from_hf(MISTRAL_V01)
    assert config.window_size == 4095
    assert llama.hf_config(config, MISTRAL_V01, "mistral") == MISTRAL_V01
