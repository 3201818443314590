"""Which tokens of a sequence each context-parallel rank holds, and packed-sequence metadata.

Load balance under the causal mask: a sequence of ``s`` tokens is cut into
``2*cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2*cp-1-i``, so
every rank pairs an early (cheap) chunk with a late (expensive) one.  Every
rank can compute every other rank's token indices from ``(s, cp, rank)``
alone, which is what the attention's masks are built from.

Packed samples hold several documents, each ending with an end-of-document
(eod) token.  A token's document id is the number of eod tokens before it, so
document ids are non-decreasing along the sequence.

A document may also branch (prefix sharing, e.g. a preference pair's prompt
once, then its chosen and its rejected completion): its trunk keeps the id
``d`` and branch ``k >= 1`` carries ``d + k * BRANCH``.  A branch token sees its
own branch and its document's trunk, not a sibling branch, and its positions
continue from the trunk's end, so a sliding window measures distance in those positions
(:func:`sequence_positions`), not along the row.  Branches follow their trunk in order, so
:func:`document_of` stays non-decreasing and no raw id comes back after another
one (what the tiled attention's bounds rely on).
"""

from __future__ import annotations

import torch

COMM_TYPES = ("p2p", "all_gather", "a2a")
BRANCH = 1 << 32
"""Document ids of branch ``k`` of document ``d`` are ``d + k * BRANCH`` (see the module docstring)."""


def check_comm_type(comm_type: str) -> None:
    if comm_type not in COMM_TYPES:
        raise ValueError(f"unknown context-parallel comm type {comm_type!r}; choose one of {', '.join(COMM_TYPES)}")


def check_context_parallel(seq_length: int, cp: int, comm_type: str = "p2p") -> None:
    """Raise ValueError naming the numbers if ``seq_length`` cannot be split over ``cp`` ranks with ``comm_type``."""
    check_comm_type(comm_type)
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context-parallel size must be a positive integer, got {cp!r}")
    if cp > 1 and seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2*cp = 2*{cp} = {2 * cp} "
                         f"(context parallelism splits each sequence into 2*cp chunks)")


def chunk_indices(seq_length: int, cp: int, rank: int, load_balance: bool = True,
                  device=None) -> torch.Tensor:
    """Global token indices held by CP rank ``rank``, in local order (``[seq_length // cp]``).

    With ``load_balance`` chunks ``rank`` and ``2*cp-1-rank`` of ``2*cp``;
    otherwise the contiguous block ``rank`` of ``cp``.
    """
    if cp == 1:
        return torch.arange(seq_length, device=device)
    if not load_balance:
        block = seq_length // cp
        return torch.arange(rank * block, (rank + 1) * block, device=device)
    chunk = seq_length // (2 * cp)
    early = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    late = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([early, late])


def slice_for_rank(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``tensor`` along ``dim`` (the sequence dimension, ``[b, s]`` by default)."""
    if cp == 1:
        return tensor
    index = chunk_indices(tensor.shape[dim], cp, rank, device=tensor.device)
    return tensor.index_select(dim, index).contiguous()


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[b, s]`` document index of every token: the number of eod tokens strictly before it."""
    is_eod = (tokens == eod).long()
    return is_eod.cumsum(dim=-1) - is_eod


def document_of(documents: torch.Tensor) -> torch.Tensor:
    """The document of each token, its branch dropped (non-decreasing along the sequence)."""
    return documents % BRANCH


def sees(q_documents: torch.Tensor, k_documents: torch.Tensor) -> torch.Tensor:
    """The document part of the attention rule, elementwise: a query sees a key of its own document and branch,
    or of its document's trunk (the causal part is :func:`megalite.context_parallel.blockwise.visible`'s)."""
    return (q_documents == k_documents) | (k_documents == document_of(q_documents))


def reset_position_ids(documents: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each document's first token (``documents`` from :func:`document_ids`);
    a branch's continue from its trunk's last position."""
    b, s = documents.shape
    positions = torch.arange(s, device=documents.device).expand(b, s)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    zeros = torch.zeros_like(positions)
    first = torch.where(starts, positions, zeros).cummax(dim=-1).values
    within = positions - first
    trunk = documents < BRANCH
    if bool(trunk.all()):
        return within
    # The latest trunk token and trunk start before each token: a branch's own trunk (branches follow it).
    trunk_last = torch.where(trunk, positions, zeros).cummax(dim=-1).values
    trunk_first = torch.where(trunk & starts, positions, zeros).cummax(dim=-1).values
    return torch.where(trunk, within, within + trunk_last - trunk_first + 1)


def sequence_positions(documents: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: each token's index along the row as its own sequence counts it, the distance a sliding window
    measures.  The row index, except that a branch's tokens follow their trunk's last token rather than the
    sibling branches packed between (its document's first row plus :func:`reset_position_ids`): two tokens that
    see each other are as far apart here as in their sequence run alone, while without branches this is the row
    index itself (so tiles far apart along the row stay far apart)."""
    b, s = documents.shape
    rows = torch.arange(s, device=documents.device).expand(b, s)
    doc = document_of(documents)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.where(starts, rows, torch.zeros_like(rows)).cummax(dim=-1).values
    return first + reset_position_ids(documents)
