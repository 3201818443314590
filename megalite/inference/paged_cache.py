"""The paged KV pool and the per-step view the attention layers read it through.

Keys and values of every layer live in one pool of fixed-size blocks,
``[groups_local, num_blocks, block_size, d]`` per layer (group-major: whole
blocks of one group are contiguous, so gathering a sequence's blocks yields
the ``[groups, blocks * block_size, d]`` operand of a batched matmul without
a transpose).  A sequence's block table lists its blocks in order, so token
``p`` sits in block ``table[p // block_size]`` at row ``p % block_size``.

One engine step packs the new tokens of all scheduled sequences into a single
``[1, T]`` batch.  :class:`PagedStep` is the KV cache the model sees for that
forward (a :class:`megalite.models.attention.AttentionCache`): each
layer writes its new keys/values into their slots, then attends.  This is the
CPU attention backend; a GPU paged-attention kernel would replace
:meth:`PagedStep.attend`.  Its index tensors and masks are built once per
step and shared by every layer:

- short queries (decodes, speculative verification) run the extension's
  paged-attention kernel (``megalite.kernels.paged_attention``: one pass over
  each sequence's blocks in place, online softmax) when it is built and the
  pool is fp32 on CPU.  Otherwise they are sorted by context
  length and cut into buckets, so padding stays small; each bucket gathers
  its sequences' blocks with one ``index_select`` into a reused buffer and
  runs two batched matmuls and a softmax (cheaper than SDPA for a handful of
  queries per sequence);
- prefill chunks run SDPA one sequence at a time: a chunk that starts the
  sequence attends to its own new keys with ``is_causal`` (no gather), a
  later chunk gathers its context and uses a causal mask shifted by its start.

A multi-latent-attention model caches one latent key per token and layer
(``latent_values`` set): ``[1, num_blocks, block_size, kv_lora_rank +
qk_pos_emb_head_dim]``, the normalised KV latent followed by the rotary key;
its first ``kv_lora_rank`` channels are the values.  The layer attends in the
weight-absorbed form through :meth:`PagedStep.attend_latent` (see
``megalite.models.mla``), so no per-head keys or values are stored; under
tensor parallelism every rank holds this whole pool and its own heads attend to it.

A sliding-window model (``window``: a token sees itself and the ``window``
tokens before it) masks older keys in every path (the fused kernel, which has
no window, is not used); the scheduler frees blocks that fell out of every
future query's window and marks them -1 in the block table, read here as
block 0 under the mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megalite import batch_invariant, kernels

# Queries up to this length go to the batched-matmul buckets; longer ones (prefill chunks) to per-sequence SDPA.
SHORT_QUERY = 8
# Sequences per bucket of short queries: small enough that sorting by context length leaves little padding.
BUCKET_SIZE = 16


class KVPool:
    """Key and value blocks for the layers ``layer_numbers`` of this rank's model chunk.

    With ``latent_values`` (MLA's ``kv_lora_rank``) only keys are stored: the
    values are their first ``latent_values`` channels.
    """

    def __init__(self, layer_numbers, num_blocks: int, block_size: int, groups: int, head_dim: int,
                 dtype: torch.dtype, device, latent_values: int | None = None):
        self.num_blocks, self.block_size, self.latent_values = num_blocks, block_size, latent_values
        shape = (groups, num_blocks, block_size, head_dim)
        self.keys = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        self.values = {} if latent_values else {n: torch.zeros(shape, dtype=dtype, device=device)
                                                 for n in layer_numbers}
        self._buffers: dict[str, torch.Tensor] = {}

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, tp_size: int = 1,
                  layer_numbers: list[int] | None = None) -> KVPool:
        """The pool for ``model``'s layers (or the layers ``layer_numbers``, e.g. its multi-token prediction
        layers): per-group keys and values, or MLA's latent keys."""
        mc, param = model.config, next(model.parameters())
        layers = [int(n) for n in model.decoder.layers] if layer_numbers is None else layer_numbers
        if mc.multi_latent_attention:
            return cls(layers, num_blocks, block_size, 1, mc.kv_lora_rank + mc.qk_pos_emb_head_dim, param.dtype,
                       param.device, latent_values=mc.kv_lora_rank)
        return cls(layers, num_blocks, block_size, mc.num_query_groups // tp_size, mc.kv_channels, param.dtype,
                   param.device)

    def bytes_per_token(self) -> int:
        """Bytes the pool holds per cached token, over all its layers."""
        total = sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))
        return total // (self.num_blocks * self.block_size)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` into block ``dst`` in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        device = next(iter(self.keys.values())).device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for cache in (*self.keys.values(), *self.values.values()):
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat scratch tensor of at least ``numel`` elements, reused across layers and steps."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[name] = like.new_empty(max(numel, 2 * (0 if buf is None else buf.numel())))
        return buf[:numel]


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


