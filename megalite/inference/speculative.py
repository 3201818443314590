"""Drafters for speculative decoding: n-gram prompt lookup and a smaller draft model.

A drafter proposes up to ``k`` next tokens for a sequence; the engine
verifies them in one target forward (see :func:`megalite.inference.sampler.verify`).
Both drafters here propose deterministically (a point-mass draft
distribution), which keeps verification exact for sampled requests too.
"""

from __future__ import annotations

import torch

from megalite.models import KVCache


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens, propose what followed.

    Tries ``n = max_n .. min_n`` and takes the first match.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq, k: int) -> list[int]:
        tokens = seq.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    def forget(self, seq) -> None:
        """Nothing is kept per sequence."""


class DraftModelDrafter:
    """Greedy proposals from a smaller GPTModel with the same vocabulary (single process, its own KV caches).

    Each sequence keeps a contiguous cache of the tokens the draft model has
    seen; rejected drafts are truncated away before the next proposal.
    """

    def __init__(self, model, vocab_size: int):
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocab_size={model.config.vocab_size} differs from the target's "
                             f"{vocab_size}")
        if model.tp_size != 1 or not (model.pre_process and model.post_process):
            raise ValueError("the draft model must be a whole single-process GPTModel (tp=1, one pipeline stage)")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.caches: dict[int, tuple[KVCache, list[int]]] = {}

    @torch.no_grad()
    def propose(self, seq, k: int) -> list[int]:
        cache, seen = self.caches.get(id(seq), (KVCache(), []))
        tokens = seq.tokens
        common = 0
        for a, b in zip(seen, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)
        cache.truncate(common)
        feed, drafts = tokens[common:], []
        for _ in range(k):
            ids = torch.tensor([feed], device=self.device)
            logits = self.model(ids, kv_cache=cache)[0, -1]
            feed = [int(logits.argmax())]
            drafts.extend(feed)
        self.caches[id(seq)] = (cache, tokens[:cache.offset] + drafts[:cache.offset - len(tokens)])
        return drafts

    def forget(self, seq) -> None:
        self.caches.pop(id(seq), None)
