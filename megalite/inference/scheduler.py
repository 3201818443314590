"""Continuous batching: which tokens of which sequences one step computes, under a token budget.

Every step walks the running sequences first (oldest first) and gives each
the tokens it still needs (one for a decode, plus any speculative drafts; the
rest of its prompt, or a chunk of it, for a prefill), then admits waiting
sequences first-come-first-served while the budget and the sequence limit
allow (a request counts with all the samples it will fork into).  A waiting sequence whose next uncached block another sequence of the
same step is computing (prompts sharing a system prefix, arriving together)
waits one step and then takes that block from the prefix cache.  A long
prompt is split into chunks across steps (chunked prefill) and shares the
steps with decodes.  When KV blocks run out, the newest running
sequence is preempted: its blocks are released and it waits to be recomputed
from its tokens (prefix caching usually makes that cheap).  With a sliding
attention ``window`` a block is released as soon as every key in it is older
than the window of the sequence's next query; its table entry becomes -1.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from megalite.inference.block_allocator import BlockAllocator
from megalite.inference.paged_cache import StepPlan
from megalite.inference.prefix_cache import PrefixCache
from megalite.inference.sequence import Request, Sequence


@dataclass
class Scheduled:
    """One sequence's share of a step: ``length`` tokens from ``start``, ``drafts`` among them at the end;
    ``prompt_positions`` are the positions whose logits give prompt log-probs (when the request asks)."""

    seq: Sequence
    start: int
    length: int
    drafts: list[int]
    sample: bool
    prompt_positions: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """Rows of the step's logits this entry gets: its prompt log-prob positions, then one per draft plus one
        when it samples."""
        return len(self.prompt_positions) + (len(self.drafts) + 1 if self.sample else 0)


class Scheduler:
    """FCFS scheduler over a block allocator (and an optional prefix cache) for one model replica."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 prefix_cache: PrefixCache | None = None, drafter=None, num_draft_tokens: int = 0,
                 window: int | None = None):
        self.allocator, self.block_size, self.window = allocator, block_size, window
        self.max_tokens, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.prefix_cache = prefix_cache
        self.drafter, self.num_draft_tokens = drafter, num_draft_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _reserve(self, seq: Sequence, start: int, end: int, copies: list) -> bool:
        """Give ``seq`` blocks for positions below ``end``, copying shared blocks it writes from ``start`` on."""
        bs, alloc = self.block_size, self.allocator
        shared = [i for i in range(start // bs, min(self._blocks_for(end), len(seq.block_table)))
                  if alloc.refcount[seq.block_table[i]] > 1 or seq.block_table[i] in alloc.cached]
        needed = max(0, self._blocks_for(end) - len(seq.block_table)) + len(shared)
        fresh = []
        for _ in range(needed):
            block = alloc.allocate()
            if block is None:
                for b in fresh:
                    alloc.release(b)
                return False
            fresh.append(block)
        for i in shared:
            new = fresh.pop()
            copies.append((seq.block_table[i], new))
            alloc.release(seq.block_table[i])
            seq.block_table[i] = new
        seq.block_table.extend(fresh)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finished, cancelled or preempted)."""
        for block in seq.block_table:
            if block >= 0:
                self.allocator.release(block)
        seq.block_table = []
        seq.num_computed = seq.num_cached_blocks = 0
        if self.drafter is not None:
            self.drafter.forget(seq)

    def trim(self, seq: Sequence) -> None:
        """Release blocks past the sequence's tokens (left over from rejected drafts)."""
        keep = self._blocks_for(len(seq.tokens))
        for block in seq.block_table[keep:]:
            self.allocator.release(block)
        del seq.block_table[keep:]

    def _preempt(self, seq: Sequence) -> None:
        self.free(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _num_drafts(self, seq: Sequence) -> int:
        """How many drafts a decoding ``seq`` may verify this step (none while it still prefills)."""
        if self.drafter is None or seq.num_computed != len(seq.tokens) - 1:
            return 0
        return max(0, min(self.num_draft_tokens, seq.request.params.max_tokens - seq.num_generated - 1))

    def schedule(self) -> tuple[StepPlan, list[Scheduled]]:
        """The next step's plan (empty when nothing can run) and who is in it.

        Blocks for each decoding sequence's drafts are reserved first; then the
        drafter follows the step's copy-on-write copies and proposes for all of
        them at once (a draft model runs batched), and entries shrink to the
        drafts it actually proposed.
        """
        budget, copies, entries, wanted = self.max_tokens, [], [], []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            todo = len(seq.tokens) - seq.num_computed
            length = min(todo + self._num_drafts(seq), budget)
            if not self._reserve(seq, seq.num_computed, seq.num_computed + length, copies):
                victim = self.running[-1]
                self._preempt(victim)
                continue
            entries.append(Scheduled(seq, seq.num_computed, length, [], False))
            wanted.append(max(0, length - todo))
            budget -= length
            i += 1
        applied = len(copies)
        if self.drafter is not None:
            self.drafter.copy_blocks(copies)
        if any(wanted):
            drafting = [(e, k) for e, k in zip(entries, wanted) if k]
            proposals = self.drafter.propose([e.seq for e, _ in drafting], [k for _, k in drafting])
            for (e, k), drafts in zip(drafting, proposals):
                e.drafts = list(drafts[:k])
                e.length -= k - len(e.drafts)
        entries = [self._entry(e.seq, e.length, e.drafts) for e in entries]
        computing = {self._first_block(e) for e in entries}
        occupied = sum(self._width(s) for s in self.running)
        while self.waiting and budget > 0 and (not self.running
                                               or occupied + self._width(self.waiting[0]) <= self.max_seqs):
            seq = self.waiting[0]
            if self.prefix_cache is not None and not seq.block_table and seq.request.params.prompt_logprobs is None:
                limit = (len(seq.tokens) - 1) // self.block_size
                hit = self.prefix_cache.cached_blocks(seq.tokens, limit)
                if hit < limit and tuple(seq.tokens[:(hit + 1) * self.block_size]) in computing:
                    break
                seq.block_table = self.prefix_cache.match(seq.tokens, limit)
                seq.num_computed = len(seq.block_table) * self.block_size
            length = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed, seq.num_computed + length, copies):
                self.free(seq)
                break
            self.waiting.popleft()
            self.running.append(seq)
            occupied += self._width(seq)
            entries.append(self._entry(seq, length, []))
            computing.add(self._first_block(entries[-1]))
            budget -= length
        if self.drafter is not None:
            self.drafter.copy_blocks(copies[applied:])
        return self._plan(entries, copies), entries

    @staticmethod
    def _width(seq: Sequence) -> int:
        """The running sequences ``seq`` stands for: itself, or the ``best_of`` samples it will fork into (so
        admission keeps them within ``max_num_seqs``; a request wider than the limit runs alone)."""
        return 1 if seq.request.forked else seq.request.params.best_of

    def _first_block(self, e: Scheduled) -> tuple[int, ...] | None:
        """The tokens up to the end of the first block ``e`` works on, when this step fills that block and a
        prefix-cache lookup could return it (it ends before the sequence's last token); else None, which
        matches no waiting sequence's tokens."""
        end = (e.start // self.block_size + 1) * self.block_size
        if self.prefix_cache is None or e.start + e.length < end or end > len(e.seq.tokens) - 1:
            return None
        return tuple(e.seq.tokens[:end])

    def _entry(self, seq: Sequence, length: int, drafts: list[int]) -> Scheduled:
        start = seq.num_computed
        if self.window is not None:
            # Block i ends at position (i+1)*bs - 1; no query from ``start`` on sees keys before start - window.
            for i in range(max(0, (start - self.window) // self.block_size)):
                if seq.block_table[i] >= 0:
                    self.allocator.release(seq.block_table[i])
                    seq.block_table[i] = -1
        sample = start + length - len(drafts) == len(seq.tokens)
        self.prefill_tokens += max(0, min(start + length, len(seq.request.prompt)) - start)
        return Scheduled(seq, start, length, drafts, sample, self._prompt_positions(seq.request, start, length))

    @staticmethod
    def _prompt_positions(request: Request, start: int, length: int) -> list[int]:
        """Positions in ``[start, start + length)`` whose logits score a prompt token not yet scored (prompt
        log-probs; such requests skip the prefix cache, so every position is computed once)."""
        if request.params.prompt_logprobs is None:
            return []
        end = min(start + length, len(request.prompt) - 1)
        return [p for p in range(start, end) if p + 1 not in request.prompt_logprobs]

    @staticmethod
    def _plan(entries: list[Scheduled], copies: list) -> StepPlan:
        plan = StepPlan(copies=copies)
        for e in entries:
            ids = e.seq.tokens[e.start:e.start + e.length - len(e.drafts)] + e.drafts
            row = len(plan.token_ids)
            plan.token_ids.extend(ids)
            plan.positions.extend(range(e.start, e.start + e.length))
            plan.starts.append(e.start)
            plan.lengths.append(e.length)
            plan.block_tables.append(list(e.seq.block_table))
            plan.sample_rows.extend(row + p - e.start for p in e.prompt_positions)
            if e.sample:
                plan.sample_rows.extend(range(row + e.length - len(e.drafts) - 1, row + e.length))
        return plan

    def finish(self, seq: Sequence) -> None:
        """Cache the finished sequence's full blocks (refreshing their recency) and release them."""
        self.cache_blocks(seq, force=True)
        self.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def cache_blocks(self, seq: Sequence, force: bool = False) -> None:
        """Offer the sequence's fully computed blocks to the prefix cache when one more is full (or ``force``)."""
        if self.prefix_cache is not None:
            full = seq.num_computed // self.block_size
            if force or full > seq.num_cached_blocks:
                self.prefix_cache.insert(seq.tokens, seq.block_table, full)
                seq.num_cached_blocks = full
