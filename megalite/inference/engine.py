"""The engine: continuous batching over a paged KV cache, run on a GPTModel's weights in place.

``LLMEngine`` owns the scheduler, the KV pool and the model runner of one
model replica.  Under tensor parallelism every TP rank holds the pool for its
heads; TP rank 0 alone schedules, broadcasts each step's :class:`StepPlan`,
samples from the logits gathered over TP and keeps the request state.  The
other ranks execute plans until rank 0 sends ``stop``.  Pipeline parallelism
is not supported yet.
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
from megalite.inference.paged_cache import KVPool, PagedStep, StepPlan
from megalite.inference.params import RequestOutput, SamplingParams
from megalite.inference.prefix_cache import PrefixCache
from megalite.inference.sampler import token_logprobs, verify
from megalite.inference.scheduler import Scheduler
from megalite.inference.sequence import Request, Sequence
from megalite.inference.speculative import DraftModelDrafter, NgramDrafter
from megalite.tensor_parallel import gather_from_tensor_parallel_region


class LLMEngine:
    """Requests in, tokens out, one :meth:`step` at a time (see the module docstring for TP)."""

    def __init__(self, model, config: EngineConfig | None = None, draft_model=None):
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
        if model.config.multi_latent_attention:
            raise ValueError("the inference engine does not cache multi-latent attention yet; decode with the "
                             "contiguous KV cache (megalite.models.kv_cache.KVCache, the static decoder)")
        self.tp_group = model.tp_group
        self.tp_size, self.tp_rank = topology.group_size(self.tp_group), topology.group_rank(self.tp_group)
        mc = model.config
        self.vocab_size, self.max_context = mc.vocab_size, mc.max_position_embeddings
        param = next(model.parameters())
        self.device = param.device
        layers = [int(n) for n in model.decoder.layers]
        self.pool = KVPool(layers, config.num_blocks, config.block_size, mc.num_query_groups // self.tp_size,
                           mc.kv_channels, param.dtype, self.device)
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
        self.drafter = drafter
        self.scheduler = Scheduler(self.allocator, config.block_size, config.max_num_batched_tokens,
                                   config.max_num_seqs, self.prefix_cache, drafter, config.num_speculative_tokens,
                                   self.window)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.stats = {"steps": 0, "target_forwards_decoding": 0, "tokens_from_decoding": 0, "draft_tokens": 0,
                      "generated_tokens": 0}

    # ---- requests (TP rank 0) ----------------------------------------------------------------------------------

    def check_request(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt as a list of ids, or a ValueError naming what is wrong (callable on every rank)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("a prompt must be a non-empty list of token ids")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a list of integer token ids")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"prompt token ids range over [{low}, {high}], outside the vocabulary [0, "
                             f"{self.vocab_size - 1}]")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} = {total} "
                             f"exceeds the model's context of {self.max_context} tokens")
        bs = self.config.block_size
        if -(-total // bs) > self.config.num_blocks:
            raise ValueError(f"the KV pool of {self.config.num_blocks} blocks x {bs} tokens cannot hold even one "
                             f"request of {total} tokens (needs {-(-total // bs)} blocks)")
        return list(prompt)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Queue a prompt (token ids); returns its :class:`Request`."""
        prompt = self.check_request(prompt, params)
        arrival = next(self._arrivals)
        request_id = str(arrival) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else int(torch.randint(2 ** 62, (), generator=self._seeds))
        request = Request(request_id, prompt, params, arrival, seed)
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
        logits = self.execute(plan)
        self.stats["steps"] += 1
        return self._process(entries, logits)

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
        """Run one packed forward; full-vocabulary fp32 logits ``[len(plan.sample_rows), v]``."""
        model = self.model
        was_training = model.training
        if was_training:
            model.eval()
        self.pool.copy_blocks(plan.copies)
        ids = torch.tensor([plan.token_ids], device=self.device)
        positions = torch.tensor([plan.positions], device=self.device)
        try:
            hidden = model(ids, position_ids=positions, kv_cache=PagedStep(self.pool, plan, self.device, self.window),
                           return_hidden=True)
        finally:
            if was_training:
                model.train()
        if not plan.sample_rows:
            return None
        rows = torch.tensor(plan.sample_rows, device=self.device)
        logits = model.output_logits(hidden[0, rows].unsqueeze(1))
        return gather_from_tensor_parallel_region(logits, self.tp_group)[:, 0, :self.vocab_size].float()

    def _process(self, entries, logits: torch.Tensor | None) -> list[Request]:
        greedy = any(e.sample and e.seq.request.params.greedy for e in entries)
        argmax = logits.argmax(dim=-1).tolist() if greedy else None
        touched, row = {}, 0
        for e in entries:
            seq, k = e.seq, len(e.drafts)
            seq.num_computed = e.start + e.length - k
            if not e.sample:
                self.scheduler.cache_blocks(seq)
                continue
            rows = logits[row:row + k + 1]
            best = argmax[row:row + k + 1] if argmax is not None else None
            row += k + 1
            request = seq.request
            if not request.forked:
                targets = [seq] + self._fork(seq)
                for s in targets:
                    self._emit(s, verify(rows, [], request.params, s.generator, argmax=best), rows)
            else:
                tokens = verify(rows, e.drafts, request.params, seq.generator, argmax=best)
                if k:
                    self.stats["target_forwards_decoding"] += 1
                    self.stats["tokens_from_decoding"] += len(tokens)
                    self.stats["draft_tokens"] += k
                self._emit(seq, tokens, rows)
                targets = [seq]
            for s in targets:
                if s.finished:
                    self._finish(s)
                else:
                    self.scheduler.trim(s)
                    self.scheduler.cache_blocks(s)
            touched[request.request_id] = request
        return list(touched.values())

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The request's other n-1 samples, sharing every block of the prompt."""
        request = seq.request
        children = []
        for index in range(1, request.params.n):
            child = Sequence(request, index, seq.tokens)
            child.num_computed = seq.num_computed
            child.block_table = list(seq.block_table)
            for block in child.block_table:
                if block >= 0:
                    self.allocator.share(block)
            children.append(child)
        request.sequences.extend(children)
        position = self.scheduler.running.index(seq) + 1
        self.scheduler.running[position:position] = children
        return children

    def _emit(self, seq: Sequence, tokens: list[int], rows: torch.Tensor) -> None:
        """Append verified tokens up to a stop; accepted drafts' KV stays valid."""
        params = seq.request.params
        logprobs = token_logprobs(rows, tokens, params) if params.logprobs else [None] * len(tokens)
        for token, logprob in zip(tokens, logprobs):
            seq.append(token, logprob)
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

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run ``prompts`` to completion on every TP rank (rank 0 drives); outputs in prompt order everywhere."""
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
            requests = [self.add_request(p, s) for p, s in zip(checked, params_list)]
            while self.has_unfinished():
                self.step()
            outputs = [r.output() for r in requests]
        finally:
            if self.tp_size > 1:
                self.stop_workers()
                dist.broadcast_object_list([outputs], src=dist.get_global_rank(self.tp_group, 0),
                                           group=self.tp_group)
        return outputs
