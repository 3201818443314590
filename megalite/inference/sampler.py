"""Choosing tokens from logits: greedy, temperature / top-k / top-p sampling, and speculative verification.

Verification is exact rejection sampling (Leviathan et al., Chen et al.):
draft token ``x`` proposed with probability ``q(x)`` is accepted with
probability ``min(1, p(x) / q(x))``; on rejection the token is drawn from
``max(p - q, 0)`` renormalised, and when every draft is accepted one more is
drawn from the target's next distribution.  megalite's drafters propose
deterministically (``q`` a point mass).  The emitted tokens then follow
the target distribution ``p`` exactly.  Greedy verification accepts a draft
iff it is the target's argmax, so greedy output is unchanged.
"""

from __future__ import annotations

import torch

from megalite.inference.params import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (rows of ``[r, v]``)."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: ``softmax(filter(logits / T))`` per row (fp32)."""
    scaled = logits.float() / params.temperature
    return filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams) -> list[float]:
    """``log softmax(logits / T)[token]`` per row (T = 1 when greedy), the actor's convention."""
    temperature = 1.0 if params.greedy else params.temperature
    log_probs = (logits[:len(tokens)].float() / temperature).log_softmax(dim=-1)
    index = torch.tensor(tokens, device=logits.device)[:, None]
    return log_probs.gather(-1, index).squeeze(-1).tolist()


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator,
           argmax: list[int] | None = None) -> list[int]:
    """Tokens to emit after ``len(drafts)`` drafts, given the target's logits ``[len(drafts) + 1, v]``.

    Drafts are proposed deterministically (a point mass ``q``), so draft ``x``
    is accepted with probability ``p(x)`` and a rejection draws from ``p``
    without ``x``.  ``argmax`` may pass precomputed greedy choices.  Without
    drafts this samples one token.
    """
    if params.greedy:
        best = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
        out = []
        for i, draft in enumerate(drafts):
            if draft != best[i]:
                break
            out.append(draft)
        return out + [best[len(out)]]
    probs = target_probs(logits, params).cpu()
    out = []
    for i, draft in enumerate(drafts):
        p = probs[i]
        if float(torch.rand((), generator=generator)) < float(p[draft]):
            out.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
