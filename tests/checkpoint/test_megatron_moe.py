"""Megatron-LM torch_dist MoE checkpoints, written by Megatron-Core at ep=2, load into megalite at ep=1 and ep=2.

Megatron-Core's GPT with the local layer spec, a routed MoE MLP (4 SwiGLU experts, top-2, dropless, a shared
expert) in layer 0 and a dense MLP in layer 1 (``moe_layer_freq=[1, 0]``), saved by ``dist_checkpointing`` from
two expert-parallel ranks after SAVED_AT iterations of Megatron-Core's DDP and (non-distributed) Adam, then trained
CONTINUED more (:mod:`megatron_optim_fixture`'s run).  megalite reads the architecture from the saved args and
its logits equal Megatron-Core's own (its ``dist_checkpointing.load`` into an ep=1 model) on the same tokens.
Both Megatron expert implementations save the same sharded names (SequentialMLP's per-expert ``local_experts.<i>`` and
GroupedMLP's ``weight1/weight2`` alike become ``experts.experts.linear_fc1|2`` with an expert dimension); a GroupedMLP
run (``--moe-grouped-gemm``, its grouped GEMM on the CPU: :mod:`megatron_grouped_fixture`) is trained and saved beside
the SequentialMLP one, and megalite loads and continues it at ep=1 and ep=2 likewise.  Converted to megalite and back (``--to megatron``), Megatron-Core's own load gives its
logits again.  megalite's ``pretrain --load`` of the save at ep=1 and at ep=2 continues Megatron's losses.  The same
state saved in the legacy format (``--ckpt-format torch``, the chained optimizers' states in ``model_optim_rng.pt``)
reads as the torch_dist save.
"""

import argparse
import os

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")
pytestmark = pytest.mark.slow  # Megatron-Core writes the save directory from 2 ranks

from megalite.testing import run_distributed  # noqa: E402
from tests.checkpoint import megatron_fixture, megatron_grouped_fixture as grouped_fixture  # noqa: E402
from tests.checkpoint import megatron_optim_fixture as run  # noqa: E402

ARGS = dict(megatron_fixture.ARGS, num_layers=2, num_query_groups=4, group_query_attention=False,
            qk_layernorm=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
            moe_shared_expert_intermediate_size=40, moe_layer_freq=[1, 0], moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False)
GROUPED = "_grouped"
"""The suffix of the directory of the GroupedMLP run's save (``--moe-grouped-gemm``)."""
SINGLETON = "_singleton"
"""The suffix of the directory of the same save with Megatron-Core's ``singleton_local_shards`` (per-expert tensors,
SwiGLU fc1 halves ``weight_w``/``weight_v``)."""
IDS = torch.arange(2 * 12).reshape(2, 12).mul(7).remainder(90)


def _build(ep: int, seed: int, grouped: bool = False, spec_of=None):
    """Megatron-Core's MoE GPT of :data:`ARGS` on this rank of a tp=1 x ep grid (fp32, CPU, local layer spec, or
    ``spec_of(its decoder block spec)``; ``grouped``: GroupedMLP experts, their grouped GEMM on the CPU
    (:mod:`megatron_grouped_fixture`))."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.transformer.moe import moe_utils

    megatron_fixture.patch_cuda()
    moe_utils.te_general_gemm = None  # its failed Transformer-Engine import leaves the name undefined
    grouped_fixture.patch_grouped_gemm()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    a = ARGS
    config = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        ffn_hidden_size=a["ffn_hidden_size"], kv_channels=a["kv_channels"], hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=a["init_method_std"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=a["norm_epsilon"],
        add_bias_linear=False, use_cpu_initialization=True, expert_model_parallel_size=ep,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        num_moe_experts=a["num_experts"], moe_router_topk=a["moe_router_topk"],
        moe_ffn_hidden_size=a["moe_ffn_hidden_size"], moe_layer_freq=a["moe_layer_freq"],
        moe_shared_expert_intermediate_size=a["moe_shared_expert_intermediate_size"],
        moe_token_dispatcher_type=a["moe_token_dispatcher_type"], moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped,
        moe_use_legacy_grouped_gemm=grouped)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    spec = spec_of(spec) if spec_of else spec
    model = GPTModel(config, spec, vocab_size=a["padded_vocab_size"], max_sequence_length=a["max_position_embeddings"],
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    with torch.no_grad():  # non-zero norm weights and a router that separates experts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "router" in name:
                param.normal_(0.0, 0.5)
    grouped_fixture.allow_fp32(model)
    return model


def _sharded_shapes(model) -> dict:
    """``{sharded key: global shape}`` of the tensors ``model`` saves."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    return {t.key: tuple(t.global_shape) for t in nested_values(state) if isinstance(t, ShardedTensor)}


