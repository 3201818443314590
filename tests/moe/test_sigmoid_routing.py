"""DeepSeek-V3 routing: sigmoid scores, group-limited top-k, routed scaling and the aux-loss-free expert bias."""

from __future__ import annotations

import pytest
import torch

from megalite import topology
from megalite.models import GPTModel
from megalite.moe import MoEConfig, TopKRouter, update_expert_bias
from megalite.testing import run_distributed
from tests.models.common import batch, config as gpt_config
from tests.moe.test_parallel import _run

H = 16


def _deepseek(**overrides) -> MoEConfig:
    base = dict(num_experts=8, ffn_hidden_size=8, topk=4, score_function="sigmoid", enable_expert_bias=True,
                routed_scaling_factor=2.5, num_groups=4, group_topk=2, init_method_std=0.5)
    return MoEConfig(**{**base, **overrides})


def test_router_equals_transformers_deepseek_v3_gate():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = _deepseek()
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=H, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.topk, n_group=cfg.num_groups,
        topk_group=cfg.group_topk, routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(hf_cfg)
    ours = TopKRouter(H, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        bias = torch.rand(cfg.num_experts, generator=gen) * 0.2
        theirs.e_score_correction_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
    tokens = torch.randn(64, H, generator=gen)
    _, weights, indices = theirs(tokens)
    routing = ours(tokens)
    order, our_order = indices.argsort(dim=-1), routing.indices.argsort(dim=-1)
    assert torch.equal(routing.indices.gather(1, our_order), indices.gather(1, order))
    torch.testing.assert_close(routing.probs.gather(1, our_order), weights.gather(1, order), rtol=1e-6, atol=1e-7)
    # The bias changed the choice of some tokens (else this test would not cover it), not the weights' source.
    without = TopKRouter(H, _deepseek(enable_expert_bias=False))
    with torch.no_grad():
        without.weight.copy_(ours.weight)
    assert not torch.equal(without(tokens).indices.sort(dim=-1).values, routing.indices.sort(dim=-1).values)


def test_group_limited_routing_stays_in_group_topk_groups():
    cfg = _deepseek(num_experts=16, num_groups=8, group_topk=2, topk=4)
    routing = TopKRouter(H, cfg)(torch.randn(128, H, generator=torch.Generator().manual_seed(1)))
    groups = routing.indices // (cfg.num_experts // cfg.num_groups)
    assert max(len(set(row.tolist())) for row in groups) <= cfg.group_topk
    torch.testing.assert_close(routing.probs.sum(dim=-1), torch.full((128,), 2.5))


def test_expert_bias_balances_a_skewed_batch_without_aux_loss():
    cfg = _deepseek(num_groups=None, group_topk=None, topk=2, bias_update_rate=0.01, aux_loss_coeff=0.0)
    torch.manual_seed(0)
    router = TopKRouter(H, cfg)
    # Tokens lean toward experts 0 and 1, so those two win most of them.
    lean = 0.3 * (router.weight[0] + router.weight[1]).detach()
    tokens = torch.randn(512, H, generator=torch.Generator().manual_seed(2)) * 0.5 + lean

    def imbalance():
        router.eval()  # an evaluation forward counts nothing
        counts = torch.tensor(router(tokens).tokens_per_expert, dtype=torch.float)
        router.train()
        return float(counts.max() / counts.mean())

    assert imbalance() > 2.0, "the batch is not skewed"
    for _ in range(30):  # steps: route the batch (training mode counts it), then move the bias
        router(tokens)
        update_expert_bias([router])
    assert imbalance() < 1.2
    assert router.weight.grad is None and not router.expert_bias.requires_grad


def test_expert_bias_is_saved_in_checkpoints_and_not_a_parameter(tmp_path):
    from megalite.checkpoint import load_model, load_sharded, save_sharded

    cfg = gpt_config("llama", moe=_deepseek(ffn_hidden_size=16, num_groups=2, group_topk=2))
    model = GPTModel(cfg)
    name = "decoder.layers.0.mlp.router.expert_bias"
    assert name not in dict(model.named_parameters())
    assert "decoder.layers.0.mlp.router.tokens_since_update" not in model.state_dict()
    with torch.no_grad():
        model.get_buffer(name).copy_(torch.arange(8.0) / 10)
    save_sharded(str(tmp_path / "ckpt"), 1, [model])
    target = GPTModel(cfg)
    assert not target.get_buffer(name).any()
    load_sharded(str(tmp_path / "ckpt"), [target])
    assert torch.equal(target.get_buffer(name), torch.arange(8.0) / 10)
    assert torch.equal(load_model(str(tmp_path / "ckpt")).get_buffer(name), torch.arange(8.0) / 10)


def _bias_over_data_parallel():
    """Each DP rank routes its own tokens; one update must use the counts of all of them."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(2, 64, H, generator=gen)
    torch.manual_seed(5)
    reference = TopKRouter(H, _deepseek())
    for part in tokens:
        reference(part)
    update_expert_bias([reference])
    topo = topology.initialize(ep=2)
    torch.manual_seed(5)
    router = TopKRouter(H, _deepseek())
    router(tokens[topo.dp.rank])
    update_expert_bias([router], topo.dp.group)
    return (router.expert_bias - reference.expert_bias).abs().max().item(), router.expert_bias.abs().sum().item()


def _two_ranks():
    """Both two-rank checks in one launch: the DP-summed bias update, then weight sync of the bias."""
    return _bias_over_data_parallel(), _weight_sync_rank()


def test_expert_bias_sums_counts_over_data_parallel_and_reaches_rollout_ranks():
    """One update uses every DP rank's counts; WeightSync sends the bias (a buffer) to a rollout rank."""
    (first, second) = run_distributed(_two_ranks, 2, timeout=180)
    for (error, moved), _ in (first, second):
        assert error == 0.0 and moved > 0
    assert first[1] == second[1] == [float(e) for e in range(8)]


def test_ep2_parity_with_sigmoid_group_limited_routing():
    _run(2, dict(ep=2), [
        dict(score_function="sigmoid", num_groups=2, group_topk=1, routed_scaling_factor=2.5, aux_loss_coeff=0.0,
             z_loss_coeff=0.0),
        dict(score_function="sigmoid", enable_expert_bias=True, topk=1, activation="swiglu", z_loss_coeff=0.0),
    ], bad_input=[
        (dict(score_function="sigmoid", num_groups=2, group_topk=3, topk=2), "group_topk 3 exceeds num_groups 2"),
        (dict(score_function="sigmoid", num_groups=3, group_topk=1, topk=1), "not divisible by num_groups 3"),
        (dict(score_function="sigmoid", num_groups=2, group_topk=1, topk=3), "fit in 1 groups of 2 experts"),
        (dict(enable_expert_bias=True), "need score_function 'sigmoid'"),
    ])


def test_gpt_with_dense_first_layer_and_shared_expert_trains_its_bias():
    moe = _deepseek(ffn_hidden_size=16, shared_expert_intermediate_size=16, activation="swiglu")
    model = GPTModel(gpt_config("mla", moe=moe, moe_layer_freq=[0, 1]))
    assert not model.decoder.layers["0"].is_moe and model.decoder.layers["1"].is_moe
    ids, labels = batch()
    model(ids, labels=labels).sum().backward()
    router = model.decoder.layers["1"].mlp.router
    assert router.tokens_since_update.sum() == ids.numel() * moe.topk
    update_expert_bias([model])
    assert router.expert_bias.abs().sum() > 0 and router.tokens_since_update.sum() == 0


DEEPSEEK_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
                  "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--position-embedding-type", "rope",
                  "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--rope-type", "yarn",
                  "--rotary-scaling-factor", "4", "--mscale", "1", "--mscale-all-dim", "1",
                  "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
                  "--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "16",
                  "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-router-bias-update-rate", "0.01", "--moe-router-topk-scaling-factor", "2.5",
                  "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]


def test_flags_give_the_deepseek_config():
    from megalite.training.flags import gpt_config as config_of, parse_args

    cfg = config_of(parse_args(DEEPSEEK_FLAGS + ["--vocab-size", "64"]))
    assert (cfg.multi_latent_attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
            cfg.v_head_dim, cfg.rope_scaling, cfg.rope_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (
        True, 16, 12, 8, 4, 8, "yarn", 4.0, 1.0, 1.0)
    moe = cfg.moe
    assert (moe.score_function, moe.enable_expert_bias, moe.bias_update_rate, moe.routed_scaling_factor,
            moe.num_groups, moe.group_topk, cfg.moe_layer_freq) == ("sigmoid", True, 0.01, 2.5, 2, 1, [0, 1])


@pytest.mark.slow
def test_pretrain_updates_the_expert_bias_each_step_and_saves_it(tiny_data, tmp_path):
    from megalite.checkpoint import load_model
    from tests.training.helpers import train

    iters = 3
    _, records = train(tiny_data, tmp_path, 2, *DEEPSEEK_FLAGS, "--expert-model-parallel-size", "2",
                       "--save", str(tmp_path / "ckpt"), "--save-interval", str(iters), iters=iters)
    assert len(records) == iters and all(r["loss"] == r["loss"] for r in records)
    bias = load_model(str(tmp_path / "ckpt")).get_buffer("decoder.layers.1.mlp.router.expert_bias")
    assert 0 < bias.abs().max() <= iters * 0.01 + 1e-7
    # The logged router statistics: layer 1 is the only MoE layer, so its loads are the per-expert totals, and the
    # last record's bias norm is that of the bias saved after the same step.
    last = records[-1]
    counts = torch.tensor([last[f"moe_tokens_expert_{e}"] for e in range(4)], dtype=torch.float64)
    assert last["moe_load_imbalance_layer_1"] == pytest.approx((counts.max() / counts.mean()).item(), rel=1e-12)
    assert "moe_load_imbalance_layer_0" not in last and "moe_expert_bias_norm_layer_0" not in last
    norm = torch.linalg.vector_norm(bias.double()).item()
    assert last["moe_expert_bias_norm_layer_1"] == pytest.approx(norm, rel=1e-6)
    assert last["moe_expert_bias_norm"] == pytest.approx(norm, rel=1e-6)


@pytest.mark.parametrize("extra, world, message", [
    (["--moe-router-group-topk", "3", "--moe-router-num-groups", "2"], 1, "group_topk 3 exceeds num_groups 2"),
    (["--moe-router-num-groups", "3"], 1, "num_experts 4 is not divisible by num_groups 3"),
    (["--expert-model-parallel-size", "2", "--num-experts", "6", "--moe-router-num-groups", "3",
      "--moe-router-group-topk", "1", "--moe-router-topk", "2"], 4, None),
    (["--expert-model-parallel-size", "4", "--num-experts", "6", "--moe-router-num-groups", "3"], 4,
     "num_experts 6 is not divisible by the expert-parallel size 4"),
])
def test_bad_routing_flags_are_one_error_before_training(extra, world, message):
    from megalite.training.arguments import validate_args
    from megalite.training.flags import parse_args

    argv = DEEPSEEK_FLAGS + ["--vocab-size", "64", "--num-layers", "2"] + extra
    if message is None:  # groups need not align with EP ranks to be valid
        args = validate_args(parse_args(argv), world)
        assert (args.expert_model_parallel_size, args.moe_router_num_groups) == (2, 3)
        return
    with pytest.raises(ValueError, match=message):
        validate_args(parse_args(argv), world)


def test_weight_export_carries_the_expert_bias_under_its_hugging_face_name():
    """Rollout engines fed by the exporter route as the trainer does only if the bias travels with the weights."""
    from megalite.rlhf.export import export_global_weights, export_hf_weights

    model = GPTModel(gpt_config("mla", moe=_deepseek(ffn_hidden_size=16, shared_expert_intermediate_size=16,
                                                     activation="swiglu"), moe_layer_freq=[0, 1]))
    with torch.no_grad():
        model.get_buffer("decoder.layers.1.mlp.router.expert_bias").copy_(torch.arange(8.0))
    exported = dict(export_global_weights(model))
    assert torch.equal(exported["decoder.layers.1.mlp.router.expert_bias"], torch.arange(8.0))
    hf = dict(export_hf_weights(model))
    assert torch.equal(hf["model.layers.1.mlp.gate.e_score_correction_bias"], torch.arange(8.0))
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in hf and "model.layers.0.mlp.gate_proj.weight" in hf


def _weight_sync_rank():
    import torch.distributed as dist

    from megalite.rlhf.weight_sync import ROLLOUT, TRAINER, SyncRole, WeightSync

    cfg = gpt_config("mla", moe=_deepseek(ffn_hidden_size=16), moe_layer_freq=[0, 1])
    trainer = dist.get_rank() == 0
    model = GPTModel(cfg)
    name = "decoder.layers.1.mlp.router.expert_bias"
    if trainer:
        with torch.no_grad():
            model.get_buffer(name).copy_(torch.arange(8.0))
    role = SyncRole(TRAINER if trainer else ROLLOUT, 0, 0, 1)
    WeightSync(model, role, group=dist.new_group([0, 1])).sync()
    return model.get_buffer(name).tolist()
