"""Compute time of one training step on one rank: GEMMs, attention, memory-bound ops and per-op overhead.

Four kinds of work, each at its own rate from the hardware profile (:class:`~megalite.hardware.Hardware`):

- GEMMs: the model FLOPs of :func:`~megalite.models.config.gpt_flops_per_token` less the core attention's (plus
  what recompute adds) at the peak times the GEMM efficiency at one micro-batch's rows;
- the fused causal attention (``4 * seq * heads * d`` FLOPs a token and layer forward, twice that backward, once
  more under selective or full recompute) at :meth:`~megalite.hardware.Hardware.attention_rate`, and its
  ``seq * heads`` scores a token and layer at ``attention_score_s`` (the softmax's work, which does not shrink with
  ``d``); context parallelism's blockwise attention (:mod:`megalite.context_parallel.blockwise`) instead runs its
  tiles' matmuls as GEMMs and their score tiles through memory (see :func:`_blockwise_attention`);
- the memory-bound ops (norms, residual sums, activation functions, RoPE, the fused QKV split's gradient, bias
  gradients, weight-gradient accumulation, the embedding and the loss over the logits): the elements each reads
  and writes (:func:`layer_elements`, :func:`head_elements`) at ``hbm_bandwidth``, and on a CPU (a profile with
  ``exp_rate``) what the elements the activation function and the loss pass through exp, erf or tanh take at that
  rate beyond a read and a write (:func:`transcendental_elements`, :func:`head_transcendentals`);
- every op's fixed cost (dispatch, autograd, a kernel launch) at ``op_overhead_s``, counted in ops per layer
  (:data:`LAYER_OPS`: the aten ops megalite's layer runs, counted in tests/plan/test_compute.py).

Per rank: the step's tokens over the ranks, each pipeline rank holding ``1 / pp`` of the layers and of the
embedding and loss (the average stage: the planner's pipeline model assumes balanced stages).  Where ranks share
CPU cores (``hw.cores``), :func:`oversubscribed` says how much longer a step takes when more ranks than cores
compete for them, and :func:`overlaps_communication` whether collectives can hide behind compute at all.
"""

from __future__ import annotations

from functools import lru_cache

from megalite.hardware import Hardware
from megalite.models.config import GPTConfig, gpt_flops_per_token
from megalite.plan.activations import TORCHTITAN_OP, op_recompute_flops_per_token
from megalite.plan.eager import TORCHTITAN_EAGER, eager_time
from megalite.plan.layout import DTYPE_BYTES, Layout
from megalite.plan.memory import layer_params

LAYER_OPS = {"forward": 35, "backward": 69}
"""Aten ops (views and gradient accumulation included) of one transformer layer for one micro-batch: LayerNorm,
GELU, biases, learned positions."""

ROPE_OPS = {"forward": 10, "backward": 8}
"""The ops RoPE adds to a layer."""

EMBEDDING_AND_LOSS_OPS = {"forward": 28, "backward": 27}
"""Ops of the embedding, final norm, output layer and loss for one micro-batch (and one reduction of the loss)."""

BLOCKWISE_PAIR_OPS = {"forward": 24, "backward": 60}
"""Aten ops of one computed (query tile, key tile) pair of the blockwise attention, wholly visible: its slices,
matmuls, scaling, log-sum-exp and probabilities forward; the recomputed scores and probabilities and the four
gradient matmuls with their accumulations backward (counted in tests/plan/test_compute.py)."""

BLOCKWISE_MASK_OPS = {"forward": 8, "backward": 8}
"""The ops a pair adds where it is partly masked (the mask's build and the masked fill)."""

BLOCKWISE_CALL_OPS = {"forward": 2, "backward": 8}
"""Ops of one blockwise call (one key block) beside its pairs: the output and log-sum-exp buffers forward; the
output's row dot, the safe log-sum-exp and the three gradient buffers backward."""

BLOCKWISE_WRITE_OPS = {"tile": 4, "whole": 2}
"""Forward ops writing one query tile's output and log-sum-exp into the call's buffers: a slice of them, or the
whole (a rank's queries in one tile)."""

BLOCKWISE_MERGE_OPS = 13
"""Forward ops of one exact merge of two partial outputs by their log-sum-exp: between the key tiles of a query
tile, and between the ring's steps."""

BLOCKWISE_SCORE_PASSES = {"forward": 8, "backward": 11}
"""Reads and writes of a score tile's elements by the blockwise attention's elementwise ops other than its
exponentials: forward the scale, mask, log-sum-exp's maximum and the shift (and the exponentials' output read by
the next matmul); backward the scale, mask and shift, then the shift by the output's row dot and the product with
the probabilities."""

