"""Decode-only engine steps at static shapes, so that a CUDA graph can capture them.

A step in which every scheduled sequence decodes exactly one token (no prefill chunk, no speculative
verification) runs here instead of through :class:`PagedStep`: its inputs are copied into persistent device
buffers padded to a *batch bucket* (1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``, vLLM's sizes)
and a *context bucket* (the same sizes in blocks, up to the blocks of the model's whole context), and the
forward reads nothing else.  One shape per pair of buckets, and no host work inside the forward, is what lets
:class:`megalite.inference.cuda_graphs.GraphCache` capture it once and replay it every step after.  Off CUDA
the engine keeps its eager paged step (the static one is no faster on CPU); the tests run the static step
eagerly there.

Padding rows decode at position 0 of the pool's *scratch block*, a block past the allocator's that no
sequence owns: they write their keys and values there and attend to that one slot, so they stay finite and
touch no real sequence; their logits are dropped.

Attention (:class:`StaticDecodeCache`): each sequence's blocks are gathered through its padded block table to
``[bucket, groups, keys, d]`` and SDPA runs with a length mask (and the sliding window, if any).  A group's
query heads become the query rows of one SDPA head, since every one of them attends to the same keys, so
grouped-query attention needs no expansion of the keys.  With ``EngineConfig.decode_attention = "triton"``,
:mod:`megalite.inference.triton_attention`'s kernel reads the blocks in place instead (no gathered copy).
Sampling stays outside: the step returns the logits.
"""

from __future__ import annotations

import bisect
from array import array

import torch
import torch.nn.functional as F

from megalite.inference import triton_attention
from megalite.inference.cuda_graphs import GraphCache
from megalite.inference.paged_cache import KVPool, StepPlan


def buckets(limit: int) -> list[int]:
    """The padded sizes up to ``limit``: 1, 2, 4, 8, then multiples of 8, and ``limit`` last (vLLM's batch sizes;
    here also the context lengths in blocks, so padding wastes at most a third of a gather past 16 blocks)."""
    return sorted(s for s in {1, 2, 4, *range(8, limit, 8), limit} if s <= limit)


def bucket(sizes: list[int], n: int) -> int:
    """The smallest of the ascending ``sizes`` that holds ``n``."""
    return sizes[bisect.bisect_left(sizes, n)]


# ids, positions, slots, contexts: the leading columns of a packed decode step; its block table follows
COLUMNS = 4


