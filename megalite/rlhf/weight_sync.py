"""Trainer -> rollout weight sync over torch.distributed, resharding TP/PP to the rollout TP layout.

Trainer ranks hold a TP x PP (x DP) sharded GPT; rollout ranks hold the same
GPT sharded over their own TP size (no PP).  A sync of a :class:`megalite.lora.LoRAModel` (a ``--lora-rank``
run, after one sync of the base) moves its adapters only: the rollout model carries the same adapters,
hooked onto its layers, so the engine applies them unmerged.  Both sides describe their
parameters with the checkpoint's shard layout (:func:`checkpoint.sharding.global_param`:
where each local box lies in the layout-free global tensor), exchange those
descriptions once, and every rank derives the same plan: for each rollout
rank, which trainer rank sends which box of which tensor.  Rollout replica j
reads from trainer DP replica ``j % trainer_dp``; TP-replicated tensors come
from trainer TP rank 0, a tied output layer is never sent (the embedding is).

A sync packs each (sender, receiver) pair's boxes, in plan order, into flat
buckets of whole boxes of at most ``bucket_numel`` elements (a larger box goes
alone) and moves them with send/recv, pairs in one global order, so no rank
waits on another in a cycle.  Each rollout rank receives exactly its shard of
the global tensors once (vocabulary padding excluded); ``bytes_sent`` and
``bytes_received`` count what each rank moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.checkpoint.sharding import ShardContext, box_slices, global_param, intersect
from megalite.distributed.unwrap import unwrap
from megalite.lora import LoRAModel
from megalite.lora.state import adapter_layouts

TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass(frozen=True)
class SyncRole:
    """This rank's place: ``side`` (trainer or rollout), its model ``replica`` (trainer DP rank or rollout
    replica index) and its TP rank and size."""

    side: str
    replica: int
    tp_rank: int
    tp_size: int

    def __post_init__(self):
        if self.side not in (TRAINER, ROLLOUT):
            raise ValueError(f"sync side must be {TRAINER!r} or {ROLLOUT!r}, got {self.side!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside a TP group of size {self.tp_size}")


@dataclass(frozen=True)
class Transfer:
    """Box ``src_box`` of the sender's ``src_param`` goes to box ``dst_box`` of the receiver's ``dst_param``."""

    src: int
    dst: int
    src_param: str
    dst_param: str
    src_box: tuple
    dst_box: tuple

    @property
    def numel(self) -> int:
        count = 1
        for lo, hi in self.dst_box:
            count *= hi - lo
        return count


def _tensors(model, ctx: ShardContext) -> dict:
    """``{local name: (tensor, GlobalParam)}`` of what a sync of ``model`` moves: a GPT chunk's state dict (with
    persistent buffers such as ``expert_bias``), or a LoRAModel's adapters (named after their global tensors)."""
    if isinstance(model, LoRAModel):
        return {name: (param, gp) for name, param, gp in adapter_layouts(model, ctx)}
    return {name: (param, global_param(name, param, model.config, ctx))
            for name, param in model.state_dict(keep_vars=True).items()}


def _describe(model, role: SyncRole) -> dict:
    ctx = ShardContext(tp_rank=role.tp_rank, tp_size=role.tp_size)
    params = {name: (gp.name, gp.shape, gp.pieces, gp.replicated, gp.alias, param.dtype)
              for name, (param, gp) in _tensors(model, ctx).items()}
    return {"role": role, "params": params}


def _global_boxes(pieces):
    """``(local box, global box)`` of every piece."""
    for piece in pieces:
        yield piece.local, tuple((o, o + hi - lo) for o, (lo, hi) in zip(piece.offset, piece.local))


def _local_part(part, local_box, global_box):
    return tuple((lo - g0 + l0, hi - g0 + l0) for (lo, hi), (l0, _), (g0, _) in zip(part, local_box, global_box))


