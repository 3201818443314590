"""Choosing tokens from logits: penalties and biases, greedy, temperature / top-k / top-p / min-p sampling,
log-probs, and speculative verification.

Verification is exact rejection sampling (Leviathan et al., Chen et al.) for
megalite's drafters, which propose deterministically (``q`` a point mass):
draft ``x`` is accepted with probability ``p(x)``, a rejection draws from
``p`` without ``x`` renormalised, and when every draft is accepted one more
is drawn from the target's next distribution.  :func:`verify` realises it by
choosing each position's token with the sample's own noise at that position
and accepting a draft iff it equals that token, so the emitted tokens follow
``p`` exactly and are the ones the sample draws without speculation (greedy:
the argmax).
"""

from __future__ import annotations

import torch

from megalite import batch_invariant
from megalite.inference import noise
from megalite.inference.params import SamplingParams


def adjust_logits(logits: torch.Tensor, histories: list[list[int]], num_prompt: int, params: SamplingParams,
                  stop_ids: frozenset) -> torch.Tensor:
    """Row ``i`` of ``logits`` after ``logit_bias``, the ``min_tokens`` ban on ``stop_ids`` and the penalties
    (vLLM's order and formulas), given the tokens ``histories[i]`` before it (its first ``num_prompt`` are the
    prompt: repetition counts them, presence and frequency only the output).  The ban never empties a row:
    where a grammar mask (applied before) leaves only stop ids, its output is complete and the grammar wins
    over ``min_tokens``, as in vLLM."""
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = [t for t in params.logit_bias if 0 <= t < vocab]
        logits[:, ids] += torch.tensor([params.logit_bias[t] for t in ids], device=logits.device)
    for i, history in enumerate(histories):
        row = logits[i]
        if len(history) - num_prompt < params.min_tokens and stop_ids:
            banned = [t for t in stop_ids if 0 <= t < vocab]
            others = torch.ones(vocab, dtype=torch.bool, device=row.device)
            others[banned] = False
            if bool(torch.isfinite(row[others]).any()):
                row[banned] = float("-inf")
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            counts = torch.bincount(torch.tensor(history[num_prompt:], dtype=torch.long), minlength=vocab)[:vocab]
            counts = counts.to(device=logits.device, dtype=row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Set logits outside the top-k, outside the top-p nucleus and below ``min_p`` times the most likely
    token's probability to -inf (rows of ``[r, v]``)."""
    if min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Per row of ``logits [r, v]``: whether it holds no NaN or inf.  ``0 * x`` is 0 for finite ``x`` and NaN for
    inf and NaN, so a row's sum of them is 0 exactly when every entry is finite (a fifth of
    ``isfinite(logits).all(-1)``'s cost on the RL rollouts' ``[128, 259]``)."""
    return (logits * 0).sum(dim=-1).eq(0).tolist()


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``: a slice (no copy) where ``rows`` run consecutively, as a step's sampled rows mostly do."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0]:rows[-1] + 1]
    return logits[rows]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: ``softmax(filter(logits / T))`` per row (fp32)."""
    scaled = logits.float() / params.temperature if params.temperature != 1.0 else logits.float()
    probs = filter_logits(scaled, params.top_k, params.top_p, params.min_p).softmax(dim=-1)
    if not bool(probs.sum().isfinite()):  # probabilities are at most 1: only NaN (or inf) makes the sum so
        raise FloatingPointError("the model's logits are not finite (NaN or inf): cannot sample from them")
    return probs


CHUNK_ELEMENTS = 2 ** 18  # floats per batched sampling op (1 MiB): rows of a large vocabulary stay in cache


def _chunks(members: list[int], vocab: int):
    """``members`` in runs of as many rows as :data:`CHUNK_ELEMENTS` holds (at least one)."""
    size = max(1, CHUNK_ELEMENTS // vocab)
    return (members[i:i + size] for i in range(0, len(members), size))


def draw(probs: torch.Tensor, seeds: list[int], positions: list[int]) -> list[int]:
    """One token per row of ``probs`` ``[r, v]``: ``argmax(p / q)`` with ``q`` the ``Exp(1)`` noise of sample
    ``seeds[i]`` at token position ``positions[i]`` (:func:`megalite.inference.noise.exponential`), which picks
    token ``j`` with probability ``p_j``.  The noise of every row is computed at once and is a function of its
    own seed and position alone, so a row draws the same token in any batch; the tokens come back in one transfer.
    """
    return (probs / noise.exponential(seeds, positions, probs.shape[-1], probs.device)).argmax(dim=-1).tolist()


def choose_batch(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], seeds: list[int],
                 positions: list[int], argmax: list[int] | None = None) -> list[int | None]:
    """The next token of draw ``i`` from ``logits[rows[i]]`` under ``params[i]`` for sample ``seeds[i]`` at token
    position ``positions[i]``: what :func:`verify` chooses without drafts, for a whole batch at once.

    Greedy draws take the argmax (``argmax`` may pass it precomputed, indexed by logits row); sampled draws that
    share temperature, top-k, top-p and min-p share one :func:`target_probs` and one :func:`draw`.  A group whose
    probabilities are not finite gets ``None``: the caller samples those rows alone, so the bad one fails alone.
    """
    out: list[int | None] = [None] * len(rows)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        best = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
        for i in greedy:
            out[i] = best[rows[i]]
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if not p.greedy:
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    for chunk in (c for members in groups.values() for c in _chunks(members, logits.shape[-1])):
        try:
            probs = target_probs(select_rows(logits, [rows[i] for i in chunk]), params[chunk[0]]).cpu()
        except FloatingPointError:
            continue
        for i, token in zip(chunk, draw(probs, [seeds[i] for i in chunk], [positions[i] for i in chunk])):
            out[i] = token
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top: int = 0
                   ) -> tuple[list[float], list[dict[int, float]] | None]:
    """``log softmax(logits / T)[token]`` per row (T = 1 when greedy), the actor's convention, and the ``top``
    most likely tokens of each row with theirs ({id: log-prob}, including the token itself) when ``top`` > 0."""
    temperature = 1.0 if params.greedy else params.temperature
    log_probs = batch_invariant.log_probs(logits[:len(tokens)], temperature)
    index = torch.tensor(tokens, device=logits.device)[:, None]
    chosen = log_probs.gather(-1, index).squeeze(-1).tolist()
    if not top:
        return chosen, None
    values, ids = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)
    tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    for entry, token, value in zip(tops, tokens, chosen):
        entry[token] = value
    return chosen, tops