class _Bucket:
    """Sequences with short queries, padded to ``q`` queries and ``blocks`` blocks of context.

    ``blocks_index``: their block ids (padding: block 0, masked); ``queries``:
    packed rows of their queries (padding: row 0); ``rows``/``tokens``: which
    padded query rows are real and the packed rows they fill; ``bias``: 0 or
    -inf per (query, key), ``[n, q, keys]``.
    """

    def __init__(self, members, plan: StepPlan, offsets: list[int], block_size: int, device, window: int | None):
        starts = torch.tensor([plan.starts[i] for i in members])
        lengths = torch.tensor([plan.lengths[i] for i in members])
        first = torch.tensor([offsets[i] for i in members])
        tables = [plan.block_tables[i] for i in members]
        ctx = starts + lengths
        self.n, self.q = len(members), int(lengths.max())
        self.blocks = -(-int(ctx.max()) // block_size)
        self.blocks_index = torch.tensor([t[:self.blocks] + [0] * (self.blocks - len(t[:self.blocks]))
                                          for t in tables]).flatten().to(device)
        keys = self.blocks * block_size
        key_pos, query_pos = torch.arange(keys), torch.arange(self.q)
        has_query = query_pos[None, :] < lengths[:, None]
        distance = (starts[:, None] + query_pos[None, :])[:, :, None] - key_pos[None, None, :]
        allowed = distance >= 0
        if window is not None:
            allowed &= distance <= window
        allowed[:, :, 0] |= ~has_query
        bias = torch.zeros(self.n, self.q, keys).masked_fill_(~allowed, float("-inf"))
        self.bias = bias.to(device)
        self.expanded: torch.Tensor | None = None

        tokens = first[:, None] + query_pos[None, :]
        self.queries = torch.where(has_query, tokens, 0).flatten().to(device)
        self.rows = has_query.flatten().nonzero().squeeze(1).to(device)
        self.tokens = tokens[has_query].to(device)

    def bias_for(self, groups: int, per_group: int, dtype: torch.dtype) -> torch.Tensor:
        """The bias laid out like the scores, ``[groups * n, per_group * q, keys]`` (built once, for every layer)."""
        if self.expanded is None:
            bias = self.bias[None, :, None].expand(groups, self.n, per_group, self.q, self.bias.shape[-1])
            self.expanded = bias.reshape(groups * self.n, per_group * self.q, -1).to(dtype)
        return self.expanded


class _Chunk:
    """One sequence's prefill chunk: packed rows ``first .. first+length``, context ``start + length``."""

    def __init__(self, index: int, plan: StepPlan, offsets: list[int], block_size: int, device, window: int | None):
        self.start, self.length, self.first = plan.starts[index], plan.lengths[index], offsets[index]
        self.blocks_index = self.mask = None
        context = self.start + self.length
        if self.start:
            self.blocks_index = torch.tensor(plan.block_tables[index][:-(-context // block_size)], device=device)
        if self.start or window is not None:
            distance = (self.start + torch.arange(self.length, device=device))[:, None] - torch.arange(
                context, device=device)
            self.mask = (distance >= 0) if window is None else (distance >= 0) & (distance <= window)


class PagedStep:
    """The KV cache of one packed forward: writes new keys/values to their slots, attends through block tables."""

    offset = 0

    def __init__(self, pool: KVPool, plan: StepPlan, device, window: int | None = None):
        self.pool, self.window = pool, window
        bs = pool.block_size
        if any(b < 0 for table in plan.block_tables for b in table):
            plan = dataclasses.replace(plan, block_tables=[[max(b, 0) for b in t] for t in plan.block_tables])
        offsets, slots = [], []
        total = 0
        for start, length, table in zip(plan.starts, plan.lengths, plan.block_tables):
            offsets.append(total)
            total += length
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + length))
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        short = [i for i, n in enumerate(plan.lengths) if n <= SHORT_QUERY]
        self.fused, self.buckets = None, []
        if short and window is None and pool.latent_values is None and kernels.paged_attention_fused(*pool.keys.values(), *pool.values.values()):
            blocks = max(-(-(plan.starts[i] + plan.lengths[i]) // bs) for i in short)
            tables = [plan.block_tables[i][:blocks] + [0] * (blocks - len(plan.block_tables[i][:blocks])) for i in short]
            self.fused = tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (
                tables, [plan.starts[i] for i in short], [plan.lengths[i] for i in short], [offsets[i] for i in short]))
        else:
            short.sort(key=lambda i: plan.starts[i] + plan.lengths[i])
            self.buckets = [_Bucket(short[i:i + BUCKET_SIZE], plan, offsets, bs, device, window)
                            for i in range(0, len(short), BUCKET_SIZE)]
        self.chunks = [_Chunk(i, plan, offsets, bs, device, window) for i, n in enumerate(plan.lengths)
                       if n > SHORT_QUERY]
        self.plan, self.offsets, self.device, self._invariant = plan, offsets, device, None

    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               mask: torch.Tensor | None) -> torch.Tensor:
        """``q [T, 1, nq, d]``, ``k``/``v`` ``[T, 1, ng, d]`` -> context ``[T, 1, nq*d]``."""
        if mask is not None or dropout:
            raise ValueError("the paged KV cache takes no attention mask or dropout (positions come per token)")
        keys, values = self.pool.keys[layer_number], self.pool.values[layer_number]
        self._write(keys, k)
        self._write(values, v)
        d = keys.shape[-1]
        if batch_invariant.enabled():
            return self._attend_invariant(q[:, 0], keys, values, d ** -0.5)
        if self.fused is not None:
            t, heads = q.shape[0], q.shape[2]
            out = kernels.paged_attention(q[:, 0].contiguous(), keys, values, *self.fused, d ** -0.5).view(t, heads * d)
        else:
            out = None
        return self._attend(q[:, 0], k, v, keys, values, d ** -0.5, out)

    def attend_latent(self, layer_number: int, q: torch.Tensor, latent: torch.Tensor, scale: float,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """MLA's absorbed attention: ``q [T, 1, heads, r + rope]`` (queries folded through W_UK, then the rotary
        part) over the latent keys ``[T, 1, 1, r + rope]`` whose first ``r`` channels are the values
        -> latent context ``[T, 1, heads*r]`` (W_UV is applied by the layer)."""
        if mask is not None:
            raise ValueError("the paged KV cache takes no attention mask (positions come per token)")
        keys, r = self.pool.keys[layer_number], self.pool.latent_values
        self._write(keys, latent)
        return self._attend(q[:, 0], latent, latent[..., :r], keys, keys[..., :r], scale, None)

    def _attend_invariant(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """Every sequence's queries over its cached keys in position order, by ``batch_invariant.attention`` (the
        trainer's function): ``q [T, heads, d]`` -> ``[T, 1, heads * d]``."""
        if self._invariant is None:
            plan, bs = self.plan, self.pool.block_size
            contexts = [start + length for start, length in zip(plan.starts, plan.lengths)]
            qn, kn = max(plan.lengths), max(contexts)
            key_pos, query_pos = torch.arange(kn), torch.arange(qn)
            slots = torch.tensor([[t[p // bs] * bs + p % bs if p < c else 0 for p in range(kn)]
                                  for t, c in zip(plan.block_tables, contexts)])
            starts, lengths = torch.tensor(plan.starts), torch.tensor(plan.lengths)
            real = query_pos[None, :] < lengths[:, None]                                   # [n, qn]
            allowed = key_pos[None, None, :] <= (starts[:, None] + query_pos[None, :])[:, :, None]
            allowed &= real[:, :, None]
            allowed[:, :, 0] |= ~real  # a padding query sees key 0, so its (unused) row stays finite
            rows = torch.tensor(self.offsets)[:, None] + query_pos[None, :]
            self._invariant = tuple(t.to(self.device) for t in (
                slots.flatten(), allowed, torch.where(real, rows, 0).flatten(), real.flatten().nonzero().squeeze(1),
                rows[real]))
        slots, allowed, queries, kept, targets = self._invariant
        n, qn, kn = allowed.shape
        groups, d = keys.shape[0], keys.shape[-1]

        def gather(cache):
            return cache.view(groups, -1, d).index_select(1, slots).view(groups, n, kn, d).permute(1, 2, 0, 3)

        query = q.index_select(0, queries).view(n, qn, q.shape[1], d)
        context = batch_invariant.attention(query, gather(keys), gather(values), allowed, scale)
        out = q.new_empty(q.shape[0], q.shape[1] * d)
        out[targets] = context.reshape(n * qn, -1).index_select(0, kept)
        return out.unsqueeze(1)

    def _write(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        """Store the step's new keys or values ``[T, 1, groups, d]`` in their slots."""
        cache.view(cache.shape[0], -1, cache.shape[-1]).index_copy_(
            1, self.slots, new[:, 0].transpose(0, 1).to(cache.dtype))

    def _attend(self, q, k, v, keys, values, scale: float, out: torch.Tensor | None) -> torch.Tensor:
        """Buckets and prefill chunks (and ``out`` from the fused kernel, if any); ``values`` may be a view of
        ``keys`` (the MLA latent), whose last dimension ``dv`` may be smaller than the keys' ``d``."""
        groups, _, bs, d = keys.shape
        dv = values.shape[-1]
        shared = self.pool.latent_values is not None
        t, heads, _ = q.shape
        per_group = heads // groups
        if out is None:
            out = q.new_empty(t, heads * dv)
        for b in self.buckets:
            n, nq, width = b.n, b.q, b.blocks * bs
            size = groups * n * width * d
            key = torch.index_select(keys, 1, b.blocks_index, out=self.pool.buffer("k", size, keys).view(
                groups, n * b.blocks, bs, d)).view(groups * n, width, d)
            if shared:
                value = key[..., :dv]
            else:
                value = torch.index_select(values, 1, b.blocks_index, out=self.pool.buffer("v", size, values).view(
                    groups, n * b.blocks, bs, d)).view(groups * n, width, d)
            query = q.index_select(0, b.queries).view(n, nq, groups, per_group, d).permute(2, 0, 3, 1, 4)
            scores = torch.baddbmm(b.bias_for(groups, per_group, q.dtype), query.reshape(groups * n, per_group * nq, d),
                                   key.transpose(1, 2), alpha=scale).softmax(dim=-1)
            context = torch.bmm(scores, value)
            context = context.view(groups, n, per_group, nq, dv).permute(1, 3, 0, 2, 4).reshape(n * nq, heads * dv)
            out[b.tokens] = context.index_select(0, b.rows)
        for c in self.chunks:
            query = q[c.first:c.first + c.length].transpose(0, 1).unsqueeze(0)
            if c.blocks_index is None:
                key = k[c.first:c.first + c.length, 0].transpose(0, 1).unsqueeze(0)
                value = v[c.first:c.first + c.length, 0].transpose(0, 1).unsqueeze(0)
            else:
                context_len = c.start + c.length
                key = keys.index_select(1, c.blocks_index).view(1, groups, -1, d)[:, :, :context_len]
                value = key[..., :dv] if shared else values.index_select(1, c.blocks_index).view(
                    1, groups, -1, d)[:, :, :context_len]
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=c.mask, is_causal=c.mask is None,
                                                     scale=scale, enable_gqa=groups != heads)
            out[c.first:c.first + c.length] = context[0].transpose(0, 1).reshape(c.length, heads * dv)
        return out.unsqueeze(1)

    def advance(self, num_tokens: int) -> None:
        """Nothing to track: the scheduler owns how many tokens each sequence has cached."""
