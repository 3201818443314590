"""Rollout generation: the inference engine for pp=1, static pipelined decoding otherwise.

:class:`RolloutEngine` runs left-padded rollout batches through one
:class:`megalite.inference.LLMEngine`, built once and reused, on the actor's
weights in place (continuous batching, paged KV, TP) and packs the result
like :func:`generate`.  :func:`generate` below is the static-batch decoder that
also runs across pipeline stages, which the engine does not support yet.

Prompts come left-padded (``prompt_mask`` marks the real tokens), so every
row's next token sits in the last column.  Each step runs the new tokens
through this rank's pipeline chunk (receiving/sending hidden states between
stages); the last stage gathers only the last position's logits over TP,
picks the next token (greedy, or sampled with temperature, top-k, top-p) and
broadcasts it to every rank of the model replica.  Rows stop at ``eos_id``;
decoding stops when every row has stopped or after ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megalite import batch_invariant, topology
from megalite.distributed.unwrap import unwrap
from megalite.inference import EngineConfig, LLMEngine, SamplingParams
from megalite.inference.sequence import sample_seed
from megalite.inference.sampler import filter_logits
from megalite.models import GPTModel
from megalite.models.kv_cache import KVCache
from megalite.tensor_parallel import gather_from_tensor_parallel_region


@dataclass
class SamplingConfig:
    """How the next token is chosen; ``top_k=0`` and ``top_p=1`` disable those filters."""

    max_new_tokens: int
    eos_id: int | None = None
    pad_id: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    """``tokens``/``attention_mask`` ``[b, p + n]`` (prompt then response, pad after EOS);
    ``log_probs``/``response_mask`` ``[b, n]`` for the generated tokens (EOS included, 0 after it).
    Log-probs are those of the temperature-scaled distribution before top-k/top-p filtering."""

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    log_probs: torch.Tensor
    response_mask: torch.Tensor

    def sampled(self, row: int, prompt_width: int) -> tuple[list[int], list[float]]:
        """Row ``row``'s generated token ids and their log-probs (EOS included, nothing after it), for prompts
        of ``prompt_width`` columns."""
        k = int(self.response_mask[row].sum())
        return self.tokens[row, prompt_width:prompt_width + k].tolist(), self.log_probs[row, :k].tolist()


def choose_tokens(logits: torch.Tensor, config: SamplingConfig,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[b]`` from full-vocabulary logits ``[b, v]`` and their log-probs ``[b]``."""
    scaled = logits.float() / config.temperature
    log_probs = batch_invariant.log_probs(logits, config.temperature)
    if config.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = filter_logits(scaled, config.top_k, config.top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class _Stages:
    """One decoding step through this rank's pipeline chunks, with the hidden-state hand-offs.

    Chunk ``c`` on rank ``r`` is virtual stage ``c * pp + r`` (interleaving); its
    input comes from the previous rank, wrapping from the last rank to rank 0's next chunk.
    """

    def __init__(self, chunks, pp_group):
        self.models = [unwrap(chunk) for chunk in chunks]
        self.group = pp_group
        self.size, self.rank = topology.group_size(pp_group), topology.group_rank(pp_group)
        self.dtype = next(self.models[0].parameters()).dtype

    def _peer(self, rank):
        return dist.get_global_rank(self.group, rank % self.size)

    def __call__(self, input_ids, attention_mask, caches) -> torch.Tensor | None:
        """Last-position logits ``[b, v_pad/tp]`` on the last stage, None elsewhere."""
        last = len(self.models) - 1
        for index, model in enumerate(self.models):
            cache = None if caches is None else caches[index]
            if self.rank > 0 or index > 0:
                seq = input_ids.shape[1] // (model.tp_size if model.sequence_parallel else 1)
                hidden = torch.empty(seq, input_ids.shape[0], model.config.hidden_size, dtype=self.dtype,
                                     device=input_ids.device)
                dist.recv(hidden, src=self._peer(self.rank - 1), group=self.group)
                model.set_input_tensor(hidden)
            output = model(input_ids, kv_cache=cache, attention_mask=attention_mask)
            if self.rank < self.size - 1 or index < last:
                dist.send(output.contiguous(), dst=self._peer(self.rank + 1), group=self.group)
            else:
                return output[:, -1]
        return None


@torch.no_grad()
def generate(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, config: SamplingConfig,
             generator: torch.Generator | None = None, use_cache: bool = True, pp_group=None) -> GenerationOutput:
    """Decode continuations of left-padded ``prompts [b, p]`` with this rank's chunk of the model
    (or its list of chunks under an interleaved pipeline).

    Every rank of a model replica (its TP and PP ranks) calls this with the
    same prompts; the tokens chosen on TP rank 0 of the last stage are used
    everywhere.  Without ``use_cache`` each step reruns the whole sequence.
    """
    if prompts.dim() != 2 or tuple(prompt_mask.shape) != tuple(prompts.shape):
        raise ValueError(f"prompts must be [b, p] with a prompt_mask of the same shape, got "
                         f"{tuple(prompts.shape)} and {tuple(prompt_mask.shape)}")
    if bool((prompt_mask.sum(dim=1) == 0).any()):
        raise ValueError("every prompt needs at least one real token; a row of prompt_mask is all zeros")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    inner = unwrap(chunks[0])
    total = prompts.shape[1] + config.max_new_tokens
    if total > inner.config.max_position_embeddings:
        raise ValueError(f"prompt length {prompts.shape[1]} + max_new_tokens {config.max_new_tokens} = {total} "
                         f"exceeds max_position_embeddings={inner.config.max_position_embeddings}")
    pp_group = topology.resolve_group(pp_group, "pp")
    stages = _Stages(chunks, pp_group)
    last_stage = stages.rank == stages.size - 1
    tp_group = inner.tp_group
    was_training = inner.training
    for chunk in stages.models:
        chunk.eval()
    b, device = prompts.shape[0], prompts.device
    tokens, mask = prompts.clone(), prompt_mask.to(prompts.dtype).clone()
    caches = [KVCache() for _ in chunks] if use_cache else None
    step_ids = tokens
    done = torch.zeros(b, dtype=torch.bool, device=device)
    new_tokens, new_log_probs, new_mask = [], [], []
    for _ in range(config.max_new_tokens):
        logits = stages(step_ids if use_cache else tokens, mask, caches)
        chosen = torch.empty(b, dtype=torch.long, device=device)
        log_prob = torch.empty(b, dtype=torch.float32, device=device)
        if last_stage:
            full = gather_from_tensor_parallel_region(logits, tp_group)[:, :inner.config.vocab_size]
            chosen, log_prob = choose_tokens(full, config, generator)
            if topology.group_size(tp_group) > 1:
                src = dist.get_global_rank(tp_group, 0)
                dist.broadcast(chosen, src=src, group=tp_group)
                dist.broadcast(log_prob, src=src, group=tp_group)
        if stages.size > 1:
            src = stages._peer(stages.size - 1)
            dist.broadcast(chosen, src=src, group=pp_group)
            dist.broadcast(log_prob, src=src, group=pp_group)
        alive = ~done
        chosen = torch.where(alive, chosen, torch.full_like(chosen, config.pad_id))
        new_tokens.append(chosen)
        new_log_probs.append(torch.where(alive, log_prob, torch.zeros_like(log_prob)))
        new_mask.append(alive.to(prompts.dtype))
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        mask = torch.cat([mask, alive.to(mask.dtype)[:, None]], dim=1)
        step_ids = chosen[:, None]
        if config.eos_id is not None:
            done = done | (chosen == config.eos_id)
        if bool(done.all()):
            break
    for chunk in stages.models:
        chunk.train(was_training)
    return GenerationOutput(tokens=tokens, attention_mask=mask, log_probs=torch.stack(new_log_probs, dim=1),
                            response_mask=torch.stack(new_mask, dim=1))


def engine_supports(model) -> bool:
    """Whether the inference engine can run ``model``: one whole chunk (pp=1), no sequence or context
    parallelism, and whole weights (the engine calls the layers directly, so FSDP2's DTensor shards would
    never be gathered)."""
    if isinstance(model, (list, tuple)):
        return False
    inner = unwrap(model)
    if not isinstance(inner, GPTModel):  # a user's own module (TrainingService strategy "ddp"/"fsdp2")
        return False
    return (inner.pre_process and inner.post_process and not inner.sequence_parallel and inner.cp_size == 1
            and not any(isinstance(p, DTensor) for p in inner.parameters()))


class RolloutEngine:
    """:func:`generate`'s contract on the inference engine (pp=1), with one engine built for ``model`` and reused.

    The engine runs on the model's weights in place, so an optimizer step is seen by the next call with no copy.
    Prefix caching is off: the weights change between calls, so no cached prefix may outlive one.  The KV pool is
    sized for the largest batch seen and grows (a new engine) only when a call needs more blocks.  Row ``i``
    samples with a seed drawn from ``generator`` (or from the engine's default seed), so rollouts are
    reproducible and equal those of a fresh engine.  With ``share_prompts`` consecutive rows of one prompt (a
    GRPO group) are one request of ``n`` samples: the prompt is prefilled once and its KV blocks are shared by the
    samples, each sample keeping its row's seed, so the tokens and log-probs are those of one request per row.
    """

    def __init__(self, model, block_size: int = 16, share_prompts: bool = True):
        self.model, self.block_size, self.share_prompts = model, block_size, share_prompts
        self.engine: LLMEngine | None = None
        self.builds = 0

    def _engine_for(self, rows: int, width: int) -> LLMEngine:
        blocks = rows * -(-width // self.block_size)
        config = self.engine.config if self.engine is not None else None
        if config is None or config.num_blocks < blocks or config.max_num_seqs < rows:
            self.engine = LLMEngine(self.model, EngineConfig(
                block_size=self.block_size, num_blocks=blocks, max_num_batched_tokens=max(512, width),
                max_num_seqs=rows, enable_prefix_caching=False,
                # no CUDA graphs: their memory pool would stay on the device through training, and offloading
                # moves the weights between rollouts (each move would capture them again)
                cuda_graphs=False))
            self.builds += 1
        return self.engine

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, config: SamplingConfig,
                 generator: torch.Generator | None = None) -> GenerationOutput:
        """Continuations of left-padded ``prompts [b, p]``, laid out like :func:`generate`'s."""
        if prompts.dim() != 2 or tuple(prompt_mask.shape) != tuple(prompts.shape):
            raise ValueError(f"prompts must be [b, p] with a prompt_mask of the same shape, got "
                             f"{tuple(prompts.shape)} and {tuple(prompt_mask.shape)}")
        b, p = prompts.shape
        lengths = prompt_mask.sum(dim=1).tolist()
        if min(lengths) == 0:
            raise ValueError("every prompt needs at least one real token; a row of prompt_mask is all zeros")
        table = prompts.tolist()  # one transfer, then each row's real tokens as a list
        rows = [table[i][p - n:] for i, n in enumerate(lengths)]
        if generator is not None:
            seeds = torch.randint(2 ** 62, (b,), generator=generator, device=generator.device).tolist()
        else:
            seeds = [None] * b
        runs: list[list[int]] = []  # [first row, rows] of each request
        for i, row in enumerate(rows):
            if self.share_prompts and runs and rows[runs[-1][0]] == row:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        stop = [] if config.eos_id is None else [config.eos_id]
        temperature = 0 if config.greedy else config.temperature
        params = [SamplingParams(n=n, max_tokens=config.max_new_tokens, temperature=temperature,
                                 top_k=config.top_k, top_p=config.top_p, seed=seeds[first], stop_token_ids=stop,
                                 logprobs=0)
                  for first, n in runs]
        # Each sample draws from the stream its row would have as a request of its own.
        sample_seeds = [None if seeds[first] is None else [sample_seed(s, 0) for s in seeds[first:first + n]]
                        for first, n in runs]
        engine = self._engine_for(b, p + config.max_new_tokens)
        training = engine.model.training  # eval mode once for the call, not switched around each engine step
        engine.model.eval()
        try:
            outputs = engine.generate([rows[first] for first, _ in runs], params, sample_seeds)
        finally:
            engine.model.train(training)
        completions = [c for o in outputs for c in o.outputs]
        n = max(len(c.token_ids) for c in completions)
        pads = [n - len(c.token_ids) for c in completions]  # each response padded on the right, one tensor each
        response = torch.tensor([c.token_ids + [config.pad_id] * k for c, k in zip(completions, pads)],
                                dtype=prompts.dtype, device=prompts.device)
        response_mask = torch.tensor([[1] * (n - k) + [0] * k for k in pads], dtype=prompts.dtype,
                                     device=prompts.device)
        log_probs = torch.tensor([list(c.logprobs) + [0.0] * k for c, k in zip(completions, pads)],
                                 dtype=torch.float32, device=prompts.device)
        return GenerationOutput(tokens=torch.cat([prompts, response], dim=1),
                                attention_mask=torch.cat([prompt_mask.to(prompts.dtype), response_mask], dim=1),
                                log_probs=log_probs, response_mask=response_mask)


def engine_generate(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, config: SamplingConfig,
                    generator: torch.Generator | None = None, block_size: int = 16) -> GenerationOutput:
    """One call of :class:`RolloutEngine` on a fresh engine (a loop that samples again should keep the
    ``RolloutEngine``)."""
    return RolloutEngine(model, block_size).generate(prompts, prompt_mask, config, generator)