BLOCKWISE_SCORE_EXPS = {"forward": 2, "backward": 1}
"""Exponentials of each score element: forward the log-sum-exp's and the probabilities'; backward the
probabilities' again.  Each reads and writes its elements (two passes where ``exp_rate`` is None)."""

BLOCKWISE_MATMULS = {"forward": 2, "backward": 5}
"""The blockwise attention's matmuls per tile: scores and output forward; recomputed scores, dv, dprobs, dq and
dk backward (:func:`~megalite.models.config.gpt_flops_per_token` counts four for the fused attention's backward,
which recomputes the scores too)."""


def layer_elements(config: GPTConfig, layout: Layout, seq_length: int, layer: int = 0) -> tuple[float, float]:
    """Elements the memory-bound ops of global layer ``layer`` read and write for one micro-batch on one rank,
    ``(forward, backward)``.

    Forward: the two norms (read, write), the two residual sums (two reads, a write), dropout's (read, write) when
    on, RoPE's rotation of q and k (a negated half, a concatenation, two products and a sum), the activation
    function (GELU reads and writes ``ffn``, SwiGLU reads ``2 ffn`` and writes ``ffn``), MoE's token permutation
    there and back (attention reads q/k/v strided: no layout copies).  Backward: each norm reads its input and
    output gradient and writes its input gradient, the gradient sums at the two branch points, the fused QKV
    split's gradient (one concatenation of the three pieces' gradients),
    RoPE, the activation's (GELU three, SwiGLU five per ``ffn``), the bias gradients' reductions, and the
    accumulation of the layer's weight gradients (read two, write one).
    """
    tp, cp = layout.tp, layout.cp
    tokens = layout.micro_batch_size * seq_length / cp
    sp_tokens = tokens / tp if layout.sequence_parallel and tp > 1 else tokens
    h, d = config.hidden_size, config.kv_channels
    q = config.num_attention_heads // tp * d
    kv = max(config.num_query_groups // tp, 1) * d
    qkv = tokens * (q + 2 * kv)
    forward = sp_tokens * h * (2 * 2 + 3 * 2)
    backward = sp_tokens * h * (3 * 2 + 3 * 2) + 2 * qkv
    if config.hidden_dropout > 0:
        forward += sp_tokens * h * 2 * 2
        backward += sp_tokens * h * 2 * 2
    if config.position_embedding_type == "rope":
        forward += 12 * tokens * (q + kv)
        backward += 12 * tokens * (q + kv)
    ffn, routed, swiglu = _activation_input(config, layout, seq_length, layer)
    forward += 2 * 2 * routed * h
    backward += 2 * 2 * routed * h
    forward += (3 if swiglu else 2) * ffn
    backward += (5 if swiglu else 3) * ffn
    if config.add_bias_linear:
        backward += qkv + (2 if swiglu else 1) * ffn + 2 * sp_tokens * h
    return forward, backward + _layer_weight_elements(config, layout, layer)


def _layer_weight_elements(config: GPTConfig, layout: Layout, layer: int) -> float:
    """Elements (of the activations' dtype) the accumulation of global layer ``layer``'s weight gradients reads
    and writes on one rank (read two, write one)."""
    params = sum(p.numel for p in layer_params(config, layer, layout))
    return 3 * params * _grad_bytes(layout) / DTYPE_BYTES[layout.precision]


def _head_weight_elements(config: GPTConfig, layout: Layout) -> float:
    """The same for the embedding's (and an untied output layer's) weight gradient."""
    matrices = 1 if not config.untie_embeddings_and_output_weights else 2
    return matrices * config.vocab_size / layout.tp * config.hidden_size * 3 * _grad_bytes(layout) \
        / DTYPE_BYTES[layout.precision]


def _activation_input(config: GPTConfig, layout: Layout, seq_length: int, layer: int) -> tuple[float, float, bool]:
    """``(elements, routed rows, SwiGLU)`` of global layer ``layer``'s activation function for one micro-batch on one
    rank: its ``ffn`` (per token, of this rank's MLP or experts), the rows an MoE layer routes (0 for a dense
    one), and whether it is SwiGLU."""
    tp = layout.tp
    tokens = layout.micro_batch_size * seq_length / layout.cp
    if not config.is_moe_layer(layer):
        return tokens * config.ffn_hidden_size / tp, 0.0, config.activation == "swiglu"
    moe = config.moe
    sp_tokens = tokens / tp if layout.sequence_parallel and tp > 1 else tokens
    routed = (sp_tokens if layout.sequence_parallel else tokens / tp) * moe.topk
    return routed * moe.ffn_hidden_size / layout.expert_tp, routed, moe.activation == "swiglu"


ACTIVATION_TRANSCENDENTALS = {"gelu": (1, 2), "swiglu": (1, 1)}
"""Transcendental functions per element of the activation's input, forward and backward: GELU's erf (or tanh)
forward, its cumulative distribution and density backward; SwiGLU's sigmoid forward and again backward."""

LOSS_TRANSCENDENTALS = (1, 1)
"""Per logit: the log-softmax's exponential forward, the softmax its gradient recomputes backward."""


def transcendental_elements(config: GPTConfig, layout: Layout, seq_length: int, layer: int) -> tuple[float, float]:
    """Elements global layer ``layer`` passes through a transcendental function (exp, erf, tanh) for one micro-batch
    on one rank, ``(forward, backward)``: its activation function's (:data:`ACTIVATION_TRANSCENDENTALS`).  A CPU
    core runs them far below its memory's rate (``exp_rate``); :func:`head_transcendentals` gives the loss's."""
    ffn, _, swiglu = _activation_input(config, layout, seq_length, layer)
    forward, backward = ACTIVATION_TRANSCENDENTALS["swiglu" if swiglu else "gelu"]
    return forward * ffn, backward * ffn


def head_transcendentals(config: GPTConfig, layout: Layout, seq_length: int) -> float:
    """Elements the loss passes through an exponential for one micro-batch on one rank (forward and backward):
    :data:`LOSS_TRANSCENDENTALS` per logit of the rank's vocabulary shard."""
    logits = layout.micro_batch_size * seq_length / layout.cp * config.vocab_size / layout.tp
    return sum(LOSS_TRANSCENDENTALS) * logits


def head_elements(config: GPTConfig, layout: Layout, seq_length: int) -> float:
    """Elements the embedding, final norm, logits and loss read and write for one micro-batch (forward and
    backward): the embedding's gather, the final norm, the cross entropy over the logits (log-softmax's max and
    normalisation, its backward's gradient and the loss's), and the accumulation of the embedding's (and an
    untied output layer's) weight gradient."""
    tp = layout.tp
    tokens = layout.micro_batch_size * seq_length / layout.cp
    sp_tokens = tokens / tp if layout.sequence_parallel and tp > 1 else tokens
    h, vocab = config.hidden_size, config.vocab_size / tp
    return 2 * sp_tokens * h + 5 * sp_tokens * h + 7 * tokens * vocab + _head_weight_elements(config, layout)


def _grad_bytes(layout: Layout) -> int:
    return 4 if layout.grad_reduce_in_fp32 or layout.fsdp else DTYPE_BYTES[layout.precision]


def _layer_kinds(config: GPTConfig) -> list[tuple[int, int]]:
    """``(a layer of each kind, how many)``: dense and MoE layers differ in their memory-bound work."""
    moe = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    return [(group[0], len(group)) for group in (dense, moe) if group]


@lru_cache(maxsize=256)
def blockwise_tiles(seq_length: int, cp: int, comm_type: str) -> tuple[dict, ...]:
    """The blockwise attention's tile work on each CP rank for one sequence, layer and micro-batch, by the rule
    the attention runs (:func:`~megalite.context_parallel.blockwise.tile_pairs` over the tokens of
    :func:`~megalite.context_parallel.sequence_split.chunk_indices`, default tile): ``pairs`` computed,
    ``masked`` (partly), ``scores`` (score elements per head: each pair's whole tile), ``calls`` (key blocks: the
    ring's ``cp`` steps, else one), ``written`` (query tiles with a pair, summed over calls; ``whole`` of them the
    rank's whole query block) and ``merges`` (of
    partial outputs: within a query tile's pairs, and between the ring's steps).  The all-gather variant attends
    the rank's queries to every rank's keys; the all-to-all one the whole sequence (with ``1 / cp`` of the
    heads, the same on every rank)."""
    import torch

    from megalite.context_parallel.blockwise import DEFAULT_TILE, Tokens, tile_pairs
    from megalite.context_parallel.sequence_split import chunk_indices

    def tokens(ranks) -> Tokens:
        return Tokens(torch.cat([chunk_indices(seq_length, cp, r) for r in ranks]), None, DEFAULT_TILE)

    everyone, own = tokens(range(cp)), [tokens([r]) for r in range(cp)]
    out = []
    for rank in range(1 if comm_type == "a2a" else cp):
        if comm_type == "p2p":
            calls = [(own[rank], own[r]) for r in range(cp)]
        else:
            calls = [(everyone if comm_type == "a2a" else own[rank], everyone)]
        work = {"pairs": 0, "masked": 0, "scores": 0, "calls": len(calls), "written": 0, "whole": 0,
                "merges": len(calls) - 1}
        for queries, keys in calls:
            per_tile: dict = {}
            for qt, kt, whole in tile_pairs(queries, keys):
                (qa, qb), (ka, kb) = queries.tiles[qt], keys.tiles[kt]
                work["pairs"] += 1
                work["masked"] += not whole
                work["scores"] += (qb - qa) * (kb - ka)
                per_tile[qt] = per_tile.get(qt, 0) + 1
            work["written"] += len(per_tile)
            work["whole"] += len(per_tile) if len(queries.tiles) == 1 else 0
            work["merges"] += sum(n - 1 for n in per_tile.values())
        out.append(work)
    return tuple(out)


def blockwise_forward_extra_ops(work: dict) -> int:
    """Forward ops of one rank's blockwise attention beside its pairs and calls: its tiles' writes and merges."""
    whole = work["whole"]
    return ((work["written"] - whole) * BLOCKWISE_WRITE_OPS["tile"] + whole * BLOCKWISE_WRITE_OPS["whole"]
            + work["merges"] * BLOCKWISE_MERGE_OPS)


def _blockwise_attention(config: GPTConfig, layout: Layout, hw: Hardware, seq_length: int, forwards: int,
                         gemm_rate: float) -> dict:
    """Seconds of context parallelism's blockwise attention per micro-batch and layer on the slowest CP rank.

    Each rank computes the tile pairs of :func:`blockwise_tiles` (the load-balanced chunks give every rank the
    same causal share, but not the same tiles: a rank whose two chunks are adjacent holds one tile, and
    the diagonal pairs are computed whole).  Their matmuls (:data:`BLOCKWISE_MATMULS`) run at the GEMM rate, their
    score elements pass through memory :data:`BLOCKWISE_SCORE_PASSES` times in fp32 and through
    :data:`BLOCKWISE_SCORE_EXPS` exponentials at ``exp_rate`` (on a CPU far below the memory's rate), and each
    pair, call, written tile and merge runs its ops (:data:`BLOCKWISE_PAIR_OPS` and those after it).
    """
    heads, d = config.num_attention_heads // layout.tp, config.kv_channels
    if layout.cp_comm_type == "a2a":
        heads //= layout.cp
    matmuls = forwards * BLOCKWISE_MATMULS["forward"] + BLOCKWISE_MATMULS["backward"]
    passes = forwards * BLOCKWISE_SCORE_PASSES["forward"] + BLOCKWISE_SCORE_PASSES["backward"]
    exps = forwards * BLOCKWISE_SCORE_EXPS["forward"] + BLOCKWISE_SCORE_EXPS["backward"]
    exp_rate = hw.hbm_bandwidth / (2 * 4) if hw.exp_rate is None else hw.exp_rate
    slowest = None
    for work in blockwise_tiles(seq_length, layout.cp, layout.cp_comm_type):
        scores = layout.micro_batch_size * heads * work["scores"]
        ops = forwards * blockwise_forward_extra_ops(work)
        for phase, times in (("forward", forwards), ("backward", 1)):
            ops += times * (work["pairs"] * BLOCKWISE_PAIR_OPS[phase] + work["masked"] * BLOCKWISE_MASK_OPS[phase]
                            + work["calls"] * BLOCKWISE_CALL_OPS[phase])
        seconds = {"attention": matmuls * 2 * scores * d / gemm_rate,
                   "memory_bound": passes * scores * 4 / hw.hbm_bandwidth + exps * scores / exp_rate,
                   "op_overhead": ops * hw.op_overhead_s}
        if slowest is None or sum(seconds.values()) > sum(slowest.values()):
            slowest = seconds
    return slowest


def compute_time(config: GPTConfig, layout: Layout, hw: Hardware, seq_length: int, global_batch_size: int,
                 ops: str | None = None) -> dict:
    """Seconds of one step's compute on one rank, by kind: ``gemm``, ``attention``, ``memory_bound``,
    ``op_overhead``.

    ``ops``: whose memory-bound ops run: megalite's (None), or torchtitan's eager Llama
    (:data:`~megalite.plan.eager.TORCHTITAN_EAGER`, on a GPU profile and without context parallelism)."""
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    rows = layout.micro_batch_size * seq_length / layout.cp
    gemm_rate = hw.peak(layout.precision) * hw.gemm_efficiency(rows)
    tokens = global_batch_size * seq_length / layout.world
    flops_per_token = gpt_flops_per_token(config, seq_length)
    h, d = config.hidden_size, config.kv_channels
    attention_forward = 4 * seq_length * config.num_attention_heads * d * config.num_layers
    forwards = 2 if layout.recompute == "full" else 1
    gemm = flops_per_token - 3 * attention_forward
    if layout.recompute == "full":
        gemm += (flops_per_token - 6.0 * h * config.vocab_size) / 3 - attention_forward
    elif layout.recompute == TORCHTITAN_OP:
        gemm += op_recompute_flops_per_token(config)
    layers = config.num_layers / layout.pp
    out = {"gemm": tokens * gemm / gemm_rate, "attention": 0.0, "memory_bound": 0.0, "op_overhead": 0.0}
    if layout.cp > 1:
        blockwise = _blockwise_attention(config, layout, hw, seq_length, forwards, gemm_rate)
        for kind, seconds in blockwise.items():
            out[kind] += m * layers * seconds
    else:
        recomputed = 4 if layout.recompute in ("full", "selective") else 3
        out["attention"] = tokens * recomputed * attention_forward / hw.attention_rate(layout.precision, rows)
        # each token's query meets seq keys per head and layer; the softmax's cost per score, forward and backward
        scores = seq_length * config.num_attention_heads * config.num_layers
        out["attention"] += tokens * recomputed / 3 * scores * hw.attention_score_s
    e = DTYPE_BYTES[layout.precision]
    if ops == TORCHTITAN_EAGER:
        if hw.exp_rate is not None or layout.cp > 1:
            raise ValueError(f"ops {ops!r} models torchtitan's eager Llama on a GPU without context parallelism")
        weights = sum(count * _layer_weight_elements(config, layout, layer) for layer, count in _layer_kinds(config))
        weights = (weights + _head_weight_elements(config, layout)) * e / layout.pp
        out.update(eager_time(config, layout, hw.hbm_bandwidth, hw.op_overhead_s, seq_length, m, weights))
        return out
    elements = 0.0
    for layer, count in _layer_kinds(config):
        fwd, bwd = layer_elements(config, layout, seq_length, layer)
        elements += count * (forwards * fwd + bwd) / layout.pp
    elements += head_elements(config, layout, seq_length) / layout.pp
    out["memory_bound"] += m * elements * e / hw.hbm_bandwidth
    if hw.exp_rate is not None:  # on a GPU the special function units keep up with the memory's passes above
        functions = head_transcendentals(config, layout, seq_length) / layout.pp
        for layer, count in _layer_kinds(config):
            fwd, bwd = transcendental_elements(config, layout, seq_length, layer)
            functions += count * (forwards * fwd + bwd) / layout.pp
        # each costs what an exponential (a read and a write, as exp_rate is timed) takes beyond such a pass
        out["memory_bound"] += m * functions * max(0.0, 1 / hw.exp_rate - 2 * e / hw.hbm_bandwidth)
    layer_ops = forwards * LAYER_OPS["forward"] + LAYER_OPS["backward"]
    if config.position_embedding_type == "rope":
        layer_ops += forwards * ROPE_OPS["forward"] + ROPE_OPS["backward"]
    ops = layers * layer_ops + sum(EMBEDDING_AND_LOSS_OPS.values()) / layout.pp
    out["op_overhead"] += m * ops * hw.op_overhead_s
    return out


def overlaps_communication(hw: Hardware, world: int) -> bool:
    """Whether communication can run beside compute: on GPUs (copy engines and NICs do it), or on CPUs with a core
    no rank computes on.  When every core runs a rank's compute, a collective's copies, reductions and socket work
    take the same cores, so none of it hides."""
    return hw.cores is None or world < hw.cores


def oversubscribed(hw: Hardware, world: int, busy: float, step: float) -> float:
    """Seconds a step of ``step`` seconds is stretched when ``world`` ranks, each busy ``busy`` seconds of it,
    share ``hw.cores`` cores: the cores run at most ``cores`` ranks' work at a time, so the step takes at least
    ``world * busy / cores``."""
    if hw.cores is None or world <= hw.cores:
        return 0.0
    return max(0.0, world * busy / hw.cores - step)