def _train(model, ep: int, save_dir: str, grouped: bool = False):
    """Megatron-LM's run of ``model`` on an ep grid (tp=1, dp=2: each rank one micro-batch of an iteration) with
    Megatron-Core's DDP, (non-distributed) Adam and scheduler, saved into ``save_dir`` after SAVED_AT iterations
    (and in the legacy format into ``save_dir + LEGACY``; SequentialMLP's also with ``singleton_local_shards``;
    ``grouped``: GroupedMLP's, its args saying ``--moe-grouped-gemm``) and continued to TOTAL.  Returns this rank's saved Adam moments
    (:func:`_moments`) and Megatron's losses of every iteration."""
    import torch.distributed as dist

    ddp, optimizer, scheduler = run.wrap(model)
    batches = run.micro_batches()
    per_iteration = len(batches) // run.TOTAL
    losses = []
    for i in range(run.TOTAL):
        if i == run.SAVED_AT:
            moments = _moments(model, optimizer)
            args = argparse.Namespace(**{**ARGS, "vocab_size": None, "global_batch_size": run.GLOBAL_BATCH,
                                         "consumed_train_samples": i * run.GLOBAL_BATCH, "moe_grouped_gemm": grouped},
                                      tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                      expert_model_parallel_size=ep, world_size=dist.get_world_size(),
                                      data_parallel_size=dist.get_world_size(), transformer_impl="local")
            saves = ((save_dir, None),) if grouped else \
                ((save_dir, None), (save_dir + SINGLETON, {"singleton_local_shards": True}))
            for directory, metadata in saves:
                state = {"args": args, "checkpoint_version": 3.0, "iteration": i,
                         "model": model.sharded_state_dict(metadata=metadata)}
                state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
                state["opt_param_scheduler"] = scheduler.state_dict()
                megatron_fixture.save_state(state, directory, i)
            run._save_legacy(save_dir + run.LEGACY, i, ddp, optimizer, scheduler, **{
                **{k: v for k, v in ARGS.items() if megatron_fixture.ARGS.get(k) != v},
                "expert_model_parallel_size": ep, "moe_grouped_gemm": grouped})
        batch = batches[i * per_iteration:(i + 1) * per_iteration]
        losses.append(run._train_step(ddp, optimizer, scheduler, batch[dist.get_rank()::2]))
    return moments, losses


