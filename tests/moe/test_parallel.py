"""Parity of the MoE layer under EP / ETP / TP / SP layouts with the single-rank layer.

Each rank builds the single-rank reference first (no topology yet, so no
groups), runs it on every data-parallel micro-batch and sums the losses; then
it builds the parallel layer from the same seed, runs its own micro-batch, and
compares its outputs, input gradients and (suitably reduced) parameter
gradients with the reference.
"""

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.moe import MoEConfig, MoELayer
from megalite.testing import run_distributed

TOL = 1e-5
S, B, H = 8, 2, 8


def _config(**overrides):
    base = dict(num_experts=4, ffn_hidden_size=8, topk=2, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                init_method_std=0.5)
    base.update(overrides)
    return MoEConfig(**base)


def _data(dp):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(dp, S, B, H, generator=gen)
    g = torch.randn(dp, S, B, H, generator=gen)
    return x, g


def _fc1_shard(full, etp_rank, etp, gated):
    """Rows of a full fc1 weight/bias [E, rows, ...] kept by ETP rank ``etp_rank``."""
    if gated:
        gate, up = full.chunk(2, dim=1)
        return torch.cat([_fc1_shard(gate, etp_rank, etp, False), _fc1_shard(up, etp_rank, etp, False)], dim=1)
    block = full.shape[1] // etp
    return full[:, etp_rank * block:(etp_rank + 1) * block]


def _reduce(t, group):
    t = t.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _reference(config, x_all, g_all):
    """Single-rank layer run on every micro-batch: (layer, outputs, input grads, per-micro-batch stats)."""
    torch.manual_seed(7)
    ref = MoELayer(H, config)
    _randomize_biases(ref)
    x = x_all.clone().requires_grad_(True)
    outs, stats = [], []
    for d in range(x_all.shape[0]):
        outs.append(ref(x[d]))
        stats.append(ref.last_stats)
    out = torch.stack(outs)
    (out * g_all).sum().backward()
    return ref, out.detach(), x.grad, stats


def _randomize_biases(layer):
    """Biases start at zero; give them values so that a bias added twice or lost shows up."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for param in (layer.experts.fc1_bias, layer.experts.fc2_bias):
            if param is not None:
                param.copy_(torch.randn(param.shape, generator=gen))


def _copy_biases(layer, ref, experts, etp_rank, etp, gated):
    with torch.no_grad():
        if layer.experts.fc1_bias is not None:
            layer.experts.fc1_bias.copy_(_fc1_shard(ref.experts.fc1_bias[experts], etp_rank, etp, gated))
            layer.experts.fc2_bias.copy_(ref.experts.fc2_bias[experts])


def _split_config(overrides):
    overrides = dict(overrides)
    sp = overrides.pop("sequence_parallel", False)
    overrides.pop("odd_tokens", None)
    return _config(**overrides), sp


def _config_data(overrides, dp):
    """``_data(dp)``, cut to 5 positions of one sequence under ``odd_tokens`` (a count TP does not divide)."""
    x, g = _data(dp)
    return (x[:, :5, :1], g[:, :5, :1]) if overrides.get("odd_tokens") else (x, g)


def _compare(layout, configs):
    """Return, per config, the max abs errors of every checked quantity on this rank."""
    dp_size = dist.get_world_size() // layout.get("tp", 1)
    references = [_reference(_split_config(c)[0], *_config_data(c, dp_size)) for c in configs]
    topo = topology.initialize(**layout)
    results = []
    for overrides, (ref, ref_out, ref_dx, ref_stats) in zip(configs, references):
        config, sp = _split_config(overrides)
        x_all, g_all = _config_data(overrides, dp_size)
        torch.manual_seed(7)
        layer = MoELayer(H, config, sequence_parallel=sp)
        num_local = config.num_experts // topo.ep.size
        experts = slice(topo.ep.rank * num_local, (topo.ep.rank + 1) * num_local)
        etp, etp_rank = topo.expert_tp.size, topo.expert_tp.rank
        gated = config.activation == "swiglu"
        _copy_biases(layer, ref, experts, etp_rank, etp, gated)
        d = topo.dp.rank
        x, g, ref_o, ref_gx = x_all[d], g_all[d], ref_out[d], ref_dx[d]
        if sp:
            block = S // topo.tp.size
            rows = slice(topo.tp.rank * block, (topo.tp.rank + 1) * block)
            x, g, ref_o, ref_gx = x[rows], g[rows], ref_o[rows], ref_gx[rows]
        x = x.clone().requires_grad_(True)
        out = layer(x)
        (out * g).sum().backward()

        errors = {"out": (out - ref_o).abs().max().item(), "dx": (x.grad - ref_gx).abs().max().item(),
                  "aux": abs(layer.last_stats["aux_loss"] - ref_stats[d]["aux_loss"]),
                  "z": abs(layer.last_stats["z_loss"] - ref_stats[d]["z_loss"]),
                  "counts": float(layer.last_stats["tokens_per_expert"] != ref_stats[d]["tokens_per_expert"])}
        router_grad = _reduce(layer.router.weight.grad, topo.dp.group)
        if getattr(layer.router.weight, "sequence_parallel", False):
            router_grad = _reduce(router_grad, topo.tp.group)
        errors["router"] = (router_grad - ref.router.weight.grad).abs().max().item()

        for name, param in layer.experts.named_parameters():
            assert param.expert_parallel
            full = getattr(ref.experts, name).grad[experts]
            if name.startswith("fc1"):
                expected = _fc1_shard(full, etp_rank, etp, gated)
            elif name == "fc2_weight":
                block = full.shape[2] // etp
                expected = full[:, :, etp_rank * block:(etp_rank + 1) * block]
            else:
                expected = full
            grad = _reduce(param.grad, topo.expert_dp.group)
            errors[name] = (grad - expected).abs().max().item()
        results.append(errors)
    return results


def _dispatchers_agree(overrides):
    """Max difference between the alltoall and allgather layers' outputs and gradients on this rank."""
    config, sp = _split_config(overrides)
    x_all, g_all = _data(topology.current().dp.size)
    x, g = x_all[topology.current().dp.rank], g_all[topology.current().dp.rank]
    results = []
    for dispatcher in ("alltoall", "allgather"):
        config.dispatcher = dispatcher
        torch.manual_seed(7)
        layer = MoELayer(H, config, sequence_parallel=sp)
        _randomize_biases(layer)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out * g).sum().backward()
        results.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*results))


