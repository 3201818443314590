"""Trainer -> rollout weight sync: after a sync every rollout rank's weights equal the trainer's bit for bit
(tp2 x pp2 -> tp1 with a tied embedding, tp1 -> tp2 and tp2 -> tp2 with SwiGLU, and two trainer DP replicas
feeding three rollout replicas), and each rollout rank receives exactly its shard's bytes.  An adapter-only sync
(LoRA, tp2 x pp2 -> tp1 and tp1 -> tp2 with SwiGLU) moves exactly the adapters and leaves the base alone."""

import zlib

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint.sharding import ShardContext
from megalite.lora import LoRAConfig, apply_lora
from megalite.lora.state import adapter_layouts, load_global_adapters, local_shard
from megalite.models import GPTModel
from megalite.pipeline import split_layers
from megalite.rlhf.weight_sync import ROLLOUT, TRAINER, SyncRole, WeightSync, build_plan
from megalite.testing import run_distributed
from tests.models.common import full_to_shard
from tests.rlhf.common import config

# name: (config kind, trainer tp, trainer pp, trainer dp, rollout tp, rollout replicas)
SCENARIOS = {"tp2pp2->tp1": ("gpt2", 2, 2, 1, 1, 1), "tp1->tp2": ("llama", 1, 1, 1, 2, 1),
             "tp2->tp2": ("llama", 2, 1, 1, 2, 1), "dp2->3 replicas": ("gpt2", 1, 1, 2, 1, 3),
             "lora tp2pp2->tp1": ("llama", 2, 2, 1, 1, 1), "lora tp1->tp2": ("llama", 1, 1, 1, 2, 1)}
"""The ``lora`` scenarios sync the adapters of a LoRAModel hooked onto each side's model, nothing else."""


def _weights(cfg, replica):
    """The full (tp=1) weights trainer DP replica ``replica`` holds: a perturbed fresh model."""
    model = GPTModel(cfg)
    g = torch.Generator().manual_seed(1000 + replica)
    return {n: (p + 0.1 * torch.randn(p.shape, generator=g)).detach() for n, p in model.named_parameters()}


def _adapter_tensors(lora, ctx, replica):
    """The global adapters trainer DP replica ``replica`` holds: each drawn from a seed of its name and replica."""
    return {name: torch.randn(gp.shape, generator=torch.Generator().manual_seed(2000 + replica + zlib.crc32(
        name.encode()))) for name, _, gp in adapter_layouts(lora, ctx)}


def _lora_sync(model, role, group, bucket_numel, tdp):
    """Hook adapters onto ``model``; trainers set theirs, rollout ranks check theirs after one adapter-only sync
    (each receives exactly its adapter shards' bytes)."""
    lora = apply_lora(model, LoRAConfig(rank=2, alpha=4))
    ctx = ShardContext(role.tp_rank, role.tp_size)
    base = {n: p.detach().clone() for n, p in model.state_dict().items()}
    if role.side == TRAINER:
        load_global_adapters(lora, _adapter_tensors(lora, ctx, role.replica), ctx)
    sync = WeightSync(lora, role, group=group, bucket_numel=bucket_numel)
    sync.sync()
    assert all(torch.equal(base[n], p) for n, p in model.state_dict().items())  # the base is not touched
    if role.side == ROLLOUT:
        want = _adapter_tensors(lora, ctx, role.replica % tdp)
        for name, param, _ in adapter_layouts(lora, ctx):
            assert torch.equal(param, local_shard(lora, name, want[name], ctx)), name
        assert sync.bytes_received == sync.expected_bytes_received == sum(p.numel() * 4 for p in lora.parameters())
    return {"sent": sync.bytes_sent, "received": sync.bytes_received}


def _real_rows(name, cfg, rank, tp, rows):
    """Rows of this TP rank's vocabulary shard that are real tokens (not padding)."""
    if "word_embeddings" not in name and "output_layer" not in name:
        return rows
    return max(0, min(rows, cfg.vocab_size - rank * rows))


