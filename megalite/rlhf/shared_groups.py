"""Prefix-shared rollout groups: the forward of ``n`` rollouts of one prompt as one row, the prompt computed once.

A GRPO group is ``n`` responses to one prompt, so the trainer's forwards (the reference's and old log-probs, the
update's forward and backward) would compute every prompt token ``n`` times.  :func:`pack_rows` lays each run of
``n`` consecutive rows out as one row with every token they share once and each row's rest as a branch
(:func:`megalite.rlhf.preference.shared_prefix`, the rule DPO's shared pairs use; a branch sees the trunk and
itself, its positions continue from the trunk's), and the output layer runs only on the packed positions some
row reads (:class:`RowLogits`: each once, each column of the rollout's ``[b, s]`` layout pointing at its own).
A row's last real token is not packed at all: its output would predict the token after the row, which no
log-prob reads.  Every other real token's output is the one the unshared row gives (the same tokens before it,
the same positions), so log-probs, losses and gradients are unchanged; columns of padding and each row's last
real token take the packed row's first output (finite; every loss masks them).
Rows need not share anything: a group whose rows share no token is packed as separate documents of one row.
An iteration's forwards (reference, old log-probs, each update epoch) run the same rows, so the trainer packs them
once (:func:`pack_micro_batches`, kept on the :class:`~megalite.rlhf.rollout_batch.Rollout`) and hands that
packing to each forward (:func:`with_packing`, a micro-batch's ``"packed"``, which :func:`forward_rows` runs).

A model shares prefixes (:func:`shares_prefixes`) when its attention takes packed documents: megalite's GPT
without context parallelism or batch-invariant mode (a sliding window measures distance along each sequence, a
branch following its trunk, so windowed models share too).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import chain

import torch

from megalite.context_parallel.sequence_split import BRANCH, reset_position_ids
from megalite.distributed import FullyShardedDataParallel
from megalite.distributed.unwrap import unwrap
from megalite.rlhf.preference import shared_prefix


def row_group(args) -> int | None:
    """How many consecutive rows the RL trainer's forwards share a prefix over: a prompt's
    ``--n-samples-per-prompt`` samples, or None under ``--no-shared-prompt-rows``."""
    return None if args.no_shared_prompt_rows else args.n_samples_per_prompt


def shares_prefixes(model) -> bool:
    """Whether ``model`` (a chunk, optionally wrapped) can run :func:`pack_rows`'s rows exactly."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    return (config is not None and hasattr(inner, "cp_size") and inner.cp_size == 1
            and not getattr(config, "batch_invariant", False))


@dataclass
class PackedRows:
    """``tokens``/``position_ids``/``document_ids`` ``[g, S]``: the packed rows; ``index`` ``[b, s]``: for each
    column of the unshared rows, the flat position (into ``g * S``) whose output it takes; ``outputs`` ``[u]``: the
    distinct positions some column takes (sorted), and ``rows`` ``[b, s]``: each column's one among them."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    index: torch.Tensor
    outputs: torch.Tensor
    rows: torch.Tensor


@dataclass
class RowLogits:
    """A packed forward's logits (:func:`forward_rows` on the last stage): ``logits [u, v/tp]`` at the packed
    positions the rows read, each once however many rows read it (a GRPO group's last prompt token is read by all
    its samples), and ``rows [b, s]``: for each column of the unshared rows, its row of ``logits``.
    :func:`megalite.rlhf.actor.next_token_log_probs` scores tokens on them without expanding them to ``[b, s]``."""

    logits: torch.Tensor
    rows: torch.Tensor

    def expand(self) -> torch.Tensor:
        """The unshared rows' logits ``[b, s, v/tp]``."""
        return self.logits[self.rows]


