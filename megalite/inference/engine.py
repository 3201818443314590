"""The engine: continuous batching over a paged KV cache, run on a GPTModel's weights in place.

``LLMEngine`` owns the scheduler, the KV pool and the model runner of one
model replica.  Under tensor parallelism every TP rank holds the pool for its
heads (a multi-latent-attention model's whole latent pool, which all heads
share); TP rank 0 alone schedules, broadcasts each step's :class:`StepPlan`,
samples from the logits gathered over TP and keeps the request state.  The
other ranks execute plans until rank 0 sends ``stop``.  Pipeline parallelism
is not supported yet.

A request whose logits cannot be sampled (NaN weights, an overflowing
temperature) fails alone: it is finished with ``Request.error`` set and its
blocks freed, and the step goes on for the others.  On one rank a forward
that raises fails the requests of that step the same way; under TP it stops
the engine (the ranks' collectives would no longer match).
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.distributed.unwrap import unwrap
from megalite.inference.block_allocator import BlockAllocator
from megalite.inference.config import EngineConfig
from megalite.inference.grammar import CompiledGrammar, apply_grammar
from megalite.inference.paged_cache import KVPool, PagedStep, StepPlan
from megalite.inference.params import RequestOutput, SamplingParams, StructuredOutputsParams
from megalite.inference.prefix_cache import PrefixCache
from megalite.inference.request_check import EngineFacts, RequestChecker
from megalite.inference.sampler import adjust_logits, finite_rows, pick_batch, token_logprobs, verify
from megalite.inference.scheduler import Scheduler
from megalite.inference.sequence import Request, Sequence
from megalite.inference.mtp_drafter import MTPDrafter
from megalite.inference.speculative import DraftModelDrafter, NgramDrafter
from megalite.inference.static_decode import StaticDecode
from megalite.tensor_parallel import gather_from_tensor_parallel_region


class LLMEngine:
    """Requests in, tokens out, one :meth:`step` at a time (see the module docstring for TP)."""

    def __init__(self, model, config: EngineConfig | None = None, draft_model=None, *, tokenizer=None,
                 eos_token_ids=None):
        """``tokenizer`` (with ``detokenize``) gives outputs their text and enables stop strings;
        ``eos_token_ids`` end generation unless a request sets ``ignore_eos`` (default: the tokenizer's ``eod``)."""
        self.config = config = config or EngineConfig()
        self.model = model = unwrap(model)
        if not (model.pre_process and model.post_process):
            raise ValueError("the inference engine does not support pipeline parallelism yet: it needs a model "
                             "chunk with both the embedding and the output layer (pp=1)")
        if getattr(model, "cp_size", 1) > 1:
            raise ValueError(f"the inference engine does not support context parallelism (cp={model.cp_size}); "
                             "build the model at cp=1")
        if model.sequence_parallel:
            raise ValueError("the inference engine does not support sequence parallelism; build the model "
                             "without it (the weights are the same)")
        self.tp_group = model.tp_group
        self.tp_size, self.tp_rank = topology.group_size(self.tp_group), topology.group_rank(self.tp_group)
        mc = model.config
        self.vocab_size, self.max_context = mc.vocab_size, mc.max_position_embeddings
        self.device = next(model.parameters()).device
        # one block more than the allocator hands out: the scratch block of static decode steps' padding rows
        self.pool = KVPool.for_model(model, config.num_blocks + 1, config.block_size, self.tp_size)
        self.allocator = BlockAllocator(config.num_blocks)
        # A sliding-window model frees its early blocks, so its block tables cannot feed the prefix cache.
        self.window = mc.window_size
        caching = config.enable_prefix_caching and self.window is None
        self.prefix_cache = PrefixCache(self.allocator, config.block_size) if caching else None
        drafter = None
        if config.speculative == "ngram":
            drafter = NgramDrafter(config.ngram_min, config.ngram_max)
        elif config.speculative == "draft":
            if draft_model is None:
                raise ValueError("EngineConfig.speculative='draft' needs a draft_model")
            drafter = DraftModelDrafter(unwrap(draft_model), mc.vocab_size, config.num_blocks, config.block_size)
        elif config.speculative == "mtp":
            drafter = MTPDrafter(model, config.num_blocks, config.block_size, self.window)
        self.drafter = drafter
        self.scheduler = Scheduler(self.allocator, config.block_size, config.max_num_batched_tokens,
                                   config.max_num_seqs, self.prefix_cache, drafter, config.num_speculative_tokens,
                                   self.window)
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = [] if getattr(tokenizer, "eod", None) is None else [tokenizer.eod]
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.checker = RequestChecker(EngineFacts(self.vocab_size, self.max_context,
                                                  tuple(sorted(self.eos_token_ids)), config), tokenizer)
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.stats = {"steps": 0, "target_forwards_decoding": 0, "tokens_from_decoding": 0, "draft_tokens": 0,
                      "generated_tokens": 0}
        self._hidden = None  # the last step's final-norm hidden states [T, h] (execute), for the drafter
        self.static_decode = StaticDecode.default_for(self)  # decode-only steps: static shapes, CUDA graphs

    # ---- requests (TP rank 0) ----------------------------------------------------------------------------------

    def check_request(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt as a list of ids, or a ValueError naming what is wrong (callable on every rank)."""
        return self.checker.check_request(prompt, params)

    def compile_grammar(self, structured: StructuredOutputsParams) -> CompiledGrammar:
        """``structured`` compiled for this engine (:meth:`RequestChecker.compile_grammar`: cached, thread-safe,
        time-limited; a :class:`GrammarError` when it does not compile)."""
        return self.checker.compile_grammar(structured)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    sample_seeds: list[int] | None = None) -> Request:
        """Queue a prompt (token ids); returns its :class:`Request` (its grammar compiled here, if any).
        ``sample_seeds``: each sample's noise seed (see :class:`Request`)."""
        prompt = self.check_request(prompt, params)
        arrival = next(self._arrivals)
        request_id = str(arrival) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        grammar = self.compile_grammar(params.structured_outputs) if params.structured_outputs is not None else None
        seed = params.seed if params.seed is not None else int(torch.randint(2 ** 62, (), generator=self._seeds))
        request = Request(request_id, prompt, params, arrival, seed, self.eos_token_ids, self.tokenizer, grammar,
                          sample_seeds)
        request.arrival_time = time.perf_counter()
        self.requests[request_id] = request
        self.scheduler.add(request.sequences[0])
        return request

    def abort(self, request_id: str) -> None:
        """Drop a request and free its KV blocks (e.g. its client went away)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.cancelled = True
        for seq in request.sequences:
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- steps --------------------------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Schedule, run and sample one step (TP rank 0); returns the requests that got new tokens."""
        plan, entries = self.scheduler.schedule()
        if not entries:
            if self.scheduler.has_work():
                raise RuntimeError("the scheduler could not place any work although requests are waiting")
            return []
        self._broadcast_plan(plan)
        try:
            logits = self.execute(plan)
        except Exception as error:
            if self.tp_size > 1:
                raise
            return self._fail({e.seq.request.request_id: e.seq.request for e in entries}.values(),
                              f"the model's forward failed: {error}")
        self.stats["steps"] += 1
        touched = self._process(entries, logits)
        if self.drafter is not None:
            self.drafter.observe(entries, self._hidden)
        return touched

    def _fail(self, requests, message: str) -> list[Request]:
        """Finish ``requests`` with ``error`` = ``message`` and free their blocks; the engine goes on."""
        failed = []
        for request in requests:
            if request.error is not None:
                continue
            request.error = message
            for seq in request.sequences:
                if not seq.finished:
                    seq.finish_reason = "error"
                self._finish(seq)
            failed.append(request)
        return failed

    def _broadcast_plan(self, plan: StepPlan) -> None:
        if self.tp_size > 1:
            dist.broadcast_object_list([plan], src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)

    def stop_workers(self) -> None:
        """Tell the other TP ranks' :meth:`run_worker` loops to return."""
        self._broadcast_plan(StepPlan(stop=True))

    def heartbeat(self) -> None:
        """An empty plan, so idle workers' collectives do not time out (a server between requests)."""
        self._broadcast_plan(StepPlan())

    def run_worker(self) -> None:
        """TP ranks other than 0: execute rank 0's plans until it sends ``stop``."""
        src = dist.get_global_rank(self.tp_group, 0)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=src, group=self.tp_group)
            if box[0].stop:
                return
            if box[0].token_ids:
                self.execute(box[0])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one packed forward; full-vocabulary fp32 logits ``[len(plan.sample_rows), v]``.  A decode-only
        step goes to :attr:`static_decode` when there is one (then no hidden states are kept)."""
        model = self.model
        was_training = model.training
        if was_training:
            model.eval()
        self.pool.copy_blocks(plan.copies)
        try:
            if self.static_decode is not None and self.static_decode.accepts(plan):
                self._hidden = None
                return self.static_decode.run(plan)
            ids = torch.tensor([plan.token_ids], device=self.device)
            positions = torch.tensor([plan.positions], device=self.device)
            hidden = model(ids, position_ids=positions, kv_cache=PagedStep(self.pool, plan, self.device, self.window),
                           return_hidden=True)
        finally:
            if was_training:
                model.train()
        self._hidden = hidden[0]
        if not plan.sample_rows:
            return None
        rows = torch.tensor(plan.sample_rows, device=self.device)
        logits = model.output_logits(hidden[0, rows].unsqueeze(1))
        return gather_from_tensor_parallel_region(logits, self.tp_group)[:, 0, :self.vocab_size].float()

    def _process(self, entries, logits: torch.Tensor | None) -> list[Request]:
        finite = finite_rows(logits) if logits is not None else []
        greedy = any(e.sample and e.seq.request.params.greedy and not e.seq.request.params.adjusts_logits
                     and e.seq.grammar is None for e in entries)
        argmax = logits.argmax(dim=-1).tolist() if greedy else None
        starts = itertools.accumulate((e.num_rows for e in entries), initial=0)
        spans = [(start, e.num_rows) for start, e in zip(starts, entries)]
        picks = pick_batch(entries, spans, logits, finite, argmax)
        masked = self._grammar_rows(entries, spans, logits, finite)
        touched = {}
        for index, (e, (row, width)) in enumerate(zip(entries, spans)):
            seq, k, request = e.seq, len(e.drafts), e.seq.request
            seq.num_computed = e.start + e.length - k
            if request.error is not None:
                continue
            pick = picks.get(index)
            # A sequence whose tokens pick_batch chose needs no logits of its own: no slice per sequence.
            chosen = e.sample and not e.prompt_positions and pick is not None and None not in pick
            rows = logits[row:row + width] if width and not chosen else None
            best, ok = None, all(finite[row:row + width])
            if argmax is not None and e.sample:
                best = argmax[row + len(e.prompt_positions):row + width]
            try:
                if not ok:
                    raise FloatingPointError("the model's logits are not finite (NaN or inf)")
                if e.prompt_positions:
                    self._prompt_logprobs(request, e.prompt_positions, rows[:len(e.prompt_positions)])
                    rows = rows[len(e.prompt_positions):]
                if not e.sample:
                    self.scheduler.cache_blocks(seq)
                    continue
                targets = self._sample(seq, e.drafts, rows, best, pick, masked.get(index))
            except Exception as error:  # this request's sampling alone: fail it, serve the others
                touched.update((r.request_id, r) for r in self._fail([request], f"sampling failed: {error}"))
                continue
            for s in targets:
                if s.finished:
                    self._finish(s)
                else:
                    if self.drafter is not None:  # only drafts (reserved, rejected) leave blocks past the tokens
                        self.scheduler.trim(s)
                    self.scheduler.cache_blocks(s)
            touched[request.request_id] = request
        return list(touched.values())

    def _grammar_rows(self, entries, spans, logits, finite) -> dict[int, torch.Tensor]:
        """The sampled row of every entry with a grammar and no drafts, its forbidden tokens at -inf, keyed by
        entry index: the masks of the whole step in one parallel computation (:func:`apply_grammar`) instead of
        one per sequence.  Empty where none, or where that computation fails (each sequence then masks its own
        row and fails alone)."""
        wanted = [(index, row + width - 1) for index, (e, (row, width)) in enumerate(zip(entries, spans))
                  if e.sample and not e.drafts and e.seq.grammar is not None and e.seq.request.error is None
                  and all(finite[row:row + width])]
        if not wanted:
            return {}
        try:
            rows = apply_grammar(logits[[row for _, row in wanted]], [entries[i].seq.grammar for i, _ in wanted])
        except Exception:  # the per-sequence path below reports it against its own request
            return {}
        return {index: rows[k:k + 1] for k, (index, _) in enumerate(wanted)}

    def _sample(self, seq: Sequence, drafts: list[int], rows: torch.Tensor, best, picks=None,
                masked: torch.Tensor | None = None) -> list[Sequence]:
        """Emit ``seq``'s next tokens (forking the request's other samples after its prompt); returns the
        sequences that got tokens.  ``picks``: :func:`pick_batch`'s choices, one per sample (None: choose here);
        ``masked``: ``seq``'s row under its grammar, from :meth:`_grammar_rows` (forks mask their own)."""
        targets = [seq] if seq.request.forked else [seq] + self._fork(seq)
        for s, pick in zip(targets, picks or [None] * len(targets)):
            if pick is not None:
                self._emit(s, [pick[0]], rows, ([pick[1]], [pick[2]]))
                continue
            tokens = self._choose(s, rows, drafts, best, masked if s is seq else None)
            if drafts:
                self.stats["target_forwards_decoding"] += 1
                self.stats["tokens_from_decoding"] += len(tokens)
                self.stats["draft_tokens"] += len(drafts)
            self._emit(s, tokens, rows)
        return targets

    def _choose(self, seq: Sequence, rows: torch.Tensor, drafts: list[int], best,
                masked: torch.Tensor | None = None) -> list[int]:
        """Verify ``drafts`` (or sample one token) from ``rows`` after the request's penalties, biases and
        grammar (``masked``: the row already under the grammar)."""
        params = seq.request.params
        if seq.grammar is not None:  # tokens the grammar forbids (drafts rejected where it forbids them)
            if masked is not None:
                rows = masked
            else:
                rows = apply_grammar(rows, [seq.grammar]) if not drafts else \
                    rows.masked_fill(~seq.grammar.draft_masks(drafts).to(rows.device), float("-inf"))
            best = None
        if params.adjusts_logits:  # after the grammar: min_tokens gives way where only a stop id is allowed
            histories = [seq.tokens + drafts[:i] for i in range(len(drafts) + 1)]
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            rows, best = adjust_logits(rows, histories, len(seq.request.prompt), params, frozenset(stop_ids)), None
        return verify(rows, drafts, params, seq.seed, len(seq.tokens), argmax=best)

    def _prompt_logprobs(self, request: Request, positions: list[int], rows: torch.Tensor) -> None:
        """Record the log-probs of the prompt tokens after ``positions`` (and the top alternatives)."""
        targets = [request.prompt[p + 1] for p in positions]
        chosen, tops = token_logprobs(rows, targets, request.params, request.params.prompt_logprobs)
        for i, (p, value) in enumerate(zip(positions, chosen)):
            request.prompt_logprobs[p + 1] = tops[i] if tops is not None else {targets[i]: value}

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The request's other n-1 samples, sharing every block of the prompt."""
        request = seq.request
        children = []
        for index in range(1, request.params.best_of):
            child = seq.fork(index)
            for block in child.block_table:
                if block >= 0:
                    self.allocator.share(block)
            children.append(child)
        request.sequences.extend(children)
        position = self.scheduler.running.index(seq) + 1
        self.scheduler.running[position:position] = children
        return children

    def _emit(self, seq: Sequence, tokens: list[int], rows: torch.Tensor, known=None) -> None:
        """Append verified tokens up to a stop; accepted drafts' KV stays valid.  ``known``: the tokens' log-probs
        and top log-probs when already computed (else computed here from ``rows`` when the request needs them)."""
        request, params = seq.request, seq.request.params
        logprobs, tops = [None] * len(tokens), [None] * len(tokens)
        if known is not None:
            logprobs, tops = known
        elif request.needs_logprobs:
            logprobs, found = token_logprobs(rows, tokens, params, params.logprobs or 0)
            tops = found or tops
        for token, logprob, top in zip(tokens, logprobs, tops):
            seq.append(token, logprob, top)
            self.stats["generated_tokens"] += 1
            if seq.finished:
                break
        seq.num_computed = min(seq.num_computed + len(tokens) - 1, len(seq.tokens) - 1)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        request = seq.request
        if request.finished and request.request_id in self.requests:
            del self.requests[request.request_id]

    # ---- whole batches ------------------------------------------------------------------------------------------

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 sample_seeds: list[list[int] | None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion on every TP rank (rank 0 drives); outputs in prompt order everywhere.
        ``sample_seeds``: per prompt, its samples' noise seeds or None (:meth:`add_request`)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        checked = [self.check_request(p, s) for p, s in zip(prompts, params_list)]
        if self.tp_rank != 0:
            self.run_worker()
            box = [None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
            if box[0] is None:
                raise RuntimeError("tensor-parallel rank 0 of the inference engine failed (see its error)")
            return box[0]
        outputs = None
        try:
            for s in params_list:  # every grammar compiles before any request is queued
                if s.structured_outputs is not None:
                    self.compile_grammar(s.structured_outputs)
            requests = [self.add_request(p, s, sample_seeds=seeds) for p, s, seeds in
                        zip(checked, params_list, sample_seeds or [None] * len(checked))]
            while self.has_unfinished():
                self.step()
            outputs = [r.output() for r in requests]
            failed = [r for r in requests if r.error is not None]
            if failed:
                outputs = None
                raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        finally:
            if self.tp_size > 1:
                self.stop_workers()
                dist.broadcast_object_list([outputs], src=dist.get_global_rank(self.tp_group, 0),
                                           group=self.tp_group)
        return outputs
