"""The actor's per-token log-probs and entropy from vocabulary-sharded logits.

Log-probs and entropy come from ``vocab_parallel_log_probs`` and
``vocab_parallel_entropy``: only per-token statistics cross TP ranks, the full
vocabulary is never gathered.  Under pipeline parallelism a forward-only
schedule computes them micro-batch by micro-batch on the last stage and
broadcasts them to every stage.
"""

from __future__ import annotations

import torch

from megalite import batch_invariant
from megalite.distributed.unwrap import unwrap
from megalite.pipeline import broadcast_from_last_stage, forward_backward
from megalite.rlhf.shared_groups import RowLogits, forward_rows
from megalite.tensor_parallel import (gather_from_tensor_parallel_region, vocab_parallel_entropy,
                                      vocab_parallel_log_probs)
from megalite.topology import resolve_group


def token_log_probs(logits_shard: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    chunk_size: int | None = None, with_entropy: bool = False,
                    tp_group=None, invariant_vocab: int | None = None,
                    rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)[token]`` ``[b, s]`` and optionally the entropy ``[b, s]`` (fp32).

    ``logits_shard [b, s, v/tp]``, or with ``rows [b, s]`` (a packed forward's
    :class:`~megalite.rlhf.shared_groups.RowLogits`) ``[u, v/tp]`` rows of which column ``(i, j)`` reads
    ``rows[i, j]``: each row's softmax is then computed once however many columns read it (expanded to ``[b, s]``
    first with ``chunk_size`` or ``invariant_vocab``).  ``chunk_size`` bounds how many sequence
    positions are processed at once, which bounds the fp32 temporaries.
    ``invariant_vocab`` (a batch-invariant model's vocabulary size, see :func:`invariant_vocab`): the log-probs
    come from the gathered first ``invariant_vocab`` logits by ``batch_invariant.log_probs``, the rollout engine's
    expression, so they equal the engine's bit for bit.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if rows is not None and (chunk_size is not None or invariant_vocab is not None):
        logits_shard, rows = logits_shard[rows], None
    if rows is not None:
        logits = logits_shard / temperature if temperature != 1.0 else logits_shard
        log_probs = vocab_parallel_log_probs(logits, tokens, tp_group=tp_group, rows=rows)
        return log_probs, vocab_parallel_entropy(logits, tp_group=tp_group)[rows] if with_entropy else None
    if tuple(tokens.shape) != tuple(logits_shard.shape[:2]):
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match logits {tuple(logits_shard.shape)}")
    seq = tokens.shape[1]
    step = seq if chunk_size is None else chunk_size
    if step < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    log_probs, entropies = [], []
    for start in range(0, seq, step):
        logits = logits_shard[:, start:start + step]
        if invariant_vocab is not None:
            full = gather_from_tensor_parallel_region(logits, resolve_group(tp_group, "tp"))[..., :invariant_vocab]
            log_probs.append(batch_invariant.log_probs(full, temperature).gather(
                -1, tokens[:, start:start + step, None])[..., 0])
        if temperature != 1.0:
            logits = logits / temperature
        if invariant_vocab is None:
            log_probs.append(vocab_parallel_log_probs(logits, tokens[:, start:start + step], tp_group=tp_group))
        if with_entropy:
            entropies.append(vocab_parallel_entropy(logits, tp_group=tp_group))
    return torch.cat(log_probs, dim=1), torch.cat(entropies, dim=1) if with_entropy else None


def next_token_log_probs(output, input_ids: torch.Tensor, model, temperature: float = 1.0,
                         chunk_size: int | None = None,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_log_probs` ``[b, s-1]`` of ``input_ids[:, 1:]`` from ``model``'s last-stage ``output`` for
    ``input_ids``: logits ``[b, s, v/tp]``, or a packed forward's :class:`RowLogits` (``shared_groups``)."""
    options = {"tp_group": tp_group_of(model), "invariant_vocab": invariant_vocab(model)}
    if isinstance(output, RowLogits):
        return token_log_probs(output.logits, input_ids[:, 1:], temperature, chunk_size, with_entropy,
                               rows=output.rows[:, :-1], **options)
    return token_log_probs(output[:, :-1], input_ids[:, 1:], temperature, chunk_size, with_entropy, **options)


def sequence_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       temperature: float = 1.0, chunk_size: int | None = None,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[b, s-1]`` of ``input_ids[:, 1:]`` given their prefixes, with a whole (unpipelined) model."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return next_token_log_probs(model(input_ids, attention_mask=attention_mask), input_ids, model, temperature,
                                chunk_size, with_entropy)


def tp_group_of(model):
    """The model's tensor-parallel group; a user's own module (TrainingService ``"ddp"``/``"fsdp2"``) has none."""
    return getattr(unwrap(model), "tp_group", None)


def invariant_vocab(model) -> int | None:
    """The vocabulary size of a batch-invariant model (``GPTConfig.batch_invariant``), else None (also for a
    user's own module, which has no GPTConfig)."""
    config = getattr(unwrap(model), "config", None)
    return config.vocab_size if getattr(config, "batch_invariant", False) else None


def _iterators(model_chunks, micro_batches):
    """One iterator over the micro-batches per model chunk (each chunk reads its masks)."""
    if isinstance(model_chunks, (list, tuple)):
        return [iter(micro_batches) for _ in model_chunks]
    return iter(micro_batches)


def pipeline_log_probs(model_chunks, micro_batches: list[dict], temperature: float = 1.0,
                       chunk_size: int | None = None, with_entropy: bool = False,
                       pp_group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward-only log-probs over micro-batches of a pipelined model, on every stage.

    ``micro_batches``: dicts with ``input_ids`` and ``attention_mask`` ``[mb, s]``
    (every stage gets the same list).  ``model_chunks`` is this rank's chunk, or
    its list of chunks under an interleaved (vpp > 1) pipeline.  Returns the concatenated ``[B, s-1]``
    log-probs (and entropy) on every pipeline rank, on the CPU.  A micro-batch with ``packed`` rows (a prompt's
    samples as one prefix-shared row, :func:`megalite.rlhf.shared_groups.with_packing`) runs them.
    """
    if not micro_batches:
        raise ValueError("pipeline_log_probs needs at least one micro-batch, got 0")
    pp_group = resolve_group(pp_group, "pp")

    def forward_step(iterator, chunk):
        batch = next(iterator)
        output = forward_rows(chunk, batch["input_ids"], batch["attention_mask"], batch.get("packed"))

        def collect(logits):
            lp, ent = next_token_log_probs(logits, batch["input_ids"], chunk, temperature, chunk_size, with_entropy)
            return lp.sum() * 0.0, {"log_probs": lp, "entropy": ent}

        return output, collect

    with torch.no_grad():
        results = forward_backward(forward_step, _iterators(model_chunks, micro_batches), model_chunks,
                                   len(micro_batches),
                                   forward_only=True, pp_group=pp_group)
    results = broadcast_from_last_stage([(r["log_probs"].cpu(), None if r["entropy"] is None else r["entropy"].cpu())
                                         for r in results], pp_group)
    log_probs = torch.cat([lp for lp, _ in results])
    entropy = torch.cat([ent for _, ent in results]) if with_entropy else None
    return log_probs, entropy
