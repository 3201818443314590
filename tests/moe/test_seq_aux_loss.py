"""DeepSeek-V3's sequence-wise balance loss (``load_balancing_type="seq_aux_loss"``).

Checked element-wise against Megatron-Core's own ``TopKRouter`` with
``moe_router_load_balancing_type="seq_aux_loss"`` (loss value, combine weights and
the router weight's gradient), on one rank and with the sequences split over two
ranks (as sequence or context parallelism splits them), where both must equal the
one-rank computation; and through the MoE layer at tp=2 with and without
sequence parallelism, and at cp=2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import topology
from megalite.context_parallel import chunk_indices
from megalite.moe import MoEConfig, MoELayer, TopKRouter
from megalite.testing import run_distributed
from tests.moe.test_parallel import _run

S, B, H, E, TOPK, COEFF = 8, 3, 16, 8, 4, 0.01


def _config(**overrides) -> MoEConfig:
    base = dict(num_experts=E, ffn_hidden_size=8, topk=TOPK, score_function="sigmoid", num_groups=4, group_topk=2,
                routed_scaling_factor=2.5, aux_loss_coeff=COEFF, load_balancing_type="seq_aux_loss",
                init_method_std=0.5)
    return MoEConfig(**{**base, **overrides})


def _inputs():
    gen = torch.Generator().manual_seed(11)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, E, generator=gen)


def _ours(kind: str, rows: slice, group):
    """megalite's router on positions ``rows`` of every sequence: (aux value, dense weights, weight grad)."""
    x, g = _inputs()
    torch.manual_seed(3)
    router = TopKRouter(H, _config(load_balancing_type=kind))
    routing = router(x[rows].reshape(-1, H), [group] if group is not None else [], B)
    dense = torch.zeros(routing.probs.shape[0], E).scatter(1, routing.indices, routing.probs)
    ((dense * g[rows].reshape(-1, E)).sum() + routing.loss).backward()
    return routing.aux_loss, dense.detach(), router.weight.grad, router.weight.detach()


TRACKED = {"seq_aux_loss": "seq_load_balancing_loss", "aux_loss": "load_balancing_loss"}


