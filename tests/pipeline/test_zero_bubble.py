"""Zero-bubble schedules: op tables from the paper's figures, analytic bubbles, GPT parity with one rank."""

import pytest
import torch

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel
from megalite.moe import MoEConfig, set_aux_loss_scale
from megalite.pipeline import StageMap, broadcast_from_last_stage, build_chunks, forward_backward, last_stage_rank
from megalite.pipeline.schedules import check_schedule
from megalite.pipeline.zero_bubble import simulate, zb_h1_order, zbv_order
from megalite.testing import run_distributed
from tests.pipeline.test_gpt_parity import HIDDEN, ITERS, LR, SEQ, VOCAB, _forward_step, _microbatches, _reference


def _ops(text):
    """'F0 B0 W0 f1' -> ops; capital letters are chunk 0, lower case chunk 1."""
    return [(word[0].upper(), int(word[1:]), 0 if word[0].isupper() else 1) for word in text.split()]


# Qi et al. 2024, Figure 3 (ZB-H1, p=4, m=8): the first stage keeps no W pending, the last three.
ZB_H1_P4_M8 = [
    "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
    "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
    "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
    "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
]
# Section 6 (ZB-V), p=2, m=4: chunk 0 goes down the ranks, chunk 1 (lower case) back up.
ZBV_P2_M4 = [
    "F0 F1 F2 f0 b0 w0 f1 b1 w1 F3 B0 W0 f2 b2 w2 B1 W1 f3 b3 w3 B2 W2 B3 W3",
    "F0 f0 F1 f1 b0 w0 F2 B0 W0 f2 b1 w1 F3 B1 W1 f3 b2 w2 B2 b3 B3 W2 w3 W3",
]


def test_op_orders_equal_the_papers_tables():
    assert [zb_h1_order(4, r, 8) for r in range(4)] == [_ops(t) for t in ZB_H1_P4_M8]
    assert [zbv_order(2, r, 4) for r in range(2)] == [_ops(t) for t in ZBV_P2_M4]
    for pp, m in ((2, 1), (4, 3), (4, 9)):  # every op once, dependencies respected (simulate raises on a deadlock)
        for order, stage_of in ((zb_h1_order, lambda r, c: r), (zbv_order, StageMap(pp, 2, v_shape=True).stage)):
            orders = [order(pp, r, m) for r in range(pp)]
            chunks = 2 if order is zbv_order else 1
            assert all(sorted(o) == sorted((k, i, c) for k in "FBW" for i in range(m) for c in range(chunks))
                       for o in orders)
            simulate(orders, stage_of, {"F": 1, "B": 1, "W": 1})


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_simulated_bubble_equals_the_closed_form(pp, m):
    orders = [zb_h1_order(pp, r, m) for r in range(pp)]
    assert simulate(orders, lambda r, c: r, {"F": 1, "B": 1, "W": 1}) == pytest.approx((pp - 1) / (3 * m + pp - 1))
    zbv = simulate([zbv_order(pp, r, m) for r in range(pp)], StageMap(pp, 2, v_shape=True).stage,
                   {"F": 1, "B": 1, "W": 1})
    assert zbv < (pp - 1) / (3 * m + pp - 1)


