"""Megatron-LM torch_dist MoE checkpoints, written by Megatron-Core at ep=2, load into megalite at ep=1 and ep=2.

Megatron-Core's MoE GPT (:mod:`megatron_moe_fixture`: a routed MoE MLP of 4 SwiGLU experts, top-2, dropless, with a
shared expert, in layer 0 and a dense MLP in layer 1), saved by ``dist_checkpointing`` from two expert-parallel ranks
after SAVED_AT iterations of Megatron-Core's DDP and (non-distributed) Adam, then trained CONTINUED more
(:mod:`megatron_optim_fixture`'s run). megalite reads the architecture from the saved args and its logits equal
Megatron-Core's own (its ``dist_checkpointing.load`` into an ep=1 model) on the same tokens. Both Megatron expert
implementations save the same sharded names (SequentialMLP's per-expert ``local_experts.<i>`` and GroupedMLP's
``weight1/weight2`` alike become ``experts.experts.linear_fc1|2`` with an expert dimension); a GroupedMLP run
(``--moe-grouped-gemm``, its grouped GEMM on the CPU: :mod:`megatron_grouped_fixture`) is trained and saved beside the
SequentialMLP one; megalite loads it at ep=1 and ep=2 and continues it at ep=1. Converted to megalite and back
(``--to megatron``), Megatron-Core's own load gives its logits again. megalite's ``pretrain --load`` of the save at
ep=1 and at ep=2 continues Megatron's losses. The same state saved in the legacy format (``--ckpt-format torch``, the
chained optimizers' states in ``model_optim_rng.pt``) reads as the torch_dist save.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")
pytestmark = pytest.mark.slow  # Megatron-Core writes the save directory from 2 ranks

from megalite.testing import run_distributed  # noqa: E402
from tests.checkpoint import megatron_fixture, megatron_optim_fixture as run  # noqa: E402
from tests.checkpoint import megatron_moe_fixture as moe  # noqa: E402
from tests.checkpoint.megatron_moe_etp_fixture import EXPERT_TP  # noqa: E402
from tests.checkpoint.megatron_moe_fixture import GROUPED, IDS, SINGLETON  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(save directory, Megatron-Core's logits of IDS (its padded vocabulary, the model's: the save has no
    args.vocab_size), whether GroupedMLP saves SequentialMLP's tensors, the saved Adam moments
    (:func:`megatron_moe_fixture.adam_moments`, the experts' from both EP ranks), Megatron's losses of iterations
    1..TOTAL, megalite's resumed runs' metrics files (ep=1, ep=2), rank 0's output of them, the same from the
    GroupedMLP run (its save directory first), and Megatron-Core's logits of IDS of the expert-tensor-parallel save
    (:func:`megatron_moe_etp_fixture.save_expert_tp`))``."""
    path = str(tmp_path_factory.mktemp("megatron_moe") / "save")
    for suffix in ("", run.LEGACY, SINGLETON, GROUPED, GROUPED + run.LEGACY):
        os.makedirs(path + suffix)
    ranks = run_distributed(moe.run_and_resume, 2, path, 2, IDS, timeout=300)
    runs = []
    for index in range(2):
        moments = {name: torch.cat([r[0][index][1][name] for r in ranks]) if "experts" in name
                   else ranks[0][0][index][1][name] for name in ranks[0][0][index][1]}
        logits, _, losses, metrics, outputs = ranks[0][0][index]
        runs.append((logits, moments, losses, metrics, outputs))
    (logits, moments, *rest), grouped = runs
    return (path, logits, ranks[0][1], moments, *rest, (path + GROUPED, *grouped), ranks[0][2])


