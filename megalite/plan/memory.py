"""Exact bytes of weights, gradients and optimizer state on one rank, from the config and layout alone.

The parameters are listed in the order ``GPTModel.parameters()`` yields them
(a module's own parameters before its children's), with the TP / EP / ETP shard
shapes the layers create.  The DDP gradient buffer is then laid out as
:class:`~megalite.distributed.grad_buffer.GradBuffer` lays it out (backward
order, buckets, ZeRO-1 padding to a multiple of the DP size, a tied embedding in
a bucket of its own), and the optimizer state follows
:class:`~megalite.optim.optimizer.MixedPrecisionOptimizer`: an fp32 main copy
for half-precision parameters, an fp32 gradient copy when gradients are reduced
in half precision, AdamW's two moments and its step counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.models.config import GPTConfig
from megalite.plan.layout import Layout
from megalite.tensor_parallel.vocab_embedding import pad_vocab_size

ADAM_STEP_BYTES = 4
"""AdamW's per-parameter ``step`` counter (a 0-d fp32 tensor in torch's fused and foreach AdamW)."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of a rank: its local shape, whether it is an expert weight, tied across stages,
    replicated over TP with a partial gradient under sequence parallelism (summed over TP after the step's
    last micro-batch)."""

    shape: tuple[int, ...]
    expert: bool = False
    shared_embedding: bool = False
    sequence_parallel: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _norm(config: GPTConfig, size: int | None = None) -> list[ParamSpec]:
    h = config.hidden_size if size is None else size
    return [ParamSpec((h,), sequence_parallel=True)] * (2 if config.normalization == "LayerNorm" else 1)


def _row_bias(config: GPTConfig) -> list[ParamSpec]:
    return [ParamSpec((config.hidden_size,), sequence_parallel=True)] if config.add_bias_linear else []


def _linear(out_features: int, in_features: int, bias: bool, bias_size: int | None = None) -> list[ParamSpec]:
    specs = [ParamSpec((out_features, in_features))]
    if bias:
        specs.append(ParamSpec((out_features if bias_size is None else bias_size,)))
    return specs


def _mlp(config: GPTConfig, ffn: int, tp: int) -> list[ParamSpec]:
    h, bias = config.hidden_size, config.add_bias_linear
    rows = (2 if config.activation == "swiglu" else 1) * ffn // tp
    return _linear(rows, h, bias) + [ParamSpec((h, ffn // tp))] + _row_bias(config)


def _moe(config: GPTConfig, layout: Layout) -> list[ParamSpec]:
    moe, h = config.moe, config.hidden_size
    local = moe.num_experts // layout.ep
    shard = moe.ffn_hidden_size // layout.expert_tp
    rows = 2 * shard if moe.activation == "swiglu" else shard
    # The shared expert's gate and the router see the sequence-parallel tokens: their gradients are summed over TP.
    specs = [ParamSpec((1, h), sequence_parallel=True)] if moe.shared_expert_gate else []
    specs.append(ParamSpec((moe.num_experts, h), sequence_parallel=True))
    specs += [ParamSpec((local, rows, h), expert=True), ParamSpec((local, h, shard), expert=True)]
    if moe.add_bias:
        specs += [ParamSpec((local, rows), expert=True), ParamSpec((local, h), expert=True)]
    if moe.shared_expert_intermediate_size is not None:
        specs += _mlp(config, moe.shared_expert_intermediate_size, layout.tp)
    return specs


def mla_params(config: GPTConfig, tp: int) -> list[ParamSpec]:
    """Multi-latent attention's parameters on one TP rank (:class:`~megalite.models.mla.MultiLatentAttention`):
    the replicated down-projections and latent norms, the column-parallel up-projections, the row output."""
    h, heads, rope = config.hidden_size, config.num_attention_heads, config.qk_pos_emb_head_dim
    q_size = heads * (config.qk_head_dim + rope) // tp
    if config.q_lora_rank is None:
        specs = [ParamSpec((q_size, h))]
    else:
        specs = [ParamSpec((config.q_lora_rank, h), sequence_parallel=True)] + _norm(config, config.q_lora_rank)
        specs.append(ParamSpec((q_size, config.q_lora_rank)))
    specs += [ParamSpec((config.kv_lora_rank + rope, h), sequence_parallel=True)] + _norm(config, config.kv_lora_rank)
    specs.append(ParamSpec((heads * (config.qk_head_dim + config.v_head_dim) // tp, config.kv_lora_rank)))
    return specs + [ParamSpec((h, heads * config.v_head_dim // tp))] + _row_bias(config)


def layer_params(config: GPTConfig, layer: int, layout: Layout) -> list[ParamSpec]:
    """Parameters of global transformer layer ``layer`` on one rank, in registration order."""
    tp, h, d = layout.tp, config.hidden_size, config.kv_channels
    groups, heads = config.num_query_groups, config.num_attention_heads
    specs = _norm(config)
    if config.multi_latent_attention:
        specs += mla_params(config, tp)
    else:
        qkv = groups * (heads // groups + 2) * d
        specs += _linear(qkv // tp, h, config.add_bias_linear)
        specs += [ParamSpec((h, heads * d // tp))] + _row_bias(config)
    specs += _norm(config)
    specs += _moe(config, layout) if config.is_moe_layer(layer) else _mlp(config, config.ffn_hidden_size, tp)
    return specs


def chunk_params(config: GPTConfig, layout: Layout, pre_process: bool, post_process: bool,
                 layer_range: tuple[int, int]) -> list[ParamSpec]:
    """Parameters of one model chunk (``GPTModel``) on one rank, in ``parameters()`` order."""
    tied = not config.untie_embeddings_and_output_weights
    vocab = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, layout.tp) // layout.tp
    h = config.hidden_size
    depths = config.mtp_num_layers or 0
    copy = bool(depths) and post_process and not pre_process  # MTP's word embedding on a separate last stage
    specs = []
    if pre_process:
        specs.append(ParamSpec((vocab, h), shared_embedding=(tied or bool(depths)) and not post_process))
        if config.position_embedding_type == "learned_absolute":
            specs.append(ParamSpec((config.max_position_embeddings, h)))
    for layer in range(*layer_range):
        specs += layer_params(config, layer, layout)
    if post_process:
        specs += _norm(config)
        if not (tied and (pre_process or copy)):
            specs.append(ParamSpec((vocab, h), shared_embedding=tied))
        if copy:
            specs.append(ParamSpec((vocab, h), shared_embedding=True))
        for depth in range(depths):  # enorm, hnorm, eh_proj, the layer, final norm
            specs += _norm(config) + _norm(config) + [ParamSpec((h // layout.tp, 2 * h))]
            specs += layer_params(config, config.num_layers + depth, layout) + _norm(config)
    return specs


def rank_chunks(config: GPTConfig, layout: Layout, pp_rank: int) -> list[list[ParamSpec]]:
    """The parameters of each model chunk pipeline rank ``pp_rank`` builds."""
    stages = layout.stage_map()
    ranges = layout.chunk_ranges(config.num_layers)[pp_rank]
    return [chunk_params(config, layout, stages.is_first(pp_rank, c), stages.is_last(pp_rank, c), r)
            for c, r in enumerate(ranges)]


def _buffer_layout(params: list[ParamSpec], bucket_size: int | None, dp: int, shard: bool):
    """``GradBuffer``'s flat layout: each parameter's ``(start, end)`` and each bucket's ``(start, end)``."""
    ranges, buckets = [], []
    offset = start = 0
    count = 0

    def close():
        nonlocal offset, start, count
        if shard:
            offset += -offset % dp
        buckets.append((start, offset))
        start, count = offset, 0

    for p in params:
        if p.shared_embedding and count:
            close()
        ranges.append((offset, offset + p.numel))
        offset += p.numel
        count += 1
        if p.shared_embedding or (bucket_size is not None and offset - start >= bucket_size):
            close()
    if count:
        close()
    return ranges, buckets, offset