def _suite(layout, configs, agree, bad_input):
    """Parity errors for ``configs``; then dispatcher agreement and bad-input checks on the same ranks."""
    errors = _compare(layout, configs)
    disagreement = [_dispatchers_agree(c) for c in agree]
    for overrides, message in bad_input:
        with pytest.raises(ValueError, match=message):
            MoELayer(H, _config(**overrides))
    return errors, disagreement


def _run(world, layout, configs, agree=(), bad_input=(), timeout=180):
    per_rank = run_distributed(_suite, world, layout, configs, list(agree), list(bad_input), timeout=timeout)
    for rank, (results, disagreement) in enumerate(per_rank):
        for overrides, errors in zip(configs, results):
            worst = max(errors.values())
            assert worst <= TOL, f"rank {rank} layout {layout} config {overrides}: {errors}"
        for overrides, diff in zip(agree, disagreement):
            assert diff <= TOL, f"rank {rank} layout {layout}: dispatchers differ by {diff} for {overrides}"


def test_ep2_variants():
    _run(2, dict(ep=2), [
        dict(),
        dict(dispatcher="allgather"),
        dict(activation="swiglu", add_bias=True, grouped_gemm=True),
        dict(activation="gelu_tanh", add_bias=True, pre_softmax=True, topk=1),
        dict(activation="swiglu", pre_softmax=True),
        dict(capacity_factor=1.0, token_drop_policy="probs"),
        dict(capacity_factor=0.75, token_drop_policy="position", dispatcher="allgather"),
    ], bad_input=[(dict(num_experts=3), "num_experts 3 is not divisible by the expert-parallel size 2"),
                  (dict(topk=5), "topk 5 exceeds num_experts 4")])


def test_ep4_and_dispatchers_agree():
    _run(4, dict(ep=4), [dict(), dict(num_experts=8, dispatcher="allgather", grouped_gemm=True)],
         agree=[dict(num_experts=8, add_bias=True), dict(capacity_factor=1.0)])


def test_ep2_with_expert_data_parallel():
    _run(4, dict(ep=2), [dict(add_bias=True), dict(dispatcher="allgather", activation="swiglu")])


def test_ep2_times_tp2_expert_tensor_parallel():
    _run(4, dict(tp=2, ep=2), [
        dict(),
        dict(sequence_parallel=True),
        dict(dispatcher="allgather", sequence_parallel=True, activation="swiglu", add_bias=True,
             grouped_gemm=True),
    ], agree=[dict(add_bias=True, activation="swiglu")],
        bad_input=[(dict(ffn_hidden_size=7), "ffn_hidden_size 7 is not divisible by the expert tensor-parallel "
                                             "size 2")])


def test_ep2_over_tp2_without_expert_tp():
    """``odd_tokens``: 5 tokens, which the layer pads to split over TP (the inference engine packs any count)."""
    _run(4, dict(tp=2, ep=2, etp=1), [dict(add_bias=True), dict(sequence_parallel=True, dispatcher="allgather"),
                                      dict(odd_tokens=True, activation="swiglu")])