def pack_decode(plan: StepPlan, block_size: int, scratch: int, batch: int, blocks: int) -> torch.Tensor:
    """A decode-only ``plan`` as int64 rows ``[batch, COLUMNS + blocks]`` (host): token, position, the slot its key
    goes to, context length, then ``blocks`` block ids (freed ``-1`` entries and padding: ``scratch``); padding
    rows decode at position 0 of the scratch block.  Built in an ``array`` (a nested list through
    ``torch.tensor`` costs 8x more, a millisecond per step at 128 sequences)."""
    bs, n = block_size, len(plan.lengths)
    flat = array("q")
    for token, position, start, table in zip(plan.token_ids, plan.positions, plan.starts, plan.block_tables):
        table = table[:blocks]
        flat.extend((token, position, table[start // bs] * bs + start % bs, start + 1))
        flat.extend(table)
        flat.extend([scratch] * (blocks - len(table)))
    flat.extend([0, 0, scratch * bs, 1, *[scratch] * blocks] * (batch - n))
    rows = torch.frombuffer(flat, dtype=torch.long).view(batch, COLUMNS + blocks)
    tables = rows[:n, COLUMNS:]
    tables.masked_fill_(tables < 0, scratch)
    return rows


def decode_attention_for(config, device: torch.device) -> str:
    """The attention the static steps of an engine with ``config`` on ``device`` run: ``EngineConfig.decode_attention``,
    its ``"auto"`` resolved to the Triton kernel on CUDA where Triton is installed and the block size is a power
    of two, else SDPA (a ValueError for ``"triton"`` without Triton)."""
    attention = config.decode_attention
    if attention == "triton" and not triton_attention.available():
        raise ValueError("EngineConfig.decode_attention='triton' needs Triton installed")
    if attention == "auto":
        usable = device.type == "cuda" and triton_attention.available() and config.blocks_fit_triton
        attention = "triton" if usable else "sdpa"
    return attention


class StaticDecodeCache:
    """The KV cache of one static decode forward (a :class:`megalite.models.attention.AttentionCache`).

    ``tables [B, C]`` (block ids), ``slots [B]`` (where each row's new key goes) and ``contexts [B]`` (keys
    each row sees, itself included) are device tensors; the mask is built from them on the device.
    ``attention``: ``"sdpa"`` (gather, then SDPA) or ``"triton"`` (:func:`triton_attention.paged_decode`).
    """

    offset = 0

    def __init__(self, pool: KVPool, tables: torch.Tensor, slots: torch.Tensor, contexts: torch.Tensor,
                 window: int | None, attention: str = "sdpa"):
        self.pool, self.window, self.slots, self.tables, self.contexts = pool, window, slots, tables, contexts
        self.attention = attention
        self.batch, blocks = tables.shape
        self.keys = blocks * pool.block_size
        if attention == "sdpa":
            self.index = tables.reshape(-1)
            key_pos = torch.arange(self.keys, device=tables.device)[None, :]
            allowed = key_pos < contexts[:, None]
            if window is not None:  # a token sees itself and the ``window`` tokens before it
                allowed &= key_pos >= contexts[:, None] - 1 - window
            self.mask = allowed[:, None, None, :]  # [B, 1 (groups), 1 (queries), keys]

    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               mask: torch.Tensor | None) -> torch.Tensor:
        """``q [B, 1, heads, d]``, ``k``/``v`` ``[B, 1, groups, d]`` -> context ``[B, 1, heads * d]``."""
        if mask is not None or dropout:
            raise ValueError("the paged KV cache takes no attention mask or dropout (positions come per token)")
        keys, values = self.pool.keys[layer_number], self.pool.values[layer_number]
        groups, _, _, d = keys.shape
        heads = q.shape[2]
        for cache, new in ((keys, k), (values, v)):
            cache.view(groups, -1, d).index_copy_(1, self.slots, new[:, 0].transpose(0, 1).to(cache.dtype))
        if self.attention == "triton":
            out = triton_attention.paged_decode(q[:, 0].contiguous(), keys, values, self.tables, self.contexts,
                                                d ** -0.5, self.window)
            return out.view(self.batch, 1, heads * d)

        def gather(cache):
            return cache.index_select(1, self.index).view(groups, self.batch, self.keys, d).transpose(0, 1)

        query = q[:, 0].reshape(self.batch, groups, heads // groups, d)
        out = F.scaled_dot_product_attention(query, gather(keys), gather(values), attn_mask=self.mask,
                                             scale=d ** -0.5)
        return out.reshape(self.batch, 1, heads * d)

    def advance(self, num_tokens: int) -> None:
        """Nothing to track: the scheduler owns how many tokens each sequence has cached."""


class StaticDecode:
    """Runs the decode-only steps of one engine at static shapes, through CUDA graphs when ``graphs``.

    ``pool`` must hold ``scratch_block`` (the engine's pool has one block past its allocator's);
    ``max_context`` is the model's longest context.  The rotary frequencies move to the pool's device once
    here, so the forward copies nothing from the host (a host copy cannot be captured).  ``attention``: see
    :class:`StaticDecodeCache`.
    """

    def __init__(self, model, pool: KVPool, scratch_block: int, max_num_seqs: int, max_context: int,
                 window: int | None, vocab_size: int, graphs: bool, attention: str = "sdpa"):
        self.model, self.pool, self.window, self.vocab_size = model, pool, window, vocab_size
        self.attention = attention
        self.scratch = scratch_block
        self.max_blocks = -(-max_context // pool.block_size)
        self.batch_sizes, self.block_counts = buckets(max_num_seqs), buckets(self.max_blocks)
        device = next(iter(pool.keys.values())).device
        self.inputs = torch.zeros(self.batch_sizes[-1], COLUMNS + self.max_blocks, dtype=torch.long,
                                  device=device)
        self.graphs = GraphCache() if graphs else None
        self._weights = None  # where the parameters lived when the graphs were captured
        if model.rotary is not None:
            model.rotary.inv_freq = model.rotary.inv_freq.to(device)

    @staticmethod
    def unsupported(engine) -> str | None:
        """What of ``engine`` the static steps do not support, or None."""
        if engine.tp_size > 1:
            return "static decode steps do not support tensor parallelism (the step's all-gather)"
        if engine.drafter is not None:
            return "static decode steps do not support speculative decoding (verification steps are not decode-only)"
        if engine.pool.latent_values is not None:
            return "static decode steps do not support multi-latent attention"
        if engine.model.config.batch_invariant:
            return "static decode steps do not support batch-invariant mode"
        return None

    @classmethod
    def for_engine(cls, engine, graphs: bool) -> StaticDecode:
        """The runner of ``engine``'s decode-only steps (a ValueError naming what the engine uses that it does
        not support, or an attention its config asks for that cannot run); the engine builds one on CUDA
        (:meth:`default_for`), a test may install one elsewhere."""
        reason = cls.unsupported(engine)
        if reason is not None:
            raise ValueError(reason)
        attention = decode_attention_for(engine.config, engine.device)
        return cls(engine.model, engine.pool, engine.config.num_blocks, engine.config.max_num_seqs,
                   engine.max_context, engine.window, engine.vocab_size, graphs, attention)

    @classmethod
    def default_for(cls, engine) -> StaticDecode | None:
        """CUDA-graphed decode steps where ``EngineConfig.cuda_graphs`` asks and the engine runs on CUDA with
        a model whose forward can be captured (no MoE routing or learned-position range check: both read
        device values on the host) and that :meth:`unsupported` accepts, else None (eager steps).  An attention
        the config names that cannot run (``"triton"`` without Triton) is an error, not a silent eager engine."""
        model = engine.model
        if not (engine.config.cuda_graphs and engine.device.type == "cuda" and model.config.moe is None
                and model.embedding.position_embeddings is None) or cls.unsupported(engine) is not None:
            return None
        return cls.for_engine(engine, graphs=True)

    def accepts(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is decode-only: one sampled token per sequence, within the largest batch bucket."""
        n = len(plan.lengths)
        return (0 < n <= self.batch_sizes[-1] and all(x == 1 for x in plan.lengths)
                and plan.sample_rows == list(range(n)))

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """The step's fp32 logits ``[len(plan.lengths), vocab]`` (writes the new keys and values to the pool)."""
        n = len(plan.lengths)
        batch = bucket(self.batch_sizes, n)
        blocks = bucket(self.block_counts, max(start // self.pool.block_size for start in plan.starts) + 1)
        rows = pack_decode(plan, self.pool.block_size, self.scratch, batch, blocks)
        self.inputs[:batch, :COLUMNS + blocks].copy_(rows)
        if self.graphs is None:
            logits = self._forward(batch, blocks)
        else:
            # A graph reads the parameters at the addresses it was captured with: weights moved since (offloaded
            # and reloaded, cast, replaced) need new graphs.
            weights = [p.data_ptr() for p in self.model.parameters()]
            if weights != self._weights:
                self.graphs, self._weights = GraphCache(), weights
            logits = self.graphs.run((batch, blocks), lambda: self._forward(batch, blocks))
        return logits[:n, :self.vocab_size].to(torch.float32, copy=True)

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """Logits ``[batch, v]`` of the buffered inputs of ``batch`` rows and ``blocks`` blocks of context."""
        inputs = self.inputs[:batch]
        ids, positions, slots, contexts = (inputs[:, i].contiguous() for i in range(COLUMNS))
        cache = StaticDecodeCache(self.pool, inputs[:, COLUMNS:COLUMNS + blocks], slots, contexts,
                                  self.window, self.attention)
        hidden = self.model(ids[None], position_ids=positions[None], kv_cache=cache, return_hidden=True)
        return self.model.output_logits(hidden[0].unsqueeze(1))[:, 0]
