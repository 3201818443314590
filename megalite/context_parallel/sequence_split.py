"""Which tokens of a sequence each context-parallel rank holds, and packed-sequence metadata.

Load balance under the causal mask: a sequence of ``s`` tokens is cut into
``2*cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2*cp-1-i``, so
every rank pairs an early (cheap) chunk with a late (expensive) one.  Every
rank can compute every other rank's token indices from ``(s, cp, rank)``
alone, which is what the attention's masks are built from.

Packed samples hold several documents, each ending with an end-of-document
(eod) token.  A token's document id is the number of eod tokens before it, so
document ids are non-decreasing along the sequence.
"""

from __future__ import annotations

import torch

COMM_TYPES = ("p2p", "all_gather", "a2a")


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


def reset_position_ids(documents: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each document's first token (``documents`` from :func:`document_ids`)."""
    b, s = documents.shape
    positions = torch.arange(s, device=documents.device).expand(b, s)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=-1).values
    return positions - first
