"""A small MoE GPT under expert/tensor/data parallel layouts against the same model on one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import topology
from megalite.models import GPTConfig, GPTModel
from megalite.moe import MoEConfig
from megalite.optim.clip_grads import clip_grad_norm
from megalite.testing import run_distributed
from tests.models.common import full_to_shard

VOCAB, TOL = 64, 1e-5
WORLD = 4


def _config(kind: str) -> GPTConfig:
    """``qwen``: Qwen2-MoE's routing (top-k of the full softmax, a gated shared expert), MoE on layer 1 only."""
    gated = kind in ("llama", "qwen")
    moe = MoEConfig(num_experts=4, ffn_hidden_size=16, topk=2, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                    activation="swiglu" if gated else "gelu", grouped_gemm=kind == "llama",
                    add_bias=kind == "gpt2", pre_softmax=kind == "qwen",
                    shared_expert_intermediate_size=24 if kind == "qwen" else None, shared_expert_gate=kind == "qwen")
    freq = {"llama": 1, "gpt2": 2, "qwen": [0, 1]}[kind]
    base = dict(vocab_size=VOCAB, num_layers=2, hidden_size=16, num_attention_heads=4, max_position_embeddings=16,
                make_vocab_size_divisible_by=8, moe=moe, moe_layer_freq=freq)
    if gated:
        base.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                    add_bias_linear=False, ffn_hidden_size=32)
    return GPTConfig(**base)


def _batch(d: int):
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(100 + d))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _reference(kind: str, dp: int):
    """One-rank model run on every data-parallel micro-batch; losses summed before backward."""
    model = GPTModel(_config(kind))
    losses = [model(*_batch(d)[:1], labels=_batch(d)[1]) for d in range(dp)]
    torch.stack(losses).sum().backward()
    norm = torch.stack([p.grad.square().sum() for p in model.parameters()]).sum().sqrt().item()
    return {n: (p.detach(), p.grad) for n, p in model.named_parameters()}, [loss.detach() for loss in losses], norm


def _expert_shard(name, full, topo, cfg):
    num_local = cfg.moe.num_experts // topo.ep.size
    full = full[topo.ep.rank * num_local:(topo.ep.rank + 1) * num_local]
    etp, rank = topo.expert_tp.size, topo.expert_tp.rank
    if name.endswith("fc1_weight") or name.endswith("fc1_bias"):
        if cfg.moe.activation == "swiglu":
            gate, up = full.chunk(2, dim=1)
            return torch.cat([gate.chunk(etp, dim=1)[rank], up.chunk(etp, dim=1)[rank]], dim=1)
        return full.chunk(etp, dim=1)[rank]
    if name.endswith("fc2_weight"):
        return full.chunk(etp, dim=2)[rank]
    return full


def _all_reduce(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _check(cases):
    """cases: (kind, layout, sequence_parallel); returns the worst error per case and quantity.

    Gradients are reduced as DDP would (summed over the data-parallel or expert-data-parallel
    group); their global norm from the gradient clipper must match the one-rank norm.
    """
    references = {(kind, WORLD // layout.get("tp", 1)): None for kind, layout, _ in cases}
    for key in references:
        references[key] = _reference(*key)
    report = []
    for kind, layout, sp in cases:
        cfg = _config(kind)
        topo = topology.initialize(**layout)
        ref_params, ref_losses, ref_norm = references[(kind, topo.dp.size)]
        model = GPTModel(cfg, sequence_parallel=sp)
        ids, labels = _batch(topo.dp.rank)
        loss = model(ids, labels=labels)
        loss.sum().backward()
        errors = {"loss": (loss - ref_losses[topo.dp.rank]).abs().max().item()}
        for name, param in model.named_parameters():
            ref_weight, ref_grad = ref_params[name]
            if getattr(param, "expert_parallel", False):
                weight = _expert_shard(name, ref_weight, topo, cfg)
                expected = _expert_shard(name, ref_grad, topo, cfg)
                grad = _all_reduce(param.grad, topo.expert_dp.group)
            else:
                weight = full_to_shard(name, ref_weight, param, cfg, topo.tp.rank, topo.tp.size)
                expected = full_to_shard(name, ref_grad, param, cfg, topo.tp.rank, topo.tp.size)
                grad = _all_reduce(param.grad, topo.dp.group)
                if getattr(param, "sequence_parallel", False):
                    grad = _all_reduce(grad, topo.tp.group)
            errors[f"weight {name}"] = (param.detach() - weight).abs().max().item()
            errors[f"grad {name}"] = (grad - expected).abs().max().item()
            param.grad = grad
        errors["grad norm"] = abs(clip_grad_norm(list(model.parameters()), max_norm=1e9) - ref_norm)
        report.append(errors)
    return report


def test_moe_gpt_matches_single_rank():
    cases = [("gpt2", dict(ep=2), False),
             ("llama", dict(ep=4), False),
             ("gpt2", dict(tp=2, ep=2), False),
             ("llama", dict(tp=2, ep=2), True),
             ("qwen", dict(ep=2), False),
             ("qwen", dict(tp=2, ep=2), False),
             ("qwen", dict(tp=2, ep=2), True)]
    per_rank = run_distributed(_check, WORLD, cases, timeout=240)
    for rank, report in enumerate(per_rank):
        for case, errors in zip(cases, report):
            name, worst = max(errors.items(), key=lambda item: item[1])
            assert worst <= TOL, f"rank {rank} {case}: {name} off by {worst}"