def _owned(ranges, buckets, dp: int, dp_rank: int) -> list[int]:
    """Elements of each parameter that rank ``dp_rank`` of a sharded buffer updates."""
    owned, b = [], 0
    for start, end in ranges:
        while start >= buckets[b][1]:
            b += 1
        lo_b, hi_b = buckets[b]
        size = (hi_b - lo_b) // dp
        lo, hi = max(start, lo_b + dp_rank * size), min(end, lo_b + (dp_rank + 1) * size)
        owned.append(max(0, hi - lo))
    return owned


@dataclass
class StateBytes:
    """Bytes a rank holds in model weights, gradients and optimizer state."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0

    def add(self, other: "StateBytes") -> None:
        self.weights += other.weights
        self.grads += other.grads
        self.optimizer += other.optimizer


def _optimizer_bytes(owned: list[int], param_bytes: int, grad_bytes: int) -> int:
    total = 0
    for n in owned:
        if n == 0:
            continue
        total += 8 * n + ADAM_STEP_BYTES
        total += 4 * n if param_bytes != 4 else 0
        total += 4 * n if grad_bytes != 4 else 0
    return total


def ddp_buffer(params: list[ParamSpec], layout: Layout, expert: bool):
    """The gradient buffer DDP builds for one chunk's dense (or expert) parameters: ``(its parameters in
    backward order, each one's range, each bucket's range, elements)``; None when the chunk has none."""
    group = [p for p in reversed(params) if p.expert == expert]
    if not group:
        return None
    dp = layout.expert_dp if expert else layout.dp * layout.cp
    return (group, *_buffer_layout(group, layout.bucket_size, dp, layout.zero1))


def _ddp_chunk(params: list[ParamSpec], layout: Layout, dp_rank: int, edp_rank: int) -> StateBytes:
    out = StateBytes()
    pbytes = layout.param_bytes
    gbytes = 4 if layout.grad_reduce_in_fp32 else pbytes
    for expert in (False, True):
        buffer = ddp_buffer(params, layout, expert)
        if buffer is None:
            continue
        group, ranges, buckets, numel = buffer
        dp, rank = (layout.expert_dp, edp_rank) if expert else (layout.dp * layout.cp, dp_rank)
        out.grads += numel * gbytes
        out.weights += numel * pbytes if layout.zero1 else sum(p.numel for p in group) * pbytes
        owned = _owned(ranges, buckets, dp, rank) if layout.zero1 else [p.numel for p in group]
        out.optimizer += _optimizer_bytes(owned, pbytes, gbytes)
    return out


def fsdp_rows(rows: int, size: int, rank: int) -> int:
    """Rows of a ``rows``-row parameter that FSDP2 places on ``rank`` of ``size`` (ceil-sized shards)."""
    per = -(-rows // size)
    return max(0, min((rank + 1) * per, rows) - min(rank * per, rows))


def _fsdp_chunk(params: list[ParamSpec], layout: Layout, dp_rank: int, edp_rank: int) -> StateBytes:
    out = StateBytes()
    for p in params:
        size, rank = (layout.expert_dp, edp_rank) if p.expert else (layout.dp * layout.cp, dp_rank)
        n = fsdp_rows(p.shape[0], size, rank) * (p.numel // p.shape[0])
        out.weights += 4 * n
        out.grads += 4 * n
        out.optimizer += _optimizer_bytes([n], 4, 4)
    return out


def rank_state_bytes(config: GPTConfig, layout: Layout, pp_rank: int = 0, dp_rank: int = 0,
                     expert_dp_rank: int = 0) -> StateBytes:
    """Weights, gradient-buffer and optimizer-state bytes of one rank (``dp_rank`` ranges over dp x cp).

    Rank 0 of each data-parallel group holds the most: ZeRO-1 and FSDP2 padding falls on the last ranks.
    """
    total = StateBytes()
    step = _fsdp_chunk if layout.fsdp else _ddp_chunk
    for params in rank_chunks(config, layout, pp_rank):
        total.add(step(params, layout, dp_rank, expert_dp_rank))
    return total