def _megatron(kind: str, rows: slice, group, weight):
    """Megatron-Core's router on the same logits; its tp_cp group is ``group``."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)
    from megatron.core.transformer.moe.router import TopKRouter as MegatronRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = _config()
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                               moe_router_topk=TOPK, moe_router_load_balancing_type=kind,
                               moe_aux_loss_coeff=COEFF, moe_router_score_function="sigmoid",
                               moe_router_num_groups=cfg.num_groups, moe_router_group_topk=cfg.group_topk,
                               moe_router_topk_scaling_factor=cfg.routed_scaling_factor)
    router = MegatronRouter(config, pg_collection=SimpleNamespace(tp=group, cp=group, tp_cp=group, tp_dp_cp=group))
    router.set_layer_number(1)
    clear_aux_losses_tracker()
    x, g = _inputs()
    w = weight.clone().requires_grad_(True)
    probs, _ = router.routing(F.linear(x[rows], w))
    (probs * g[rows].reshape(-1, E)).sum().backward()
    value = get_moe_layer_wise_logging_tracker()[TRACKED[kind]]["values"][0].item()
    return value, probs.detach(), w.grad


def _compare_router(kind: str, megatron: bool) -> dict:
    """Max differences: each rank's half (and Megatron-Core, alone and split) against the one-rank router."""
    rank = dist.get_rank()
    alone = dist.new_group([0]), dist.new_group([1])
    whole, half = slice(0, S), slice(rank * S // 2, (rank + 1) * S // 2)
    value, dense, grad, weight = _ours(kind, whole, None)
    split_value, split_dense, split_grad, _ = _ours(kind, half, dist.group.WORLD)
    dist.all_reduce(split_grad)
    errors = {"value": abs(split_value - value),
              "probs": (split_dense - dense.view(S, B, E)[half].reshape(-1, E)).abs().max().item(),
              "grad": (split_grad - grad).abs().max().item()}
    if megatron:
        their_value, their_probs, their_grad = _megatron(kind, whole, alone[rank], weight)
        errors.update(mcore_value=abs(their_value - value), mcore_probs=(their_probs - dense).abs().max().item(),
                      mcore_grad=(their_grad - grad).abs().max().item())
        _, their_split_probs, their_split_grad = _megatron(kind, half, dist.group.WORLD, weight)
        dist.all_reduce(their_split_grad)
        errors.update(mcore_split_probs=(their_split_probs - split_dense).abs().max().item(),
                      mcore_split_grad=(their_split_grad - grad).abs().max().item())
    return {f"{kind}_{name}": error for name, error in errors.items()}, value, grad.abs().max().item()


def _two_ranks(megatron: bool):
    """The sequence-wise loss, the micro-batch loss (the same comparisons), then the layer at cp=2."""
    errors, value, grad = _compare_router("seq_aux_loss", megatron)
    batch_errors, batch_value, _ = _compare_router("aux_loss", megatron)
    errors.update(batch_errors)
    errors.update(_context_parallel_layer())
    return errors, value, batch_value, grad


def _context_parallel_layer():
    """The MoE layer at cp=2 (load-balanced chunks) against one rank: outputs, input and parameter gradients.

    As in training, each CP rank's objective is its share times the CP size and replicated gradients are averaged
    over CP, so the average equals the one-rank gradient, the balance loss's part included.
    """
    x, _ = _inputs()
    g = torch.randn(S, B, H, generator=torch.Generator().manual_seed(12))
    config = _config(num_groups=None, group_topk=None, ffn_hidden_size=8)
    torch.manual_seed(5)
    reference = MoELayer(H, config)
    whole = x.clone().requires_grad_(True)
    out = reference(whole)
    (out * g).sum().backward()
    direct = reference.router(x.reshape(-1, H), [], B).aux_loss  # the layer hands the router its B sequences
    topo = topology.initialize(cp=2)
    mine = chunk_indices(S, topo.cp.size, topo.cp.rank)
    torch.manual_seed(5)
    layer = MoELayer(H, config)
    part = x[mine].clone().requires_grad_(True)
    local = layer(part)
    (local * g[mine]).sum().mul(topo.cp.size).backward()
    errors = {"cp_out": _relative(local, out[mine]), "cp_dx": _relative(part.grad / topo.cp.size, whole.grad[mine]),
              "cp_aux": abs(layer.last_stats["aux_loss"] / reference.last_stats["aux_loss"] - 1),
              "layer_sequences": abs(reference.last_stats["aux_loss"] / direct - 1)}
    for (name, param), expected in zip(layer.named_parameters(), reference.parameters()):
        grad = param.grad.clone()
        dist.all_reduce(grad, group=topo.cp.group)
        errors[f"cp_{name}"] = _relative(grad / topo.cp.size, expected.grad)
    return errors


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude expected."""
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_balance_losses_equal_megatron_core_on_one_rank_and_split_over_two():
    """Both load-balancing types under group-limited sigmoid routing, where the experts the loss counts (the
    top-k by unbiased score) differ from the routed ones."""
    try:
        import megatron.core.transformer.moe.router  # noqa: F401
        megatron = True
    except ImportError:
        megatron = False
    for errors, value, batch_value, grad in run_distributed(_two_ranks, 2, megatron, timeout=180):
        assert max(errors.values()) <= 1e-6, errors
        # The loss is per sequence: the whole micro-batch as one sequence gives another value.
        assert value > 0 and grad > 0 and abs(value - batch_value) > 1e-3 * value
    if not megatron:
        pytest.skip("megatron-core is not installed: the two-rank parity ran, the Megatron-Core comparison did not")


def test_seq_aux_loss_through_the_moe_layer_at_tp2_with_and_without_sequence_parallelism():
    """Outputs, input and every parameter gradient (the router's carries the loss) equal the one-rank layer."""
    _run(2, dict(tp=2), [dict(load_balancing_type="seq_aux_loss"),
                         dict(load_balancing_type="seq_aux_loss", sequence_parallel=True),
                         dict(load_balancing_type="seq_aux_loss", score_function="sigmoid", num_groups=2,
                              group_topk=1, z_loss_coeff=0.0, sequence_parallel=True)],
         bad_input=[(dict(load_balancing_type="sinkhorn"), "load_balancing_type must be one of")])


def test_load_balancing_type_flag_sets_the_config():
    from megalite.training.flags import gpt_config, parse_args

    argv = ["--vocab-size", "64", "--num-experts", "4", "--moe-aux-loss-coeff", "0.001"]
    assert gpt_config(parse_args(argv)).moe.load_balancing_type == "aux_loss"
    moe = gpt_config(parse_args(argv + ["--moe-router-load-balancing-type", "seq_aux_loss"])).moe
    assert (moe.load_balancing_type, moe.aux_loss_coeff) == ("seq_aux_loss", 0.001)