ROW_TOKENS = 32
"""Groups share a packed row while it holds at most this many tokens (or the longest group's): on rows this short
attention costs more per row than per token (one thread, 4 heads of 16: flash attention forward and backward
takes 0.50 ms on ``[16 rows, 24 tokens]`` against 0.77 ms on ``[32, 13]``), so fewer, longer rows are cheaper."""


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, group: int, pad_id: int = 0,
              multiple: int = 1) -> PackedRows:
    """Each ``group`` consecutive rows of ``input_ids [b, s]`` (real tokens: ``attention_mask``, contiguous in a
    row, as left-padded prompts followed by responses are) packed as their shared prefix and branches; the last
    group takes the rows left over.  A row's last real token is left out: its output predicts the token after the
    row, which no log-prob reads (that column, like the padding's, takes the first packed output).  The trunk
    holds every token the rows share (``shared_prefix`` with ``label_split=False``): their one output is gathered
    into each row.  Groups are laid side by side as documents of one packed row while it stays within
    :data:`ROW_TOKENS` tokens or the longest group's (first fit, longest first); rows are padded with ``pad_id``
    (a document of its own) to the longest (at least one token), rounded up to ``multiple`` (sequence
    parallelism's TP size)."""
    b, width = input_ids.shape
    real = attention_mask.bool()
    runs = real[:, 0].long() + (real[:, 1:] & ~real[:, :-1]).sum(dim=1)  # runs of real tokens per row
    if bool((runs != 1).any()):
        row = int((runs != 1).nonzero()[0, 0])
        raise ValueError(f"row {row}'s real tokens must be one contiguous run of at least one token")
    firsts, lengths = real.long().argmax(dim=1).tolist(), real.sum(dim=1).tolist()
    ids = input_ids.tolist()
    groups, where = [], []  # (tokens, documents) per group; per row, each column's position in its group or -1
    for start in range(0, b, group):
        spans = [(firsts[r], lengths[r] - 1) for r in range(start, min(b, start + group))]  # the last token left out
        tokens, _, docs, trunk = shared_prefix([(ids[r][c:c + n], [1] * n) for r, (c, n) in
                                                enumerate(spans, start)], label_split=False)
        offset = trunk
        for c, n in spans:  # every row holds the trunk, then its branch
            where.append([-1] * c + list(range(trunk)) + list(range(offset, offset + n - trunk))
                         + [-1] * (width - c - n))
            offset += n - trunk
        groups.append((tokens, docs))
    capacity = max(ROW_TOKENS, *(len(tokens) for tokens, _ in groups))
    rows: list[list[int]] = []  # the groups of each packed row
    used: list[int] = []
    for g in sorted(range(len(groups)), key=lambda g: -len(groups[g][0])):
        size = len(groups[g][0])
        row = next((r for r, n in enumerate(used) if n + size <= capacity), None)
        if row is None:
            rows.append([]), used.append(0)
            row = len(rows) - 1
        rows[row].append(g)
        used[row] += size
    longest = -(-max(1, *used) // multiple) * multiple
    packed, documents, starts = [], [], [0] * len(groups)
    for r, members in enumerate(rows):
        tokens, docs, next_doc = [], [], 0
        for g in sorted(members):  # each group's documents numbered after the row's earlier groups'
            starts[g] = r * longest + len(tokens)
            tokens += groups[g][0]
            docs += [d + next_doc for d in groups[g][1]]
            next_doc += max((d % BRANCH for d in groups[g][1]), default=-1) + 1
        pad = longest - len(tokens)
        packed.append(tokens + [pad_id] * pad)
        documents.append(docs + [next_doc] * pad)  # the padding: a document of its own
    documents = _long_tensor(documents, longest)
    # The padding's positions are 0: a packed row may be longer than the model's position table.
    fill = torch.arange(longest) >= torch.tensor([sum(len(groups[g][0]) for g in m) for m in rows])[:, None]
    positions = reset_position_ids(documents).masked_fill_(fill, 0)
    local = _long_tensor(where, width)
    flat = torch.where(local >= 0, local + torch.tensor(starts).repeat_interleave(group)[:b, None], 0)
    outputs, rows_read = torch.unique(flat, return_inverse=True)
    device = input_ids.device
    return PackedRows(_long_tensor(packed, longest).to(device=device, dtype=input_ids.dtype), positions.to(device),
                      documents.to(device), flat.to(device), outputs.to(device), rows_read.to(device))


def _long_tensor(rows: list[list[int]], width: int) -> torch.Tensor:
    """``torch.tensor(rows)`` (int64) of rows of ``width`` ints, built through one flat array: several times faster
    than from the nested lists, which matters at one packing per iteration."""
    flat = array("q", chain.from_iterable(rows))
    return torch.frombuffer(flat, dtype=torch.int64).view(len(rows), width) if flat else torch.zeros(
        len(rows), width, dtype=torch.int64)


def pack_micro_batches(micro_batches: list[dict], group: int | None, model) -> tuple[PackedRows, ...] | None:
    """Each micro-batch's rows (``input_ids``/``attention_mask``) packed by :func:`pack_rows` for ``model``'s
    forwards (padded to its sequence-parallel TP size), one :class:`PackedRows` per micro-batch; None (the plain
    padded forwards) when ``group`` < 2 or the model does not share prefixes (:func:`shares_prefixes`).  Pack once
    and hand the result to every forward of these rows (:func:`with_packing`)."""
    if not group or group < 2 or not shares_prefixes(model):
        return None
    inner = unwrap(model)
    multiple = inner.tp_size if getattr(inner, "sequence_parallel", False) else 1
    return tuple(pack_rows(mb["input_ids"], mb["attention_mask"], group, multiple=multiple) for mb in micro_batches)


def with_packing(micro_batches: list[dict], packing: tuple[PackedRows, ...] | None) -> list[dict]:
    """``micro_batches`` each with its packed rows under ``"packed"`` (``packing`` from :func:`pack_micro_batches`
    of the same micro-batches); unchanged for None.  A packing of other rows is a ValueError."""
    if packing is None:
        return micro_batches
    if len(packing) != len(micro_batches) or any(tuple(p.index.shape) != tuple(mb["input_ids"].shape)
                                                 for p, mb in zip(packing, micro_batches)):
        raise ValueError(f"a packing of {[list(p.index.shape) for p in packing]} rows does not fit micro-batches "
                         f"of {[list(mb['input_ids'].shape) for mb in micro_batches]}")
    return [{**mb, "packed": packed} for mb, packed in zip(micro_batches, packing)]


def forward_rows(chunk, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: PackedRows | None = None):
    """``chunk``'s output for the rows ``input_ids``/``attention_mask`` ``[b, s]``: the plain padded forward, or
    through their ``packed`` rows (:func:`pack_micro_batches`): an earlier pipeline stage's hidden states stay packed
    for the next stage, which runs the same packing, and the last stage gives :class:`RowLogits`, the output layer
    run on the packed positions some row reads (on every packed position under sequence parallelism, whose
    hidden states are split over TP by position, or FSDP2, whose weights are gathered only inside its forward)."""
    if packed is None:
        return chunk(input_ids, attention_mask=attention_mask)
    inner = unwrap(chunk)
    inputs = {"position_ids": packed.position_ids, "document_ids": packed.document_ids}
    if not inner.post_process:
        return chunk(packed.tokens, **inputs)
    if inner.sequence_parallel or isinstance(chunk, FullyShardedDataParallel):
        logits = chunk(packed.tokens, **inputs)
        return RowLogits(logits.reshape(-1, logits.shape[-1]), packed.index)
    hidden = chunk(packed.tokens, return_hidden=True, **inputs)
    read = hidden.reshape(-1, 1, hidden.shape[-1])[packed.outputs]
    return RowLogits(inner.output_logits(read)[:, 0], packed.rows)