def _scenario(name, bucket_numel):
    kind, ttp, tpp, tdp, rtp, replicas = SCENARIOS[name]
    cfg = config(kind, num_layers=2)
    trainers, rollouts = ttp * tpp * tdp, rtp * replicas
    me = dist.get_rank()
    tp_groups = [list(range(s, s + ttp)) for s in range(0, trainers, ttp)]
    tp_groups += [list(range(trainers + s, trainers + s + rtp)) for s in range(0, rollouts, rtp)]
    made = {tuple(r): dist.new_group(r) for r in tp_groups}
    group = dist.new_group(list(range(trainers + rollouts)))
    if me >= trainers + rollouts:
        return None
    if me < trainers:
        tp_rank, dp_rank, pp_rank = me % ttp, me // ttp % tdp, me // (ttp * tdp)
        tp_group = made[tuple(range(me - tp_rank, me - tp_rank + ttp))]
        start, end = split_layers(cfg.num_layers, tpp)[pp_rank][0]
        model = GPTModel(cfg, pre_process=pp_rank == 0, post_process=pp_rank == tpp - 1, layer_range=(start, end),
                         tp_group=tp_group)
        full = _weights(cfg, dp_rank)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                source = full["embedding.word_embeddings.weight" if pname == "output_layer.weight" else pname]
                param.copy_(full_to_shard(pname, source, param, cfg, tp_rank, ttp))
        role = SyncRole(TRAINER, dp_rank, tp_rank, ttp)
    else:
        local = me - trainers
        tp_rank, replica = local % rtp, local // rtp
        tp_group = made[tuple(range(me - tp_rank, me - tp_rank + rtp))]
        model = GPTModel(config(kind, num_layers=2, seed=55), tp_group=tp_group)
        role = SyncRole(ROLLOUT, replica, tp_rank, rtp)
    if name.startswith("lora"):
        return _lora_sync(model, role, group, bucket_numel, tdp)
    sync = WeightSync(model, role, group=group, bucket_numel=bucket_numel)
    if role.side == ROLLOUT:
        want = _weights(cfg, role.replica % tdp)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sync.sync()
    if role.side == TRAINER:
        return {"sent": sync.bytes_sent, "received": sync.bytes_received}
    expected_bytes = 0
    for pname, param in model.named_parameters():
        shard = full_to_shard(pname, want[pname], param, cfg, tp_rank, rtp)
        rows = _real_rows(pname, cfg, tp_rank, rtp, param.shape[0])
        assert torch.equal(param[:rows], shard[:rows]), (name, pname)
        assert not torch.equal(before[pname][:rows], shard[:rows]), (name, pname)
        assert torch.equal(param[rows:], before[pname][rows:]), (name, pname)
        expected_bytes += param[:rows].numel() * param.element_size()
    assert sync.bytes_received == sync.expected_bytes_received == expected_bytes
    return {"sent": sync.bytes_sent, "received": sync.bytes_received}


def _rank():
    results = {}
    for index, name in enumerate(SCENARIOS):
        results[name] = _scenario(name, 64 if index % 2 else 1 << 20)
    return results


def test_weight_sync_is_bit_exact_and_counts_bytes():
    results = run_distributed(_rank, 5, timeout=180)
    for name in SCENARIOS:
        per_rank = [r[name] for r in results if r[name] is not None]
        assert sum(r["sent"] for r in per_rank) == sum(r["received"] for r in per_rank) > 0


def test_plan_errors_are_clear():
    with pytest.raises(ValueError, match="needs trainer and rollout ranks, got 1 trainer and 0 rollout"):
        build_plan([{"role": SyncRole(TRAINER, 0, 0, 1), "params": {}}, None])
    with pytest.raises(ValueError, match="tp_rank 2 is outside a TP group of size 2"):
        SyncRole(ROLLOUT, 0, 2, 2)
