"""Group-limited (DeepSeek-V3) routing at ep=4: parity with one rank, and groups aligned to EP ranks.

With ``num_experts / num_groups == num_experts / ep`` each expert group lives on one EP rank, so choosing
``group_topk`` groups bounds the ranks a token's all-to-all reaches by ``group_topk``.  The layer's parity
(outputs, input and every parameter gradient) and the dispatch count run in one four-rank launch; a
training run over 8 iterations compares losses and gradient norms with the one-rank run.
"""

from __future__ import annotations

import pytest
import torch

from megalite import topology
from megalite.moe import MoEConfig, MoELayer
from megalite.testing import run_distributed
from tests.moe.test_parallel import TOL, _compare

EP, EXPERTS, GROUPS, GROUP_TOPK, TOPK, H = 4, 8, 4, 2, 4, 8
ROUTING = dict(num_experts=EXPERTS, topk=TOPK, score_function="sigmoid", num_groups=GROUPS, group_topk=GROUP_TOPK,
               routed_scaling_factor=2.5, aux_loss_coeff=0.0, z_loss_coeff=0.0)


def _dispatched_ranks(grouped: bool):
    """Per token, the EP ranks its rows were sent to, read from what the dispatcher was given and sent."""
    overrides = ROUTING if grouped else {**ROUTING, "num_groups": None, "group_topk": None}
    torch.manual_seed(7)
    layer = MoELayer(H, MoEConfig(**{**overrides, "ffn_hidden_size": 8, "init_method_std": 0.5}))
    dispatcher, seen = layer.dispatcher, {}
    original = dispatcher.dispatch

    def spy(tokens, probs, indices):
        rows, counts, plan = original(tokens, probs, indices)
        seen.update(indices=indices.clone(), sent=list(plan.send_splits))
        return rows, counts, plan

    dispatcher.dispatch = spy
    x = torch.randn(16, 4, H, generator=torch.Generator().manual_seed(topology.current().ep.rank))
    layer(x)
    ranks = seen["indices"] // dispatcher.num_local
    per_rank = (ranks.unsqueeze(-1) == torch.arange(EP)).any(1).sum(0).tolist()
    assert per_rank == seen["sent"], "the all-to-all does not send one row per (token, destination rank)"
    return max(len(set(row.tolist())) for row in ranks)


BAD_INPUT = [  # the list: experts not divisible by the groups, or by EP; more group top-k than groups
    (dict(ROUTING, num_experts=6, num_groups=2, group_topk=1, topk=2), "num_experts 6 is not divisible by the "
                                                                        "expert-parallel size 4"),
    (dict(ROUTING, num_groups=3, group_topk=1, topk=2), "num_experts 8 is not divisible by num_groups 3"),
    (dict(ROUTING, group_topk=5), "group_topk 5 exceeds num_groups 4"),
]


def _ep4():
    errors = _compare(dict(ep=EP), [dict(ROUTING), dict(ROUTING, enable_expert_bias=True, activation="swiglu",
                                                         dispatcher="allgather")])
    for overrides, message in BAD_INPUT:
        with pytest.raises(ValueError, match=message):
            MoELayer(H, MoEConfig(**{**overrides, "ffn_hidden_size": 8}))
    return errors, _dispatched_ranks(True), _dispatched_ranks(False)


def test_ep4_group_limited_layer_matches_one_rank_and_reaches_at_most_group_topk_ranks():
    for rank, (errors, grouped, ungrouped) in enumerate(run_distributed(_ep4, EP, timeout=180)):
        for per_config in errors:
            assert max(per_config.values()) <= TOL, f"rank {rank}: {per_config}"
        assert grouped == GROUP_TOPK, f"rank {rank}: a token reached {grouped} EP ranks"
        assert ungrouped > GROUP_TOPK, "without groups some token should reach more ranks (else this proves nothing)"


FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--num-experts", str(EXPERTS), "--moe-ffn-hidden-size", "16", "--moe-router-topk", str(TOPK),
         "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
         "--moe-router-bias-update-rate", "0.01", "--moe-router-topk-scaling-factor", "2.5",
         "--moe-router-num-groups", str(GROUPS), "--moe-router-group-topk", str(GROUP_TOPK),
         "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"]