def batch_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], params: list[SamplingParams]
                   ) -> list[tuple[float, dict[int, float] | None]]:
    """:func:`token_logprobs` of ``tokens[i]`` in ``logits[rows[i]]`` under ``params[i]`` (with its ``logprobs``
    top alternatives), one call per temperature and top count rather than one per row."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((1.0 if p.greedy else p.temperature, p.logprobs or 0), []).append(i)
    out: list = [None] * len(rows)
    for chunk in (c for members in groups.values() for c in _chunks(members, logits.shape[-1])):
        top = params[chunk[0]].logprobs or 0
        chosen, tops = token_logprobs(select_rows(logits, [rows[i] for i in chunk]), [tokens[i] for i in chunk],
                                      params[chunk[0]], top)
        for j, i in enumerate(chunk):
            out[i] = (chosen[j], tops[j] if tops is not None else None)
    return out


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, seed: int, position: int,
           argmax: list[int] | None = None) -> list[int]:
    """Tokens to emit after ``len(drafts)`` drafts, given the target's logits ``[len(drafts) + 1, v]``, for sample
    ``seed`` whose next token has position ``position`` (draft ``i`` sits at ``position + i``).

    Each position's token is the one the sample chooses there without drafts (the argmax when greedy, else
    :func:`draw` with its noise at that position; ``argmax`` may pass the greedy choices precomputed).  Drafts are
    accepted while they equal those tokens, and the first that differs is replaced by its position's token.
    For point-mass drafts this is exact rejection sampling: draft ``x`` is accepted with probability ``p(x)``,
    and a rejection's token follows ``p`` without ``x``.  Speculation therefore never changes a seed's tokens.
    """
    if params.greedy:
        chosen = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
    else:
        probs = target_probs(logits, params).cpu()
        chosen = draw(probs, [seed] * len(probs), list(range(position, position + len(probs))))
    out = []
    for draft, token in zip(drafts, chosen):
        if draft != token:
            break
        out.append(draft)
    return out + [chosen[len(out)]]


def pick_batch(entries, spans, logits, finite, argmax) -> dict[int, list[tuple]]:
    """The next token, log-prob and top log-probs of every sequence whose step needs no work of its own (one
    token, no drafts, penalties, bias or grammar), chosen for the whole batch at once: one argmax, one draw per
    sampling setting, one log-softmax per log-prob setting.  Keyed by entry index, one pick per sample the
    entry emits to (all ``best_of`` of a request that forks this step).  The rest go through the engine's own
    row-by-row choice (penalties, grammar, drafts).  ``entries`` are the scheduler's step entries, ``spans``
    their ``(first logits row, rows)``, ``finite`` per row, ``argmax`` per row or None."""
    draws = []  # (entry index, logits row, params, seed)
    for index, (e, (row, width)) in enumerate(zip(entries, spans)):
        request, params = e.seq.request, e.seq.request.params
        if (not e.sample or e.drafts or request.error is not None or params.adjusts_logits
                or e.seq.grammar is not None or not all(finite[row:row + width])):
            continue
        seeds = [e.seq.seed] if request.forked else request.seeds
        draws += [(index, row + width - 1, params, s) for s in seeds]
    if not draws:
        return {}
    rows = [d[1] for d in draws]
    positions = [len(entries[d[0]].seq.tokens) for d in draws]
    tokens = choose_batch(logits, rows, [d[2] for d in draws], [d[3] for d in draws], positions, argmax)
    wanted = [i for i, (d, t) in enumerate(zip(draws, tokens))
              if t is not None and entries[d[0]].seq.request.needs_logprobs]
    found = dict(zip(wanted, batch_logprobs(logits, [rows[i] for i in wanted], [tokens[i] for i in wanted],
                                            [draws[i][2] for i in wanted])))
    picks: dict[int, list[tuple]] = {}
    for i, (d, token) in enumerate(zip(draws, tokens)):
        picks.setdefault(d[0], []).append(None if token is None else (token, *found.get(i, (None, None))))
    return picks