@pytest.mark.parametrize("args, message", [
    (("gpipe", 2, 1, 4), "unknown pipeline schedule 'gpipe'; choose one of 1f1b, interleaved-1f1b"),
    (("zbv", 2, 1, 4), r"the zbv schedule runs 2 model chunk\(s\) per pipeline rank, got 1"),
    (("zero-bubble-h1", 4, 2, 8), r"the zero-bubble-h1 schedule runs 1 model chunk\(s\) per pipeline rank, got 2"),
    (("zbv", 1, 2, 4), "2 model chunks need a pipeline of more than one stage, got pp=1"),
    (("interleaved-1f1b", 2, 2, 3), "needs num_microbatches divisible by pp: 3 micro-batches, pp=2"),
])
def test_bad_schedules_raise_before_any_communication(args, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(*args)
    assert check_schedule(None, 2, 2, 3, forward_only=True) == "interleaved-1f1b"


REL = 1e-5


def _config(num_layers, recompute=None, moe=False):
    return GPTConfig(vocab_size=VOCAB, num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4,
                     max_position_embeddings=SEQ, make_vocab_size_divisible_by=1,
                     untie_embeddings_and_output_weights=True, recompute_granularity=recompute,
                     moe=MoEConfig(num_experts=4, ffn_hidden_size=32, topk=2, aux_loss_coeff=1e-2) if moe else None)


def _shard(full, name, param, topo):
    if ".experts." in name:
        first = topo.ep.rank * param.shape[0]
        full = full[first:first + param.shape[0]]
    if getattr(param, "tensor_model_parallel", False) and ".experts." not in name:
        return full.chunk(topo.tp.size, dim=param.partition_dim)[topo.tp.rank]
    return full


def _gpt(schedule, reference, tp=1, pp=2, ep=1, m=4, num_layers=4, recompute=None, moe=False):
    """ITERS SGD iterations under ``schedule``; the max relative loss and first-iteration grad errors."""
    config = _config(num_layers, recompute, moe)
    dp = torch.distributed.get_world_size() // (tp * pp)
    ref_losses, ref_grads = reference
    vpp = 2 if schedule == "zbv" else None
    topo = topology.initialize(tp=tp, pp=pp, vpp=vpp, ep=ep)
    chunks = []
    for model in build_chunks(lambda **where: GPTModel(config, **where), num_layers, topo.pp.group, vpp=vpp,
                              schedule=schedule):
        set_aux_loss_scale(model, 1.0 / m)
        chunks.append(DistributedDataParallel(model, DDPConfig(bucket_size=2000)))
    loss_err = grad_err = 0.0
    mine = _microbatches(0, dp * m)[topo.dp.rank * m:(topo.dp.rank + 1) * m]
    metrics = forward_backward(_forward_step, [iter(mine) for _ in chunks] if vpp else iter(mine),
                               chunks if vpp else chunks[0], m, forward_only=True, schedule=schedule)
    losses = broadcast_from_last_stage([mt["loss"].item() for mt in metrics], last_rank=last_stage_rank(pp, schedule))
    want = ref_losses[0][topo.dp.rank * m:(topo.dp.rank + 1) * m]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, want))  # forward-only first
    for it in range(ITERS):
        mine = _microbatches(it, dp * m)[topo.dp.rank * m:(topo.dp.rank + 1) * m]
        iterators = [iter(mine) for _ in chunks]
        metrics = forward_backward(_forward_step, iterators if vpp else iterators[0], chunks if vpp else chunks[0],
                                   m, finalize_grads_func=finalize_model_grads, schedule=schedule)
        losses = broadcast_from_last_stage([mt["loss"].item() for mt in metrics],
                                           last_rank=last_stage_rank(pp, schedule))
        want = ref_losses[it][topo.dp.rank * m:(topo.dp.rank + 1) * m]
        loss_err = max(loss_err, max(abs(a - b) / abs(b) for a, b in zip(losses, want)))
        with torch.no_grad():
            for chunk in chunks:
                for name, p in chunk.module.named_parameters():
                    if it == 0:
                        ref = _shard(ref_grads[name], name, p, topo)
                        grad_err = max(grad_err, ((p.main_grad - ref).norm() / ref.norm().clamp_min(1e-12)).item())
                    p -= LR * p.main_grad
                chunk.zero_grad_buffer()
    return loss_err, grad_err


def _run_cases(cases):
    """Single-rank references first (before any topology exists, so they are built unsharded), then each case."""
    world = torch.distributed.get_world_size()
    references = {}
    for name, kwargs in cases.items():
        tp, pp, m = kwargs.get("tp", 1), kwargs.get("pp", 2), kwargs.get("m", 4)
        config = _config(kwargs.get("num_layers", 4), kwargs.get("recompute"), kwargs.get("moe", False))
        references[name] = _reference(config, world // (tp * pp) * m)
    return {name: _gpt(reference=references[name], **kwargs) for name, kwargs in cases.items()}


def _two_ranks():
    """pp2 with full recompute: W closures capture tensors of the graph recomputed during B."""
    return _run_cases({f"{s}-recompute": dict(schedule=s, recompute="full") for s in ("zero-bubble-h1", "zbv")})


def _four_ranks():
    cases = {}
    for schedule in ("zero-bubble-h1", "zbv"):
        zbv = schedule == "zbv"
        cases[f"pp4-{schedule}"] = dict(schedule=schedule, pp=4, m=8 if zbv else 4, num_layers=8 if zbv else 4)
        cases[f"tp2pp2-{schedule}"] = dict(schedule=schedule, tp=2)
        cases[f"ep2dp2pp2-moe-{schedule}"] = dict(schedule=schedule, ep=2, moe=True)
    return _run_cases(cases)


@pytest.mark.parametrize("world, fn", [(2, _two_ranks), (4, _four_ranks)], ids=["pp2-recompute", "pp4-tp2-ep2"])
def test_gpt_matches_single_rank(world, fn):
    for rank, cases in enumerate(run_distributed(fn, world, timeout=300)):
        for name, (loss_err, grad_err) in cases.items():
            assert loss_err <= REL and grad_err <= REL, (rank, name, loss_err, grad_err)