def build_plan(descriptions: list[dict]) -> list[Transfer]:
    """Every transfer, from the gathered per-rank descriptions (index = rank in the sync group)."""
    trainers = {i: d for i, d in enumerate(descriptions) if d is not None and d["role"].side == TRAINER}
    rollouts = {i: d for i, d in enumerate(descriptions) if d is not None and d["role"].side == ROLLOUT}
    if not trainers or not rollouts:
        raise ValueError(f"weight sync needs trainer and rollout ranks, got {len(trainers)} trainer and "
                         f"{len(rollouts)} rollout ranks")
    trainer_dp = max(d["role"].replica for d in trainers.values()) + 1
    sources: dict[tuple[int, str], list] = {}
    for rank, desc in trainers.items():
        for name, (gname, shape, pieces, replicated, alias, dtype) in desc["params"].items():
            if alias or ("tp" in replicated and desc["role"].tp_rank != 0):
                continue
            sources.setdefault((desc["role"].replica, gname), []).append((rank, name, shape, pieces, dtype))
    plan = []
    for dst, desc in sorted(rollouts.items()):
        replica = desc["role"].replica % trainer_dp
        for name, (gname, shape, pieces, _, alias, dtype) in desc["params"].items():
            if alias:
                continue
            senders = sources.get((replica, gname))
            if not senders:
                raise ValueError(f"no trainer rank of DP replica {replica} holds {gname!r}, which rollout rank {dst} "
                                 f"needs")
            if senders[0][2] != shape or senders[0][4] != dtype:
                raise ValueError(f"{gname!r} is {tuple(senders[0][2])} {senders[0][4]} on the trainer but "
                                 f"{tuple(shape)} {dtype} on rollout rank {dst}")
            for dst_local, dst_global in _global_boxes(pieces):
                for src, src_name, _, src_pieces, _ in senders:
                    for src_local, src_global in _global_boxes(src_pieces):
                        part = intersect(dst_global, src_global)
                        if part is not None:
                            plan.append(Transfer(src, dst, src_name, name, _local_part(part, src_local, src_global),
                                                 _local_part(part, dst_local, dst_global)))
    plan.sort(key=lambda t: (t.src, t.dst))
    return plan


class WeightSync:
    """Collective over ``group`` (default: the world): every member passes its model chunk (or its LoRAModel, for
    an adapter-only sync) and :class:`SyncRole` (None: a member that neither sends nor receives).  ``sync()`` then
    moves the trainer weights in place into the rollout models."""

    def __init__(self, model, role: SyncRole | None, group=None, bucket_numel: int = 1 << 22):
        if not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive integer, got {bucket_numel!r}")
        self.group, self.bucket_numel = group, bucket_numel
        self.rank = dist.get_rank(group)
        self.model, self.role = (unwrap(model) if model is not None else None), role
        descriptions = [None] * dist.get_world_size(group)
        dist.all_gather_object(descriptions, _describe(self.model, role) if role is not None else None, group=group)
        self.plan = build_plan(descriptions)
        mine = descriptions[self.rank]
        self.expected_bytes_received = 0
        if mine is not None and role.side == ROLLOUT:
            self.expected_bytes_received = sum(t.numel for t in self.plan if t.dst == self.rank) * \
                torch.empty((), dtype=next(self.model.parameters()).dtype).element_size()
        self.bytes_sent = self.bytes_received = 0

    def _buckets(self, transfers: list[Transfer]) -> list[list[Transfer]]:
        buckets, current, size = [], [], 0
        for transfer in transfers:
            if current and size + transfer.numel > self.bucket_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(transfer)
            size += transfer.numel
        return buckets + ([current] if current else [])

    @torch.no_grad()
    def sync(self) -> None:
        """Send (trainer) or receive (rollout) this rank's part of the plan."""
        params = {} if self.model is None else {
            name: tensor for name, (tensor, _) in _tensors(self.model, ShardContext(self.role.tp_rank,
                                                                                    self.role.tp_size)).items()}
        pairs: dict[tuple[int, int], list[Transfer]] = {}
        for transfer in self.plan:
            if self.rank in (transfer.src, transfer.dst):
                pairs.setdefault((transfer.src, transfer.dst), []).append(transfer)
        for (src, dst), transfers in sorted(pairs.items()):
            for bucket in self._buckets(transfers):
                if self.rank == src:
                    flat = torch.cat([params[t.src_param][box_slices(t.src_box)].reshape(-1) for t in bucket])
                    dist.send(flat, dst=dist.get_global_rank(self.group, dst) if self.group else dst, group=self.group)
                    self.bytes_sent += flat.numel() * flat.element_size()
                else:
                    first = params[bucket[0].dst_param]
                    flat = torch.empty(sum(t.numel for t in bucket), dtype=first.dtype, device=first.device)
                    dist.recv(flat, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
                    self.bytes_received += flat.numel() * flat.element_size()
                    offset = 0
                    for t in bucket:
                        target = params[t.dst_param][box_slices(t.dst_box)]
                        target.copy_(flat[offset:offset + t.numel].view(target.shape))
                        offset += t.numel