@pytest.mark.slow
def test_ep4_group_limited_training_matches_one_rank(tiny_data, tmp_path):
    """8 iterations, fp32: losses and gradient norms per iteration, with the expert bias and seq aux loss on."""
    from tests.training.helpers import train

    _, reference = train(tiny_data, tmp_path / "one", 1, *FLAGS, iters=8)
    _, got = train(tiny_data, tmp_path / "ep4", EP, *FLAGS, "--expert-model-parallel-size", str(EP), iters=8)
    assert [r["iteration"] for r in got] == list(range(1, 9))
    assert reference[-1]["moe_expert_bias_norm"] > 0
    for ref, mine in zip(reference, got):
        # (The logged aux loss and loads are the last micro-batch's: one of four here, all four's sum at ep=4.)
        for key in ("loss", "grad_norm", "moe_expert_bias_norm"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-5), (ref["iteration"], key)


def _sent_bytes():
    """(bytes in the hidden-state all-to-all to other ranks, last_bytes_sent, distinct (token, other rank) pairs,
    tokens) for one forward of a group-limited layer, read from the collective's own arguments."""
    from megalite.moe import dispatcher as module

    topology.initialize(ep=EP)
    torch.manual_seed(7)
    layer = MoELayer(H, MoEConfig(**ROUTING, ffn_hidden_size=8, init_method_std=0.5))
    rank, calls, original = topology.current().ep.rank, [], module.all_to_all

    def spy(x, group, output_splits, input_splits):
        calls.append((x, list(input_splits)))
        return original(x, group, output_splits, input_splits)

    x = torch.randn(32, 2, H, generator=torch.Generator().manual_seed(rank))
    module.all_to_all = spy
    try:
        layer(x)
    finally:
        module.all_to_all = original
    hidden = [(t, splits) for t, splits in calls if t.is_floating_point() and t.shape[1:] == (H,)]
    t, splits = hidden[0]
    payload = (sum(splits) - splits[rank]) * H * t.element_size()
    ranks = layer.router(x.view(-1, H)).indices // layer.dispatcher.num_local
    pairs = sum(len(set(row.tolist()) - {rank}) for row in ranks)
    return payload, layer.dispatcher.last_bytes_sent, pairs, ranks.shape[0]


def test_ep4_group_limited_sends_each_token_once_per_destination_rank():
    """DeepEP's volume: a token goes once to each other EP rank holding one of its experts, so a rank sends
    exactly (distinct (token, other rank) pairs) x h x 4 bytes, within T x group_topk x h x 4.  Here each
    token's top-4 fills both of its groups (2 experts each), so one row per expert would send twice that."""
    for rank, (payload, reported, pairs, tokens) in enumerate(run_distributed(_sent_bytes, EP, timeout=120)):
        assert payload == pairs * H * 4, f"rank {rank}: sent {payload} bytes for {pairs} (token, rank) pairs"
        assert reported == payload, f"rank {rank}: last_bytes_sent {reported} != the all-to-all's {payload}"
        assert 0 < payload <= tokens * GROUP_TOPK * H * 4, f"rank {rank}: {payload} bytes"


def test_ranks_per_token_is_the_mean_over_every_expert_set():
    """The planner's expected EP ranks per token under uniform routing equals the average over all C(E, k) expert
    sets, enumerated; group-limited routing caps it at group_topk."""
    from itertools import combinations

    from megalite.moe.dispatcher import ranks_per_token

    for experts, topk, ep in ((8, 2, 4), (16, 4, 4), (4, 3, 2), (8, 1, 2)):
        sets = list(combinations(range(experts), topk))
        mean = sum(len({e // (experts // ep) for e in chosen}) for chosen in sets) / len(sets)
        assert ranks_per_token(experts, topk, ep) == pytest.approx(mean, rel=1e-12), (experts, topk, ep)
    assert ranks_per_token(EXPERTS, TOPK, EP, GROUP_TOPK) == GROUP_TOPK