def _close(actual, expected):
    assert actual.shape == expected.shape
    rel = (actual - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-5, f"relative difference {rel.item():.3g}"


def _ep_logits(paths, ep):
    """For each checkpoint of ``paths``: megalite's logits of IDS at ep (the model and its optimizer loaded as the
    trainer builds them), the Adam step count, and this rank's first moment of layer 0's expert fc1 weights."""
    from megalite import checkpoint, topology
    from megalite.distributed import DDPConfig, DistributedDataParallel
    from megalite.models import GPTModel
    from megalite.optim import OptimizerConfig, get_optimizer

    topology.initialize(ep=ep)
    out = []
    for path in paths:
        config = checkpoint.read_checkpoint_info(path)["config"]
        chunk = DistributedDataParallel(GPTModel(config), DDPConfig())
        optimizer = get_optimizer(OptimizerConfig(lr=1e-2), [chunk])
        checkpoint.load_sharded(path, [chunk], optimizer)
        fc1 = dict(chunk.module.named_parameters())["decoder.layers.0.mlp.experts.fc1_weight"]
        shard = next(s for s in optimizer.shards if s.param is fc1)
        with torch.no_grad():
            logits = chunk.module.eval()(IDS)[..., :config.vocab_size]
        logits = logits.transpose(0, 1) if logits.shape[0] != IDS.shape[0] else logits
        out.append((logits, optimizer.num_steps, optimizer.optimizer.state[shard.main]["exp_avg"].view(fc1.shape)))
    return out


@pytest.fixture(scope="module")
def ep2_loads(saved):
    """``{save directory: each rank's :func:`_ep_logits` at ep=2}`` of the SequentialMLP and the GroupedMLP saves (one
    2-rank run)."""
    paths = [saved[0], saved[7][0]]
    ranks = run_distributed(_ep_logits, 2, paths, 2, timeout=120)
    return {path: [rank[index] for rank in ranks] for index, path in enumerate(paths)}


def test_grouped_experts_save_the_sequential_layout(saved):
    assert saved[2]


def test_a_grouped_gemm_run_loads_and_continues(saved, ep2_loads):
    """Megatron-Core's GroupedMLP run (``--moe-grouped-gemm``: the experts' ``weight1``/``weight2``, whose sharded
    state transposes each expert's matrix into SequentialMLP's layout, moments too) saved at ep=2: megalite reads its
    weights with Megatron's logits at ep=1 and ep=2, its experts' Adam moments equal Megatron-Core's (in the
    checkpoint and in each ep=2 rank's optimizer), and ``pretrain --load`` continues its losses at ep=1."""
    from megalite.checkpoint import load_model, read_checkpoint_info
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    path, logits, moments, losses, metrics, outputs = saved[7]
    assert read_checkpoint_info(path)["config"].moe.grouped_gemm
    with torch.no_grad():
        _close(load_model(path)(IDS), logits)
    for rank, (ours, steps, exp_avg) in enumerate(ep2_loads[path]):
        _close(ours, logits)
        expected = moments["optimizer.exp_avg.decoder.layers.0.mlp.experts.fc1_weight"][2 * rank:2 * rank + 2]
        assert steps == run.SAVED_AT and torch.equal(exp_avg, expected)
    reader = MegatronDistReader(path)
    assert reader.optimizer_note is None
    for name, expected in moments.items():
        assert torch.equal(reader.read(name), expected), name
    assert all(f"loaded checkpoint {path} at iteration {run.SAVED_AT}" in text and "warning" not in text
               for text in outputs), outputs
    for file in metrics:
        run.assert_equal_losses(run.losses(file), losses[run.SAVED_AT:])


def test_a_legacy_grouped_gemm_save_gives_the_torch_dist_state(saved):
    """The GroupedMLP run's legacy save (``model_optim_rng.pt``: ``mlp.experts.weight1|2``, every local expert's matrix
    transposed side by side, and their Adam moments in the chained optimizers' lists), read behind the pickle opt-in,
    holds the torch_dist save's weights and moments bit for bit and its optimizer state."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_legacy import read_megatron_legacy

    path = saved[7][0]
    legacy = read_megatron_legacy(path + run.LEGACY, allow_pickle=True, vocab_size=run.PADDED_VOCAB)
    theirs = MegatronDistReader(path)
    assert legacy.optimizer_note is None and legacy.optimizer == theirs.state["optimizer"]
    assert sorted(legacy.tensors) == sorted(theirs.shapes)
    for name in theirs.shapes:
        assert torch.equal(legacy.tensors[name], theirs.read(name)), name


def test_moe_config_from_megatron_args(saved):
    from megalite.checkpoint import read_checkpoint_info

    config = read_checkpoint_info(saved[0])["config"]
    moe = config.moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.activation, moe.shared_expert_intermediate_size,
            moe.capacity_factor, moe.dispatcher) == (4, 2, 48, "swiglu", 40, None, "allgather")
    assert config.moe_layer_freq == [1, 0]


def test_load_model_ep1_equals_megatron(saved):
    from megalite.checkpoint import load_model

    with torch.no_grad():
        logits = load_model(saved[0])(IDS)
    _close(logits, saved[1])


def test_ep2_load_equals_megatron(saved, ep2_loads):
    """At ep=2 the logits equal Megatron's, and each rank's optimizer resumes its experts' moments."""
    ranks = ep2_loads[saved[0]]
    expected = saved[3]["optimizer.exp_avg.decoder.layers.0.mlp.experts.fc1_weight"]
    for rank, (logits, steps, exp_avg) in enumerate(ranks):
        _close(logits, saved[1])
        assert steps == run.SAVED_AT
        torch.testing.assert_close(exp_avg, expected[2 * rank:2 * rank + 2], rtol=0, atol=0)


def test_pretrain_load_continues_the_megatron_moe_losses(saved):
    """Megatron-Core's MoE run (ep=2, its non-distributed Adam chained for the experts) resumed with
    ``pretrain --load`` at ep=1 and at ep=2: the next CONTINUED losses equal Megatron's continuation."""
    path, megatron = saved[0], saved[4]
    assert all(f"loaded checkpoint {path} at iteration {run.SAVED_AT}" in text and "warning" not in text
               for text in saved[6]), saved[6]
    for metrics in saved[5]:
        run.assert_equal_losses(run.losses(metrics), megatron[run.SAVED_AT:])


def test_convert_to_megalite_and_back_to_megatron(saved, tmp_path):
    """``--to megatron`` writes the MoE model as Megatron-Core saves it (experts, shared expert, unstacked mixed
    layers, their sharded objects): its own load gives its logits again."""
    from megalite.checkpoint import load_model

    ours, theirs = str(tmp_path / "megalite"), str(tmp_path / "megatron")
    assert megatron_fixture.convert("--from", "megatron", "--to", "megalite", "--input", saved[0],
                                    "--output", ours) == 0
    with torch.no_grad():
        _close(load_model(ours)(IDS), saved[1])
    assert megatron_fixture.convert("--from", "megalite", "--to", "megatron", "--input", ours,
                                    "--output", theirs) == 0
    _close(run_distributed(moe.megatron_logits, 1, theirs, IDS, timeout=120)[0], saved[1])


def test_moe_args_map_both_ways():
    """megalite's MoEConfig -> Megatron-LM's args -> MoEConfig is the identity; a setting Megatron has no flag for is
    an error naming it."""
    import dataclasses

    from megalite.checkpoint.megatron_args import config_from_megatron_args
    from megalite.checkpoint.megatron_convert import megatron_args
    from megalite.models import GPTConfig
    from megalite.moe import MoEConfig

    dense = GPTConfig(vocab_size=90, num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                      activation="swiglu", normalization="RMSNorm", add_bias_linear=False,
                      position_embedding_type="rope", max_position_embeddings=16, make_vocab_size_divisible_by=8)
    moe = MoEConfig(num_experts=8, ffn_hidden_size=24, topk=3, activation="swiglu", pre_softmax=True,
                    shared_expert_intermediate_size=16, shared_expert_gate=True, shared_expert_overlap=True,
                    aux_loss_coeff=0.01, load_balancing_type="seq_aux_loss", z_loss_coeff=0.001, capacity_factor=1.5,
                    token_drop_policy="position", grouped_gemm=True)
    sigmoid = dataclasses.replace(moe, pre_softmax=False, capacity_factor=None, score_function="sigmoid",
                                  enable_expert_bias=True, bias_update_rate=0.01, routed_scaling_factor=2.5,
                                  num_groups=4, group_topk=2, dispatcher="allgather", shared_expert_overlap=False)
    for config in (dataclasses.replace(dense, moe=moe, moe_layer_freq=[1, 0, 1, 1]),
                   dataclasses.replace(dense, moe=sigmoid, moe_layer_freq=2)):
        assert config_from_megatron_args(megatron_args(config, 1, 0)) == config
    with pytest.raises(ValueError, match="the MoE's activation 'gelu' differs from the model's 'swiglu'"):
        megatron_args(dataclasses.replace(dense, moe=dataclasses.replace(moe, activation="gelu")), 1, 0)


def test_expert_moments_of_the_chained_optimizer_are_read(saved):
    """At ep=2 Megatron-Core chains a second Adam for the experts (``chained_1.optimizer.state...``, its own
    parameter groups in ``common.pt``): megalite reads both as one optimizer state, the experts' moments (from both
    EP ranks) and the dense ones equal to Megatron's own after the step."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    reader = MegatronDistReader(saved[0])
    assert reader.optimizer_note is None
    assert reader.state["optimizer"]["num_steps"] == run.SAVED_AT
    assert [g["weight_decay"] for g in reader.state["optimizer"]["param_groups"]] == [0.1, 0.0]
    for name, expected in saved[3].items():
        torch.testing.assert_close(reader.read(name), expected, rtol=0, atol=0)


def test_legacy_chained_optimizer_gives_the_torch_dist_state(saved, tmp_path):
    """The same state saved in the legacy format (``mp_rank_00_<ep rank>/model_optim_rng.pt``, the non-distributed
    ChainedOptimizer's list of the dense and the expert Adam states), read behind the pickle opt-in, holds the
    torch_dist save's weights and Adam moments bit for bit, its optimizer state and its scheduler.  An expert
    optimizer whose groups train otherwise is named and its moments are not read."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_legacy import read_megatron_legacy

    legacy = read_megatron_legacy(saved[0] + run.LEGACY, allow_pickle=True, vocab_size=run.PADDED_VOCAB)
    theirs = MegatronDistReader(saved[0])
    assert legacy.optimizer_note is None
    assert legacy.optimizer == theirs.state["optimizer"]
    assert legacy.scheduler == theirs.state["megatron_scheduler"] is not None
    assert sorted(legacy.tensors) == sorted(theirs.shapes)
    assert sum(n.startswith("optimizer.exp_avg") for n in legacy.tensors) == 2 * sum(
        not n.startswith("optimizer.") for n in theirs.shapes)
    for name in theirs.shapes:
        assert torch.equal(legacy.tensors[name], theirs.read(name)), name
    for name, expected in saved[3].items():  # Megatron-Core's own moments of the run
        assert torch.equal(legacy.tensors[name], expected), name
    import shutil

    copy = str(tmp_path / "legacy")
    shutil.copytree(saved[0] + run.LEGACY, copy)
    path = os.path.join(copy, f"iter_{run.SAVED_AT:07d}", "mp_rank_00_001", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    for group in state["optimizer"][1]["param_groups"]:
        group["lr"] *= 2
    torch.save(state, path)
    changed = read_megatron_legacy(copy, allow_pickle=True, vocab_size=run.PADDED_VOCAB)
    assert changed.optimizer is None and not any(n.startswith("optimizer.") for n in changed.tensors)
    assert changed.optimizer_note == "its expert-parallel parameter groups train otherwise than the other parameters"


def test_a_legacy_save_with_experts_not_tensor_parallel_equals_megatron(saved, tmp_path):
    """tp=2 with expert_tensor_parallel_size 1 at ep=2 (:func:`megatron_moe_etp_fixture.save_expert_tp`): Megatron-LM's
    legacy save writes mp_rank_00_000 and mp_rank_01_001 only, each a tensor rank's dense shards and an expert rank's
    whole experts.  Read behind the pickle opt-in, the weights equal the torch_dist save's of the same state, the
    Adam moments are Megatron-Core's (set to 2 w + 1 and w * w), and megalite's logits of the conversion equal
    Megatron-Core's own (its load of the torch_dist save at tp=1)."""
    from megalite.checkpoint import load_model
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_legacy import convert_megatron_legacy

    source = saved[0] + EXPERT_TP + run.LEGACY
    assert sorted(os.listdir(os.path.join(source, f"iter_{run.SAVED_AT:07d}"))) == ["mp_rank_00_000", "mp_rank_01_001"]
    converted = str(tmp_path / "megalite")
    legacy = convert_megatron_legacy(source, converted, allow_pickle=True, vocab_size=run.PADDED_VOCAB)
    theirs = MegatronDistReader(saved[0] + EXPERT_TP)
    weights = sorted(n for n in theirs.shapes if not n.startswith("optimizer."))
    assert legacy.optimizer_note is None
    assert sorted(n for n in legacy.tensors if not n.startswith("optimizer.")) == weights
    assert "decoder.layers.0.mlp.experts.fc1_weight" in weights
    for name in weights:
        weight = legacy.tensors[name]
        assert torch.equal(weight, theirs.read(name)), name
        assert torch.equal(legacy.tensors[f"optimizer.exp_avg.{name}"], 2 * weight + 1), name
        assert torch.equal(legacy.tensors[f"optimizer.exp_avg_sq.{name}"], weight * weight), name
    with torch.no_grad():
        _close(load_model(converted)(IDS), saved[8])


def test_an_moe_setting_megalite_lacks_is_one_error_line(saved, tmp_path, capsys):
    """A Megatron MoE checkpoint whose args ask for what megalite's MoE cannot compute (input jitter) converts to
    nothing: exit 2 and one error line naming the arg."""
    import shutil

    from megalite.checkpoint.megatron_dist import COMMON
    from megalite.cli import run_cli

    copy = str(tmp_path / "jitter")
    shutil.copytree(saved[0], copy)
    common = os.path.join(copy, f"iter_{run.SAVED_AT:07d}", COMMON)
    state = torch.load(common, weights_only=False)
    state["args"].moe_input_jitter_eps = 0.01
    torch.save(state, common)
    status = run_cli(lambda argv: megatron_fixture.convert(*argv), ["--from", "megatron", "--to", "megalite",
                                                                     "--input", copy, "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and not os.path.exists(tmp_path / "o"), err
    assert "args.moe_input_jitter_eps=0.01 (MoE input jitter): megalite's GPT does not implement it" in err


def test_a_singleton_local_shards_save_reads_as_the_stacked_one(saved, tmp_path):
    """Megatron-Core's ``singleton_local_shards`` save (each expert a tensor of its own, each SwiGLU fc1 split into
    ``weight_w`` and ``weight_v``, dense and shared-expert MLPs too; Adam's moments likewise): megalite reads every
    model and optimizer tensor equal to the default save's, and converts it (``--from megatron``) to a checkpoint
    whose logits are Megatron's."""
    from megalite.checkpoint import load_model
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.storage import Region

    single, stacked = MegatronDistReader(saved[0] + SINGLETON), MegatronDistReader(saved[0])
    keys = single.metadata.state_dict_metadata
    assert "decoder.layers.0.mlp.experts.experts.3.linear_fc1.weight_v" in keys
    assert "chained_1.optimizer.state.exp_avg.decoder.layers.0.mlp.experts.experts.0.linear_fc2.weight" in keys
    assert "decoder.layers.1.mlp.linear_fc1.weight_w" in keys
    assert single.shapes == stacked.shapes and single.optimizer_note is None
    assert single.state["optimizer"] == stacked.state["optimizer"]
    assert single.megatron_shapes() == stacked.megatron_shapes()
    names = list(stacked.shapes)
    ours, theirs = single.read_all(names), stacked.read_all(names)
    for name in names:
        assert torch.equal(ours[name], theirs[name]), name
    region = torch.empty(2, 60, 32)  # experts 1-2, across their gate/up halves
    single.read_regions([Region("decoder.layers.0.mlp.experts.fc1_weight", (1, 20, 0), region)])
    assert torch.equal(region, theirs["decoder.layers.0.mlp.experts.fc1_weight"][1:3, 20:80])
    region.zero_()
    (views,) = single.read_views([("decoder.layers.0.mlp.experts.fc1_weight", (1, 20, 0), (2, 60, 32))])
    assert len(views) == 4  # the gate and up halves of two experts
    for index, view in views:
        region[index] = view
    assert torch.equal(region, theirs["decoder.layers.0.mlp.experts.fc1_weight"][1:3, 20:80])
    converted = str(tmp_path / "megalite")
    assert megatron_fixture.convert("--from", "megatron", "--to", "megalite", "--input", saved[0] + SINGLETON,
                                    "--output", converted) == 0
    with torch.no_grad():
        _close(load_model(converted)(IDS), saved[1])


def test_incomplete_singleton_shards_are_one_error():
    """A tensor saved in singleton shards that lacks one is an error naming the missing parts."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    from megalite.checkpoint.megatron_names import map_names

    def entry(*size):
        chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=torch.Size(size))
        return dcp_metadata.TensorStorageMetadata(dcp_metadata.TensorProperties(dtype=torch.float32),
                                                  torch.Size(size), [chunk])

    key = "decoder.layers.0.mlp.experts.experts.{}.linear_fc1.weight_{}"
    present = {key.format(e, h): entry(48, 32) for e, h in ((0, "w"), (0, "v"), (2, "w"), (2, "v"), (1, "w"))}
    metadata = dcp_metadata.Metadata(state_dict_metadata=present)
    with pytest.raises(ValueError, match=r"Megatron-LM checkpoint /x: the singleton shards of "
                                         r"decoder\.layers\.0\.mlp\.experts\.fc1_weight are incomplete "
                                         r"\(missing: expert 1 _v\)"):
        map_names(metadata, 96, "/x")