def _save(save_dir: str, ep: int, ids: torch.Tensor):
    """:func:`_train` of the SequentialMLP model into ``save_dir`` and of a GroupedMLP one into ``save_dir +
    GROUPED``; then megalite resumes each save (:func:`megatron_optim_fixture.resume`) at ep=1 and at ep=2 in these
    rank processes.  Returns, for each run (SequentialMLP's, GroupedMLP's), Megatron-Core's logits of ``ids`` after
    its own load of the save into an ep=1 model, this rank's saved Adam moments (:func:`_moments`), Megatron's
    losses of every iteration, the resumed runs' metrics files and rank 0's output of them; and whether GroupedMLP
    experts save the same tensors as the SequentialMLP ones."""
    from megatron.core import parallel_state

    model = _build(ep, seed=1)
    grouped_same = _sharded_shapes(_build(ep, seed=1, grouped=True)) == _sharded_shapes(model)
    run.patch_cuda()
    results = [_train(model, ep, save_dir)]
    parallel_state.destroy_model_parallel()
    results.append(_train(_build(ep, seed=3, grouped=True), ep, save_dir + GROUPED, grouped=True))
    parallel_state.destroy_model_parallel()
    root = os.path.dirname(save_dir)
    out = []
    for (moments, losses), directory, grouped in zip(results, (save_dir, save_dir + GROUPED), (False, True)):
        logits = _megatron_logits(directory, ids, grouped)
        metrics = [os.path.join(root, f"{os.path.basename(directory)}_ep{ep}.jsonl") for ep in (1, 2)]
        outputs = run.resume([(directory, metrics[0], ()),
                              (directory, metrics[1], ("--expert-model-parallel-size", "2"))])
        out.append((logits, moments, losses, metrics, [text for text, *_ in outputs]))
    return out, grouped_same


def _moments(model, optimizer):
    """This rank's Adam moments in megalite's names (at ep > 1 Megatron-Core chains a second optimizer for the
    experts): layer 0's router's first moment and the first moment of its local experts' fc1 and second of their
    fc2, stacked in expert order (GroupedMLP's ``weight1`` ``[hidden, experts x 2 ffn]`` and ``weight2`` ``[experts
    x ffn, hidden]`` as its forward views them, ``[experts, hidden, 2 ffn]`` and ``[experts, ffn, hidden]``, each
    expert's matrix transposed)."""
    state = {p: s for chained in optimizer.chained_optimizers for p, s in chained.optimizer.state.items()}
    params = dict(model.named_parameters())
    layer = "decoder.layers.0.mlp."
    moments = {f"optimizer.exp_avg.{layer}router.weight": state[params[layer + "router.weight"]]["exp_avg"].clone()}
    if layer + "experts.weight1" in params:
        hidden = ARGS["hidden_size"]
        one, two = (state[params[f"{layer}experts.weight{k}"]] for k in (1, 2))
        count = one["exp_avg"].numel() // (hidden * 2 * ARGS["moe_ffn_hidden_size"])
        moments[f"optimizer.exp_avg.{layer}experts.fc1_weight"] = \
            one["exp_avg"].view(count, hidden, -1).transpose(1, 2).clone()
        moments[f"optimizer.exp_avg_sq.{layer}experts.fc2_weight"] = \
            two["exp_avg_sq"].view(count, -1, hidden).transpose(1, 2).clone()
        return moments
    experts = sorted(n for n in params if n.startswith(layer + "experts.local_experts.") and "fc1" in n)
    moments[f"optimizer.exp_avg.{layer}experts.fc1_weight"] = torch.stack([state[params[n]]["exp_avg"]
                                                                           for n in experts])
    moments[f"optimizer.exp_avg_sq.{layer}experts.fc2_weight"] = torch.stack(
        [state[params[n.replace("fc1", "fc2")]]["exp_avg_sq"] for n in experts])
    return moments


