"""The paged KV pool and the per-step view the attention layers read it through.

Keys and values of every layer live in one pool of fixed-size blocks
(``[num_blocks * block_size, groups_local, d]`` per layer); a sequence's
block table lists its blocks in order, so token ``p`` sits in slot
``table[p // block_size] * block_size + p % block_size``.

One engine step packs the new tokens of all scheduled sequences into a single
``[1, T]`` batch.  :class:`PagedStep` is the KV cache the model sees for that
forward (the duck-typed interface of :mod:`megalite.models.kv_cache`): each
layer writes its new keys/values into their slots, then gathers every
sequence's context through its block table and runs SDPA per group of
sequences (decodes together, prefill chunks together), padded to the group's
longest query and context.  This gather-based path is the CPU attention
backend; a GPU paged-attention kernel would replace :meth:`PagedStep.attend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class KVPool:
    """Key and value blocks for the layers ``layer_numbers`` of this rank's model chunk."""

    def __init__(self, layer_numbers, num_blocks: int, block_size: int, groups: int, head_dim: int,
                 dtype: torch.dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, groups, head_dim)
        self.keys = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        self.values = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` into block ``dst`` in every layer (copy-on-write of shared blocks)."""
        bs = self.block_size
        for src, dst in pairs:
            for cache in (*self.keys.values(), *self.values.values()):
                cache[dst * bs:(dst + 1) * bs] = cache[src * bs:(src + 1) * bs]


@dataclass
class StepPlan:
    """What one step computes, as plain lists (rank 0 builds it and broadcasts it to the other TP ranks).

    ``token_ids``/``positions``: the packed new tokens; per scheduled sequence
    ``starts`` (tokens already cached), ``lengths`` (new tokens) and
    ``block_tables``; ``sample_rows``: packed indices whose logits are needed;
    ``copies``: (src, dst) blocks to copy before the forward.  ``stop`` ends
    the other ranks' loop.
    """

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    stop: bool = False


class _Group:
    """Index tensors for one SDPA call over sequences padded to ``Q`` queries and ``C`` keys."""

    def __init__(self, members, plan: StepPlan, offsets: list[int], block_size: int, device):
        starts = torch.tensor([plan.starts[i] for i in members])
        lengths = torch.tensor([plan.lengths[i] for i in members])
        first = torch.tensor([offsets[i] for i in members])
        widest = max(len(plan.block_tables[i]) for i in members)
        tables = torch.tensor([plan.block_tables[i] + [0] * (widest - len(plan.block_tables[i])) for i in members])
        ctx = starts + lengths
        q_max, c_max = int(lengths.max()), int(ctx.max())
        key_pos = torch.arange(c_max)
        query_pos = torch.arange(q_max)
        has_key = key_pos[None, :] < ctx[:, None]
        gather = tables[:, key_pos // block_size] * block_size + key_pos % block_size
        has_query = query_pos[None, :] < lengths[:, None]
        mask = (key_pos[None, None, :] <= (starts[:, None] + query_pos[None, :])[:, :, None]) & has_key[:, None, :]
        mask &= has_query[:, :, None]
        mask[:, :, 0] |= ~has_query
        tokens = first[:, None] + query_pos[None, :]
        self.gather = torch.where(has_key, gather, 0).flatten().to(device)
        self.queries = torch.where(has_query, tokens, 0).flatten().to(device)
        self.shape = (len(members), q_max, c_max)
        self.mask = mask.unsqueeze(1).to(device)
        self.rows = has_query.flatten().nonzero().squeeze(1).to(device)
        self.tokens = tokens[has_query].to(device)


class PagedStep:
    """The KV cache of one packed forward: writes new keys/values to their slots, attends through block tables."""

    offset = 0

    def __init__(self, pool: KVPool, plan: StepPlan, device):
        self.pool = pool
        bs = pool.block_size
        offsets, slots = [], []
        total = 0
        for start, length, table in zip(plan.starts, plan.lengths, plan.block_tables):
            offsets.append(total)
            total += length
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + length))
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        decodes = [i for i, n in enumerate(plan.lengths) if n == 1]
        chunks = [i for i, n in enumerate(plan.lengths) if n > 1]
        self.groups = [_Group(m, plan, offsets, bs, device) for m in (decodes, chunks) if m]

    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               mask: torch.Tensor | None) -> torch.Tensor:
        """``q [T, 1, nq, d]``, ``k``/``v`` ``[T, 1, ng, d]`` -> context ``[T, 1, nq*d]``."""
        if mask is not None or dropout:
            raise ValueError("the paged KV cache takes no attention mask or dropout (positions come per token)")
        keys, values = self.pool.keys[layer_number], self.pool.values[layer_number]
        keys.index_copy_(0, self.slots, k[:, 0].to(keys.dtype))
        values.index_copy_(0, self.slots, v[:, 0].to(values.dtype))
        t, _, heads, d = q.shape
        out = q.new_empty(t, heads * d)
        groups = keys.shape[1]
        for g in self.groups:
            s, q_max, c_max = g.shape
            query = q[:, 0].index_select(0, g.queries).view(s, q_max, heads, d).transpose(1, 2)
            key = keys.index_select(0, g.gather).view(s, c_max, groups, d).transpose(1, 2)
            value = values.index_select(0, g.gather).view(s, c_max, groups, d).transpose(1, 2)
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=g.mask, enable_gqa=groups != heads)
            out[g.tokens] = context.transpose(1, 2).reshape(-1, heads * d).index_select(0, g.rows)
        return out.unsqueeze(1)

    def advance(self, num_tokens: int) -> None:
        """Nothing to track: the scheduler owns how many tokens each sequence has cached."""
