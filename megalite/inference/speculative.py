"""Drafters for speculative decoding: n-gram prompt lookup, a smaller draft model, and the target's own
multi-token prediction layers.

A drafter proposes up to ``k`` next tokens for each sequence of a step at
once; the engine verifies them in one target forward (see
:func:`megalite.inference.sampler.verify`) and then shows it the step's final
hidden states (``observe``).  Every drafter here proposes deterministically (a
point-mass draft distribution), which keeps verification exact for sampled
requests too.
"""

from __future__ import annotations

import torch

from megalite.inference.paged_cache import KVPool, PagedStep, StepPlan


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens, propose what followed.

    Tries ``n = max_n .. min_n`` and takes the first match.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` drafts for ``seqs[i]``."""
        return [self._lookup(seq.tokens, k) for seq, k in zip(seqs, ks)]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """No KV to copy."""

    def forget(self, seq) -> None:
        """Nothing is kept per sequence."""

    def observe(self, entries, hidden: torch.Tensor) -> None:
        """The target's hidden states are not used."""


class DraftModelDrafter:
    """Greedy proposals from a smaller GPTModel with the same vocabulary, batched over the step's sequences.

    The draft model keeps its own paged KV pool, addressed through the target's
    block tables (same block ids and size): the scheduler reserves (and
    copies on write) the blocks a step's drafts need before drafting, so the
    draft model's keys for position ``p`` sit in the same slot as the target's.
    Per sequence it remembers the tokens its cache holds; rejected drafts are
    recomputed over on the next proposal, and a sequence whose blocks were
    freed (finished, preempted) starts over.  Each proposal is ``k`` batched
    forwards: the first catches every sequence up (usually the token verified
    last step), each later one feeds the previous draft.
    """

    def __init__(self, model, vocab_size: int, num_blocks: int, block_size: int):
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocab_size={model.config.vocab_size} differs from the target's "
                             f"{vocab_size}")
        if model.tp_size != 1 or not (model.pre_process and model.post_process):
            raise ValueError("the draft model must be a whole single-process GPTModel (tp=1, one pipeline stage)")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pool = KVPool.for_model(model, num_blocks, block_size)
        self.cached: dict[int, list[int]] = {}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Follow the target's copy-on-write copies, so cached draft keys move with their blocks."""
        self.pool.copy_blocks(pairs)

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        """``ks[i]`` greedy drafts for ``seqs[i]``, whose blocks already cover the positions drafting writes."""
        starts, feeds = [], []
        for seq in seqs:
            tokens, cached = seq.tokens, self.cached.get(id(seq), [])
            common = 0
            for a, b in zip(cached, tokens):
                if a != b:
                    break
                common += 1
            common = min(common, len(tokens) - 1)
            starts.append(common)
            feeds.append(tokens[common:])
        drafts = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        while active:
            plan = StepPlan()
            for i in active:
                plan.token_ids.extend(feeds[i])
                plan.positions.extend(range(starts[i], starts[i] + len(feeds[i])))
                plan.starts.append(starts[i])
                plan.lengths.append(len(feeds[i]))
                plan.block_tables.append(seqs[i].block_table)
                plan.sample_rows.append(len(plan.token_ids) - 1)
            ids = torch.tensor([plan.token_ids], device=self.device)
            positions = torch.tensor([plan.positions], device=self.device)
            hidden = self.model(ids, position_ids=positions, kv_cache=PagedStep(self.pool, plan, self.device),
                                return_hidden=True)
            rows = torch.tensor(plan.sample_rows, device=self.device)
            best = self.model.output_logits(hidden[0, rows].unsqueeze(1))[:, 0].argmax(dim=-1).tolist()
            for i, token in zip(active, best):
                drafts[i].append(token)
                starts[i] += len(feeds[i])
                feeds[i] = [token]
            active = [i for i in active if len(drafts[i]) < ks[i]]
        for seq, start, new in zip(seqs, starts, drafts):
            self.cached[id(seq)] = (seq.tokens + new)[:start]
        return drafts

    def forget(self, seq) -> None:
        """The sequence's blocks are gone: its draft cache is no longer valid."""
        self.cached.pop(id(seq), None)

    def observe(self, entries, hidden: torch.Tensor) -> None:
        """The target's hidden states are not used."""
