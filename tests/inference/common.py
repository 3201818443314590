"""Tiny random GPTs for the engine tests, a full-recompute greedy decode, an independent top-k/top-p reference,
and a chi-square p-value."""

from __future__ import annotations

import math

import torch

from megalite.models import GPTConfig, GPTModel

VOCAB = 40


def tiny_model(kind: str = "llama", **overrides) -> GPTModel:
    """A 2-layer model whose logits are far from uniform (large init std), in eval mode."""
    base = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                make_vocab_size_divisible_by=8, init_method_std=0.5, seed=11)
    if kind == "llama":
        base.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", num_query_groups=2,
                    add_bias_linear=False, ffn_hidden_size=48)
    base.update(overrides)
    return GPTModel(GPTConfig(**base)).eval()


def poison_logits(monkeypatch, seed: int, value: float = float("nan")) -> None:
    """Set the logits rows of the requests with ``seed`` to ``value`` (the whole row; a finite ``value`` only at token
    0) where the engine's step receives them, to make that request's sampling fail."""
    from megalite.inference.engine import LLMEngine

    real = LLMEngine._process

    def poisoned(self, entries, logits):
        if logits is not None:
            logits, row = logits.clone(), 0
            for e in entries:
                if e.seq.request.params.seed == seed:
                    logits[row:row + e.num_rows, :1 if math.isfinite(value) else None] = value
                row += e.num_rows
        return real(self, entries, logits)

    monkeypatch.setattr(LLMEngine, "_process", poisoned)


def recompute_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """``max_new`` greedy tokens after ``prompt``, each from a full forward over everything so far (no cache)."""
    ids = list(prompt)
    for _ in range(max_new):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def logprob_model(kind: str = "llama") -> GPTModel:
    """:func:`tiny_model` at init std 0.3, for tests that hold fp32 log-probs to 1e-5.

    At std 0.5 each linear grows activations about 2.8x and amplifies rounding differences between two
    computation orders to 1e-5; at 0.3 the gain is about 1.7x and they stay within a few 1e-6."""
    return tiny_model(kind, init_method_std=0.3)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k, then to the smallest prefix reaching top_p, renormalised."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    sub = probs[kept] / probs[kept].sum()
    keep, total = [], 0.0
    for token, p in zip(kept, sub.tolist()):
        keep.append(token)
        total += p
        if total >= top_p:
            break
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed ``counts`` under ``probs`` (cells with zero probability must be empty).  Cells expecting
    fewer than 5 samples are pooled into one: the chi-square approximation needs about 5 per cell, and a single
    draw of a token expected 0.02 times would otherwise weigh like a gross error."""
    support = probs > 0
    assert counts[~support].sum() == 0, "samples outside the support"
    n = counts.sum().double()
    expected, observed = probs[support].double() * n, counts[support].double()
    rare = expected < 5
    if rare.any():
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
        observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
