"""Speculative drafts from the target model's own multi-token prediction layers (DeepSeek-V3's MTP).

Depth ``j`` (:mod:`megalite.models.mtp`) at position ``p`` reads the previous depth's state at ``p`` (the
target's final-norm hidden state for depth 0) and the token at ``p + j + 1``, and predicts the token at
``p + j + 2``.  With ``L`` tokens in a sequence the target has computed the hidden states of positions
``0 .. L-2``, so depth 0 at ``L-2`` proposes the token at ``L``; depth ``j`` at ``L-2``, fed the drafts so far,
proposes the token at ``L + j``: one draft per depth and step, as DeepSeek-V3 drafts.
"""

from __future__ import annotations

import torch

from megalite.inference.paged_cache import KVPool, PagedStep, StepPlan


class _History:
    """What one sequence's next proposals need: ``states[j]`` the final inputs of depth ``j`` (``[n_j, h]``
    for positions ``0 .. n_j-1``; ``states[0]`` the target's hidden states), ``cached[j]`` the positions whose
    depth-``j`` KV entries are final (their token and state are)."""

    def __init__(self, depths: int, first: torch.Tensor):
        self.states = [first] + [first[:0]] * (depths - 1)
        self.cached = [0] * depths


class MTPDrafter:
    """Greedy drafts of the target's MTP depths, batched over the step's sequences, one depth per forward.

    Each depth keeps its KV in a paged pool addressed through the target's block tables (same block ids
    and size; the scheduler reserves and copies the blocks before drafting, as for a draft model).  The
    engine shows the drafter each step's hidden states (:meth:`observe`); those of positions whose tokens
    were accepted become the sequence's history.  Entries computed from a draft are recomputed on the next
    proposal.  A sequence whose history does not start at its first token (a prefix-cache hit, a forked
    sample) gets no drafts; one whose blocks were freed starts over.
    """

    def __init__(self, model, num_blocks: int, block_size: int, window: int | None = None):
        if getattr(model, "mtp", None) is None:
            raise ValueError("EngineConfig.speculative='mtp' needs a model with multi-token prediction layers "
                             "(GPTConfig.mtp_num_layers)")
        if model.tp_size != 1:
            raise ValueError(f"EngineConfig.speculative='mtp' runs at tp=1 only (tp={model.tp_size})")
        self.model, self.layers, self.window = model, model.mtp.layers, window
        self.device = next(model.parameters()).device
        first = model.config.num_layers
        self.pool = KVPool.for_model(model, num_blocks, block_size,
                                     layer_numbers=[first + j for j in range(len(self.layers))])
        self.histories: dict[int, _History] = {}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Follow the target's copy-on-write copies."""
        self.pool.copy_blocks(pairs)

    def forget(self, seq) -> None:
        """The sequence's blocks are gone: its history is no longer valid."""
        self.histories.pop(id(seq), None)

    def observe(self, entries, hidden: torch.Tensor) -> None:
        """Keep the step's hidden states ``[T, h]`` (packed as ``entries``) of the positions whose tokens the
        sequences kept (after the step's tokens were appended)."""
        offset = 0
        for e in entries:
            rows, offset = hidden[offset:offset + e.length], offset + e.length
            seq = e.seq
            if seq.finished:
                continue
            history = self.histories.get(id(seq))
            known = 0 if history is None else history.states[0].shape[0]
            if known != e.start:
                self.histories.pop(id(seq), None)
                continue
            kept = rows[:max(0, min(e.length, len(seq.tokens) - 1 - e.start))]
            if history is None:
                self.histories[id(seq)] = _History(len(self.layers), kept.clone())
            else:
                history.states[0] = torch.cat([history.states[0], kept])

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        """Up to ``min(ks[i], depths)`` greedy drafts for ``seqs[i]`` (the model runs in eval mode)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self._propose(seqs, ks)
        finally:
            self.model.train(was_training)

    def _propose(self, seqs, ks: list[int]) -> list[list[int]]:
        drafts = [[] for _ in seqs]
        tails = {}
        active = [i for i, seq in enumerate(seqs) if ks[i] > 0 and id(seq) in self.histories
                  and self.histories[id(seq)].states[0].shape[0] == len(seq.tokens) - 1]
        for depth, layer in enumerate(self.layers):
            if not active:
                break
            plan, inputs = StepPlan(), []
            for i in active:
                seq, history = seqs[i], self.histories[id(seqs[i])]
                start, end = history.cached[depth], len(seq.tokens) - 1  # positions start .. end-1
                tokens = seq.tokens + drafts[i]
                plan.token_ids.extend(tokens[start + depth + 1:end + depth + 1])
                plan.positions.extend(range(start, end))
                plan.starts.append(start)
                plan.lengths.append(end - start)
                plan.block_tables.append(seq.block_table)
                inputs.append(torch.cat([history.states[depth][start:], tails.get(i, history.states[0][:0])]))
            out = self._forward(layer, depth, plan, torch.cat(inputs))
            ends = torch.tensor(plan.lengths, device=self.device).cumsum(0) - 1
            best = self.model.output_logits(out[ends]).argmax(dim=-1)[:, 0].tolist()
            row = 0
            for i, length, token in zip(active, plan.lengths, best):
                seq, history = seqs[i], self.histories[id(seqs[i])]
                rows = out[row:row + length, 0]
                row += length
                final = len(seq.tokens) - 1 - depth  # positions below this read accepted tokens only
                start = history.cached[depth]
                if depth + 1 < len(self.layers):
                    history.states[depth + 1] = torch.cat([history.states[depth + 1], rows[:final - start]])
                tails[i] = rows[final - start:]
                history.cached[depth] = final
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < ks[i]]
        return drafts

    def _forward(self, layer, depth: int, plan: StepPlan, states: torch.Tensor) -> torch.Tensor:
        """Depth ``depth`` (``layer``) on the packed ``plan`` with the previous depth's ``states [T, h]`` ->
        ``[T, 1, h]``; the embedded tokens sit ``depth + 1`` places ahead (learned positions too, as in training)."""
        model = self.model
        ids = torch.tensor([plan.token_ids], device=self.device)
        positions = torch.tensor([plan.positions], device=self.device)
        rotary = None if model.rotary is None else model.rotary(positions.t())
        return layer(states[:, None], model.embedding(ids, positions + depth + 1), rotary,
                     kv_cache=PagedStep(self.pool, plan, self.device, self.window))