def _megatron_logits(save_dir: str, ids: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """Megatron-Core's logits of ``ids`` after its own ``dist_checkpointing.load`` of ``save_dir`` into an ep=1
    model (``grouped``: of GroupedMLP experts)."""
    from megatron.core import dist_checkpointing

    model = _build(1, seed=7, grouped=grouped)
    directory = os.path.join(save_dir, f"iter_{run.SAVED_AT:07d}")
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)["model"])
    model.eval()
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model(ids, positions, causal)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(save directory, Megatron-Core's logits of IDS (its padded vocabulary, the model's: the save has no
    args.vocab_size), whether GroupedMLP saves SequentialMLP's tensors, the saved Adam moments (:func:`_moments`,
    the experts' from both EP ranks), Megatron's losses of iterations 1..TOTAL, megalite's resumed runs' metrics
    files (ep=1, ep=2), rank 0's output of them, and the same from the GroupedMLP run (its save directory first))``."""
    path = str(tmp_path_factory.mktemp("megatron_moe") / "save")
    for suffix in ("", run.LEGACY, SINGLETON, GROUPED, GROUPED + run.LEGACY):
        os.makedirs(path + suffix)
    ranks = run_distributed(_save, 2, path, 2, IDS, timeout=300)
    runs = []
    for index in range(2):
        moments = {name: torch.cat([r[0][index][1][name] for r in ranks]) if "experts" in name
                   else ranks[0][0][index][1][name] for name in ranks[0][0][index][1]}
        logits, _, losses, metrics, outputs = ranks[0][0][index]
        runs.append((logits, moments, losses, metrics, outputs))
    (logits, moments, *rest), grouped = runs
    return (path, logits, ranks[0][1], moments, *rest, (path + GROUPED, *grouped))


def _close(actual, expected):
    assert actual.shape == expected.shape
    rel = (actual - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-5, f"relative difference {rel.item():.3g}"


def _ep_logits(path, ep):
    """megalite's logits of IDS at ep (the model and its optimizer loaded as the trainer builds them), the Adam step
    count, and this rank's first moment of layer 0's expert fc1 weights."""
    from megalite import checkpoint, topology
    from megalite.distributed import DDPConfig, DistributedDataParallel
    from megalite.models import GPTModel
    from megalite.optim import OptimizerConfig, get_optimizer

    topology.initialize(ep=ep)
    config = checkpoint.read_checkpoint_info(path)["config"]
    chunk = DistributedDataParallel(GPTModel(config), DDPConfig())
    optimizer = get_optimizer(OptimizerConfig(lr=1e-2), [chunk])
    checkpoint.load_sharded(path, [chunk], optimizer)
    fc1 = dict(chunk.module.named_parameters())["decoder.layers.0.mlp.experts.fc1_weight"]
    shard = next(s for s in optimizer.shards if s.param is fc1)
    with torch.no_grad():
        logits = chunk.module.eval()(IDS)[..., :config.vocab_size]
    logits = logits.transpose(0, 1) if logits.shape[0] != IDS.shape[0] else logits
    return logits, optimizer.num_steps, optimizer.optimizer.state[shard.main]["exp_avg"].view(fc1.shape)


def test_grouped_experts_save_the_sequential_layout(saved):
    assert saved[2]


def test_a_grouped_gemm_run_loads_and_continues(saved):
    """Megatron-Core's GroupedMLP run (``--moe-grouped-gemm``: the experts' ``weight1``/``weight2``, whose sharded
    state transposes each expert's matrix into SequentialMLP's layout, moments too) saved at ep=2: megalite reads its
    weights with Megatron's logits at ep=1 and ep=2, its experts' Adam moments equal Megatron-Core's, and
    ``pretrain --load`` continues its losses at ep=1 and ep=2."""
    from megalite.checkpoint import load_model, read_checkpoint_info
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    path, logits, moments, losses, metrics, outputs = saved[7]
    assert read_checkpoint_info(path)["config"].moe.grouped_gemm
    with torch.no_grad():
        _close(load_model(path)(IDS), logits)
    for rank, (ours, steps, exp_avg) in enumerate(run_distributed(_ep_logits, 2, path, 2, timeout=120)):
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


def test_ep2_load_equals_megatron(saved):
    """At ep=2 the logits equal Megatron's, and each rank's optimizer resumes its experts' moments."""
    ranks = run_distributed(_ep_logits, 2, saved[0], 2, timeout=120)
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
    _close(run_distributed(_megatron_logits, 1, theirs, IDS, timeout=120)[0], saved[1])


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
