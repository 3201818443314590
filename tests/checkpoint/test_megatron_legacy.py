"""Megatron-LM legacy checkpoints (mp_rank_TT_PPP/model_optim_rng.pt), written by Megatron-Core itself at tp=2
pp=2, convert into megalite checkpoints whose logits equal Megatron-Core's at tp=1 and at tp=2 pp=1; bad input
is one error line and exit 2 through tools/convert_checkpoint.py."""

import argparse
import dataclasses
import importlib.util
import io
import os
import shutil

import pytest
import torch

from megalite.checkpoint import load_model, read_checkpoint_info, read_global_tensors
from megalite.checkpoint.megatron_args import config_from_megatron_args, vocabulary_size
from megalite.cli import run_cli
from megalite.testing import run_distributed

from tests.checkpoint.megatron_legacy_fixture import CONSUMED, ITERATION, VOCAB, megatron_args, save_and_forward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(ROOT, "tools",
                                                                                     "convert_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _convert(capsys, source, output, *extra):
    """Run the converter's command line in this process: (exit status, stderr)."""
    status = run_cli(_tool().main, ["--from", "megatron-legacy", "--to", "megalite", "--input", str(source),
                                    "--output", str(output), *extra])
    return status, capsys.readouterr().err


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """(save directory of a tp=2 pp=2 legacy checkpoint, input ids, Megatron-Core's logits over the real vocabulary)."""
    pytest.importorskip("megatron.core")
    save = tmp_path_factory.mktemp("megatron") / "save"
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    per_rank = run_distributed(save_and_forward, 4, str(save), ids, timeout=240)
    return save, ids, per_rank[2][..., :VOCAB]


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _tp2_logits_and_adam(converted, ids):
    """At tp=2 pp=1, with megalite's optimizer as the trainer builds it: (logits gathered over TP, Adam step count,
    whether every moment is Megatron's: ``exp_avg = 2 w + 1``, ``exp_avg_sq = w * w`` on the real rows)."""
    from megalite import checkpoint, topology
    from megalite.checkpoint.sharding import VOCAB_PARAMS
    from megalite.distributed import DDPConfig, DistributedDataParallel
    from megalite.models import GPTModel
    from megalite.optim import OptimizerConfig, get_optimizer
    from megalite.tensor_parallel import gather_from_tensor_parallel_region

    topo = topology.initialize(tp=2)
    config = checkpoint.CheckpointReader(converted).config
    chunk = DistributedDataParallel(GPTModel(config), DDPConfig())
    optimizer = get_optimizer(OptimizerConfig(lr=1e-3), [chunk])
    checkpoint.load_sharded(converted, [chunk], optimizer)
    names = {param: name for name, param in chunk.module.named_parameters()}
    moments = []
    for shard in optimizer.shards:
        state, weight = optimizer.optimizer.state[shard.main], shard.param.detach()
        rows = weight.shape[0]
        if names[shard.param] in VOCAB_PARAMS:  # this rank's rows below the real vocabulary size
            rows = min(rows, config.vocab_size - topo.tp.rank * rows)
        exp_avg, exp_avg_sq = (state[k].view(weight.shape)[:rows] for k in ("exp_avg", "exp_avg_sq"))
        moments.append(torch.equal(exp_avg, 2 * weight[:rows] + 1) and torch.equal(exp_avg_sq, weight[:rows] ** 2))
    with torch.no_grad():
        logits = gather_from_tensor_parallel_region(chunk.module.eval()(ids), topo.tp.group)[..., :config.vocab_size]
    return logits, optimizer.num_steps, len(moments) == len(names) and all(moments)


@pytest.mark.slow
def test_converted_logits_equal_megatron_core_at_other_layouts(megatron, tmp_path, capsys):
    save, ids, expected = megatron
    status, err = _convert(capsys, save, tmp_path / "out", "--allow-pickle")
    assert status == 0, err
    assert err.startswith("warning: unpickling the Megatron-LM checkpoint") and err.count("\n") == 1
    info = read_checkpoint_info(str(tmp_path / "out"))
    assert info["iteration"] == ITERATION and info["state"]["consumed_samples"] == CONSUMED
    config = info["config"]
    assert (config.vocab_size, config.num_query_groups, config.activation, config.normalization,
            config.untie_embeddings_and_output_weights) == (VOCAB, 2, "swiglu", "RMSNorm", True)
    with torch.no_grad():
        logits = load_model(str(tmp_path / "out"))(ids)
    assert logits.shape == expected.shape
    assert _relative(logits, expected) <= 1e-5
    assert info["state"]["optimizer"]["num_steps"] == 1
    for logits, steps, adam_is_megatrons in run_distributed(_tp2_logits_and_adam, 2, str(tmp_path / "out"), ids,
                                                            timeout=120):
        assert _relative(logits, expected) <= 1e-5
        assert steps == 1 and adam_is_megatrons


@pytest.mark.slow
def test_gpt3_style_biases_learned_positions_and_tied_embeddings(tmp_path, capsys):
    """Megatron-LM's GPT-3 example model (GELU, biases split with their layers, LayerNorm, learned positions,
    tied embeddings) at tp=2 pp=1, whose rank files are mp_rank_TT without a pipeline suffix."""
    pytest.importorskip("megatron.core")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    per_rank = run_distributed(save_and_forward, 2, str(tmp_path / "save"), ids, 2, 1, "gpt3", timeout=240)
    assert sorted(os.listdir(tmp_path / "save" / f"iter_{ITERATION:07d}")) == ["mp_rank_00", "mp_rank_01"]
    status, err = _convert(capsys, tmp_path / "save", tmp_path / "out", "--allow-pickle")
    assert status == 0, err
    config = read_checkpoint_info(str(tmp_path / "out"))["config"]
    assert (config.activation, config.add_bias_linear, config.position_embedding_type, config.normalization,
            config.untie_embeddings_and_output_weights) == ("gelu", True, "learned_absolute", "LayerNorm", False)
    with torch.no_grad():
        logits = load_model(str(tmp_path / "out"))(ids)
    assert _relative(logits, per_rank[0][..., :VOCAB]) <= 1e-5


@pytest.mark.slow
def test_qk_layernorm_qkv_only_bias_and_interleaved_scaled_rope(tmp_path, capsys):
    """Megatron-LM's --qk-layernorm, --add-qkv-bias without --add-bias-linear, --rotary-interleaved and
    --use-rope-scaling (Llama 3's, --rope-scaling-factor 4) at tp=2 pp=1: the converted model's logits are
    Megatron-Core's."""
    pytest.importorskip("megatron.core")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    per_rank = run_distributed(save_and_forward, 2, str(tmp_path / "save"), ids, 2, 1, "qwen3", timeout=240)
    status, err = _convert(capsys, tmp_path / "save", tmp_path / "out", "--allow-pickle")
    assert status == 0, err
    config = read_checkpoint_info(str(tmp_path / "out"))["config"]
    assert (config.qk_layernorm, config.add_qkv_bias, config.add_bias_linear, config.rotary_interleaved,
            config.rope_scaling, config.rope_scaling_factor, config.rotary_base) == \
        (True, True, False, True, "llama3", 4.0, 1000000)
    names = read_global_tensors(str(tmp_path / "out"))[1]
    assert "decoder.layers.0.self_attention.k_layernorm.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in names
    with torch.no_grad():
        logits = load_model(str(tmp_path / "out"))(ids)
    assert _relative(logits, per_rank[0][..., :VOCAB]) <= 1e-5


def _rewrite(source, target, edit, zipfile=True):
    """Copy a legacy save directory, passing every rank file's state through ``edit(state, rank_dir)``
    (``zipfile=False``: saved in the format of torch < 1.6, which older Megatron-LM runs wrote)."""
    shutil.copytree(source, target)
    directory = os.path.join(target, f"iter_{ITERATION:07d}")
    for rank_dir in sorted(os.listdir(directory)):
        path = os.path.join(directory, rank_dir, "model_optim_rng.pt")
        state = torch.load(path, weights_only=False)
        edit(state, rank_dir)
        torch.save(state, path, _use_new_zipfile_serialization=zipfile)


def _transformer_engine_names(state, rank_dir):
    """The names Megatron-LM's default Transformer Engine layers give the norms, with TE's _extra_state entries (and
    a distributed optimizer's entry, without moments, which the converter names as not converted)."""
    state["optimizer"] = {"optimizer": {"param_groups": state["optimizer"]["param_groups"]}}
    renamed = {}
    for name, value in state["model"].items():
        for local, te in (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                          ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")):
            if name.endswith(local) and name.startswith("decoder.layers."):
                name = name[:-len(local)] + te
        renamed[name] = value
        if name.endswith("linear_qkv.weight"):
            renamed[name[:-len("weight")] + "_extra_state"] = io.BytesIO(b"fp8 metadata")
    state["model"] = renamed


@pytest.mark.slow
def test_transformer_engine_names_a_release_directory_and_old_files(megatron, tmp_path, capsys):
    save, _, _ = megatron
    assert _convert(capsys, save, tmp_path / "local", "--allow-pickle")[0] == 0
    _rewrite(save, tmp_path / "te", _transformer_engine_names, zipfile=False)
    os.rename(tmp_path / "te" / f"iter_{ITERATION:07d}", tmp_path / "te" / "release")
    (tmp_path / "te" / "latest_checkpointed_iteration.txt").write_text("release")
    status = run_cli(_tool().main, ["--from", "megatron-legacy", "--to", "megalite", "--input", str(tmp_path / "te"),
                                    "--output", str(tmp_path / "te_out"), "--allow-pickle"])
    out = capsys.readouterr().out
    assert status == 0
    assert "warning: the Megatron optimizer state is not read (it holds no Adam moments (a distributed optimizer " \
           "keeps them in distrib_optim.pt, DP-sharded)): training from this checkpoint starts with fresh Adam " \
           "moments" in out
    _, local, _ = read_global_tensors(str(tmp_path / "local"))
    _, te, state = read_global_tensors(str(tmp_path / "te_out"))
    assert sorted(te) == sorted(local)
    for name in local:
        assert torch.equal(te[name], local[name]), name
    assert read_checkpoint_info(str(tmp_path / "te_out"))["iteration"] == 0


def _interleave(source, target):
    """The tp=2 pp=2 checkpoint re-cut as Megatron lays out pp=2 with 2 virtual stages (``model0``, ``model1``) of
    one layer each: stage p's chunk v holds global layer 2v+p, numbered 0 within the chunk."""
    shutil.copytree(source, target)
    directory = target / f"iter_{ITERATION:07d}"
    for t in range(2):
        old = [torch.load(directory / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt", weights_only=False)
               for p in range(2)]

        def layer(index):
            p, local = divmod(index, 2)
            prefix = f"decoder.layers.{local}."
            return {"decoder.layers.0." + k[len(prefix):]: v for k, v in old[p]["model"].items()
                    if k.startswith(prefix)}

        for p in range(2):
            chunks = [layer(2 * v + p) for v in range(2)]
            chunks[0 if p == 0 else 1].update({k: v for k, v in old[p]["model"].items()
                                               if not k.startswith("decoder.layers.")})
            state = {k: v for k, v in old[p].items() if k not in ("model", "optimizer")}  # moments follow the old order
            state["model0"], state["model1"] = chunks
            state["args"].virtual_pipeline_model_parallel_size = 2
            torch.save(state, directory / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt")


@pytest.mark.slow
def test_virtual_pipeline_stages_are_ordered_chunk_then_stage(megatron, tmp_path, capsys):
    save, _, _ = megatron
    assert _convert(capsys, save, tmp_path / "plain", "--allow-pickle")[0] == 0
    _interleave(save, tmp_path / "vpp")
    status, err = _convert(capsys, tmp_path / "vpp", tmp_path / "vpp_out", "--allow-pickle")
    assert status == 0, err
    _, plain, _ = read_global_tensors(str(tmp_path / "plain"))
    _, interleaved, _ = read_global_tensors(str(tmp_path / "vpp_out"))
    assert sorted(interleaved) == sorted(plain)
    for name in plain:
        assert torch.equal(interleaved[name], plain[name]), name


@pytest.mark.slow
def test_bad_input_is_one_error_line_and_exit_2(megatron, tmp_path, capsys):
    save, _, _ = megatron
    status, err = _convert(capsys, save, tmp_path / "a")
    assert status == 2 and err.count("\n") == 1
    assert "is a Megatron-LM legacy checkpoint, whose model_optim_rng.pt files are Python pickles" in err
    assert "pass --allow-pickle" in err and not os.path.exists(tmp_path / "a")

    shutil.copytree(save, tmp_path / "partial")
    os.remove(tmp_path / "partial" / f"iter_{ITERATION:07d}" / "mp_rank_01_001" / "model_optim_rng.pt")
    status, err = _convert(capsys, tmp_path / "partial", tmp_path / "b", "--allow-pickle")
    assert status == 2 and err.count("error:") == 1 and not os.path.exists(tmp_path / "b")
    assert "mp_rank_01_001/model_optim_rng.pt is missing (1 of the 4 rank files that the saved args' " \
           "tensor_model_parallel_size 2 x pipeline_model_parallel_size 2 need)" in err

    status, err = _convert(capsys, save, tmp_path / "c", "--allow-pickle", "--vocab-size", "60")
    assert status == 2 and err.count("error:") == 1 and not os.path.exists(tmp_path / "c")
    assert "error: --vocab-size 60 contradicts the checkpoint's args.vocab_size 50" in err

    def one_tensor_rank(state, rank_dir):
        state["args"].tensor_model_parallel_size, state["args"].make_vocab_size_divisible_by = 1, 16

    _rewrite(save, tmp_path / "tp1_args", one_tensor_rank)
    status, err = _convert(capsys, tmp_path / "tp1_args", tmp_path / "e", "--allow-pickle")
    assert status == 2 and err.count("error:") == 1 and not os.path.exists(tmp_path / "e")
    assert "holds mp_rank_01_000, which the saved args' tensor_model_parallel_size 1 x " \
           "pipeline_model_parallel_size 2 do not have" in err

    def with_experts(state, rank_dir):
        state["args"].num_experts, state["args"].expert_tensor_parallel_size = 4, 1

    _rewrite(save, tmp_path / "moe", with_experts)
    status, err = _convert(capsys, tmp_path / "moe", tmp_path / "f", "--allow-pickle")
    assert status == 2 and err.count("error:") == 1 and not os.path.exists(tmp_path / "f")
    assert "the saved args' world_size None does not give the ranks of tensor_model_parallel_size 2 x " \
           "context_parallel_size 1 x pipeline_model_parallel_size 2 and of expert_tensor_parallel_size 1 x " \
           "expert_model_parallel_size 1, which a legacy save with expert_tensor_parallel_size other than tp needs " \
           "to place its files" in err

    def without_vocab_size(state, rank_dir):
        state["args"].vocab_size = None

    _rewrite(save, tmp_path / "tokenizer", without_vocab_size)
    status, err = _convert(capsys, tmp_path / "tokenizer", tmp_path / "d", "--allow-pickle")
    assert status == 2 and "the checkpoint's args hold no vocab_size" in err and "pass --vocab-size" in err
    status, err = _convert(capsys, tmp_path / "tokenizer", tmp_path / "d", "--allow-pickle", "--vocab-size", "50")
    assert status == 0, err
    assert read_checkpoint_info(str(tmp_path / "d"))["config"].vocab_size == VOCAB


def test_megatron_args_rules():
    args = megatron_args(2, 2)
    assert vocabulary_size(args) == VOCAB
    with pytest.raises(ValueError, match="vocabulary size 40 pads to 48 at make_vocab_size_divisible_by 8 x "
                                         "tensor_model_parallel_size 2, but the checkpoint's args.padded_vocab_size "
                                         "is 64"):
        vocabulary_size(argparse.Namespace(**{**vars(args), "vocab_size": None}), 40)
    gqa_off = argparse.Namespace(**{**vars(args), "group_query_attention": False, "num_query_groups": 1})
    assert config_from_megatron_args(gqa_off).num_query_groups == 4  # Megatron ignores the groups without GQA
    gelu = argparse.Namespace(**{**vars(args), "swiglu": False, "openai_gelu": True})
    assert config_from_megatron_args(gelu).activation == "gelu_tanh"
    assert config_from_megatron_args(vars(args)) == config_from_megatron_args(args)  # args read as plain data
    moe = {"num_experts": 4, "moe_router_topk": 2}
    for changes, what in (({**moe, "moe_input_jitter_eps": 0.01}, r"args.moe_input_jitter_eps=0.01 \(MoE input jitter"),
                          ({**moe, "moe_router_load_balancing_type": "sinkhorn"},
                           "args.moe_router_load_balancing_type='sinkhorn': megalite's MoE implements"),
                          ({**moe, "moe_aux_loss_coeff": [0.01, 0.1], "moe_router_load_balancing_type":
                            ["aux_loss", "seq_aux_loss"]}, "args.moe_router_load_balancing_type=.*one router"),
                          ({"position_embedding_type": "relative"}, "learned_absolute and rope"),
                          ({"softmax_type": "learnable"}, "vanilla"),
                          ({"window_size": (64, 0)}, "sliding-window attention")):
        with pytest.raises(ValueError, match=what):
            config_from_megatron_args(argparse.Namespace(**{**vars(args), **changes}))
    routed = config_from_megatron_args(argparse.Namespace(**{**vars(args), **moe, "moe_ffn_hidden_size": 24,
                                                             "moe_router_load_balancing_type": ["seq_aux_loss"],
                                                             "moe_aux_loss_coeff": [0.01], "moe_layer_freq": 2}))
    assert (routed.moe.num_experts, routed.moe.ffn_hidden_size, routed.moe.load_balancing_type,
            routed.moe.aux_loss_coeff, routed.moe_layer_freq) == (4, 24, "seq_aux_loss", 0.01, 2)


def test_megatron_attention_options_map_both_ways():
    """QK layer norm, interleaved RoPE, Llama-3 RoPE scaling and a QKV-only bias read from Megatron-LM's args, and
    megalite -> Megatron conversion writes them back (a bias on every layer makes add_qkv_bias moot)."""
    from megalite.checkpoint.megatron_convert import megatron_args as to_megatron

    args = vars(megatron_args(2, 1))

    def read(**changes):
        return config_from_megatron_args({**args, **changes})

    plain = read()
    assert (plain.qk_layernorm, plain.rotary_interleaved, plain.rope_scaling, plain.add_qkv_bias) == \
        (False, False, None, False)
    assert read(qk_layernorm=True).qk_layernorm and read(rotary_interleaved=True).rotary_interleaved
    scaled = read(use_rope_scaling=True, rope_scaling_factor=16.0)
    assert (scaled.rope_scaling, scaled.rope_scaling_factor, scaled.rope_low_freq_factor, scaled.rope_high_freq_factor,
            scaled.rope_original_max_position_embeddings) == ("llama3", 16.0, 1.0, 4.0, 8192)
    assert read(use_rope_scaling=True, rope_scaling_factor=None).rope_scaling_factor == 8.0  # Megatron's default
    qkv_only = read(add_bias_linear=False, add_qkv_bias=True)
    assert qkv_only.add_qkv_bias and not qkv_only.add_bias_linear
    everywhere = read(add_bias_linear=True, add_qkv_bias=True)
    assert everywhere.add_bias_linear and not everywhere.add_qkv_bias
    for config in (plain, scaled, qkv_only, everywhere,
                   read(qk_layernorm=True, rotary_interleaved=True, use_rope_scaling=True, rope_scaling_factor=4.0)):
        assert config_from_megatron_args(to_megatron(config, 2, ITERATION)) == config
    for changes in ({"rope_scaling": "linear"}, {"rope_high_freq_factor": 2.0}):
        with pytest.raises(ValueError, match="has no Megatron-LM flag"):
            to_megatron(dataclasses.replace(scaled, **changes), 2, ITERATION)


def test_chained_half_precision_optimizers_give_each_parameters_main_weight():
    """A legacy MoE save's chain of two Float16 optimizers (the dense parameters', then the local experts', each with
    its ``fp32_from_fp16_params``): each parameter gets its own chained optimizer's moments and fp32 main weight, by
    Megatron's default groups (1-D parameters undecayed), and the optimizer state counts the common step."""
    from megalite.checkpoint.megatron_legacy_optim import optimizer_entries

    expert = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    chunk = {"decoder.layers.0.mlp.router.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
             expert.format(0): torch.zeros(6, 8, dtype=torch.bfloat16),
             "decoder.final_layernorm.weight": torch.zeros(8, dtype=torch.bfloat16),
             expert.format(1): torch.zeros(6, 8, dtype=torch.bfloat16)}
    group = {"lr": 0.1, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "lr_mult": 1.0}

    def adam(params, expert_parallel):
        """A Float16 optimizer's state of ``params`` (names per group, decayed then undecayed; no empty group)."""
        shapes = [[chunk[n].shape for n in names] for names in params if names]
        counter = iter(range(100))
        state = {i: {"step": 3, "exp_avg": torch.full(s, float(i + 10 * expert_parallel)),
                     "exp_avg_sq": torch.full(s, float(i + 20))}
                 for i, s in zip(counter, [s for group_shapes in shapes for s in group_shapes])}
        groups, start = [], 0
        for wd_mult, group_shapes in zip((1.0, 0.0)[:len(shapes)], shapes):
            groups.append({**group, "wd_mult": wd_mult, "is_expert_parallel": expert_parallel,
                           "params": list(range(start, start + len(group_shapes)))})
            start += len(group_shapes)
        mains = [[torch.full(s, -1.0 - i - 10 * expert_parallel, dtype=torch.float32) for i, s in enumerate(g)]
                 for g in shapes]
        return {"optimizer": {"state": state, "param_groups": groups}, "fp32_from_fp16_params": mains}

    dense = adam([["decoder.layers.0.mlp.router.weight"], ["decoder.final_layernorm.weight"]], False)
    experts = adam([[expert.format(0), expert.format(1)]], True)
    (entries,), meta = optimizer_entries([dense, experts], [chunk])
    assert meta["num_steps"] == 3 and [g["weight_decay"] for g in meta["param_groups"]] == [0.1, 0.0]
    assert sorted(entries) == sorted(chunk)
    expected = {"decoder.layers.0.mlp.router.weight": (0.0, 20.0, -1.0), "decoder.final_layernorm.weight":
                (1.0, 21.0, -1.0), expert.format(0): (10.0, 20.0, -11.0), expert.format(1): (11.0, 21.0, -12.0)}
    for name, (avg, avg_sq, main) in expected.items():
        assert set(entries[name]) == {"exp_avg", "exp_avg_sq", "main"}
        assert torch.equal(entries[name]["exp_avg"], torch.full(chunk[name].shape, avg)), name
        assert torch.equal(entries[name]["exp_avg_sq"], torch.full(chunk[name].shape, avg_sq)), name
        assert torch.equal(entries[name]["main"], torch.full(chunk[name].shape, main)), name


def test_the_rank_files_of_a_save_whose_experts_split_otherwise_than_tp():
    """With expert_tensor_parallel_size other than tp, the first rank of each expert data-parallel group writes its
    (tensor, pipeline, expert) rank's file, in Megatron-Core's rank order; a file two such ranks with different expert
    shards would write, and args without the world size, are one clear error."""
    from megalite.checkpoint.megatron_legacy_files import written_ranks

    Namespace = argparse.Namespace

    assert written_ranks(Namespace(), 2, 1, 2, 2) == {(t, 0, e): t for t in range(2) for e in range(2)}
    assert written_ranks(Namespace(world_size=2), 2, 1, 2, 1) == {(0, 0, 0): 0, (1, 0, 1): 0}
    assert written_ranks(Namespace(world_size=8), 2, 1, 4, 1) == {(0, 0, 0): 0, (1, 0, 1): 0, (0, 0, 2): 0,
                                                                  (1, 0, 3): 0}
    with pytest.raises(ValueError, match=r"writes the experts of expert tensor ranks 0 and 1 into one file, mp_rank_00: "
                                         "only one of them is on disk"):
        written_ranks(Namespace(world_size=2), 1, 1, 1, 2)
    with pytest.raises(ValueError, match="the saved args' world_size None does not give the ranks"):
        written_ranks(Namespace(), 2, 1, 2, 1)
