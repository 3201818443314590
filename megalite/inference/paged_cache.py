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
        q_max = max(plan.lengths[i] for i in members)
        c_max = max(plan.starts[i] + plan.lengths[i] for i in members)
        s = len(members)
        key_pos = torch.arange(c_max)
        gather = torch.zeros(s, c_max, dtype=torch.long)
        queries = torch.zeros(s, q_max, dtype=torch.long)
        mask = torch.zeros(s, 1, q_max, c_max, dtype=torch.bool)
        rows, tokens = [], []
        for r, i in enumerate(members):
            start, length = plan.starts[i], plan.lengths[i]
            ctx = start + length
            table = torch.tensor(plan.block_tables[i], dtype=torch.long)
            gather[r, :ctx] = table[key_pos[:ctx] // block_size] * block_size + key_pos[:ctx] % block_size
            queries[r, :length] = torch.arange(offsets[i], offsets[i] + length)
            mask[r, 0, :length, :ctx] = key_pos[:ctx][None, :] <= (start + torch.arange(length))[:, None]
            mask[r, 0, length:, 0] = True
            rows.extend(range(r * q_max, r * q_max + length))
            tokens.extend(range(offsets[i], offsets[i] + length))
        self.gather, self.queries, self.mask = gather.to(device), queries.to(device), mask.to(device)
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.tokens = torch.tensor(tokens, dtype=torch.long, device=device)


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
        for g in self.groups:
            query = q[:, 0][g.queries].transpose(1, 2)
            key = keys[g.gather].transpose(1, 2)
            value = values[g.gather].transpose(1, 2)
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=g.mask,
                                                     enable_gqa=key.shape[1] != heads)
            out[g.tokens] = context.transpose(1, 2).reshape(-1, heads * d)[g.rows]
        return out.unsqueeze(1)

    def advance(self, num_tokens: int) -> None:
        """Nothing to track: the scheduler owns how many tokens each sequence has cached."""
