"""A training backend for RL loops written outside megalite.

The caller hands over whole batches (this DP rank's share) as dicts of
``[b, ...]`` tensors and gets plain metric dicts back; tensor, pipeline and
data parallelism stay inside.  Losses are normalized by the global token (or
sequence) count, so the update does not depend on the micro-batch size or
the number of DP ranks.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint import load_sharded, save_sharded
from megalite.distributed import finalize_model_grads
from megalite.rlhf.dp_balance import token_micro_batches
from megalite.rlhf.generation import GenerationOutput, RolloutEngine, SamplingConfig, engine_supports, generate
from megalite.rlhf.ppo import global_normalizer
from megalite.rlhf.shared_groups import with_packing
from megalite.pipeline import broadcast_from_last_stage, forward_backward


class TrainingBackend:
    """``forward_backward(batch)``, ``optim_step()``, ``generate(...)`` and checkpoints for one model.

    ``chunk``: this rank's pipeline chunk wrapped by DDP (optionally ZeRO-1) or by
    ``FullyShardedDataParallel`` (FSDP2); ``optimizer``: megalite's
    optimizer over it, or over ``trained``; ``objective``: see :mod:`megalite.rlhf.objectives`.
    ``trained``: the wrapped modules whose gradients the optimizer steps (default ``[chunk]``), e.g. the
    ``DistributedDataParallel(LoRAModel)`` of LoRA adapters hooked onto a frozen ``chunk``.  ``micro_batch_tokens``:
    cut micro-batches by this many padded tokens instead of ``micro_batch_size`` rows
    (:func:`~megalite.rlhf.dp_balance.token_micro_batches`; pp=1).
    Gradients of one ``forward_backward`` call are applied by the next
    ``optim_step`` (one call each per update).  A ``forward_backward`` that raises
    leaves nothing behind (see :meth:`discard`), so a retry starts clean.
    """

    def __init__(self, chunk, optimizer, objective, micro_batch_size: int, topo: topology.Topology | None = None,
                 trained: list | None = None, micro_batch_tokens: int | None = None):
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        self.chunk, self.optimizer, self.objective = chunk, optimizer, objective
        self.trained = [chunk] if trained is None else trained
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.topo = topo or topology.current()
        if micro_batch_tokens is not None and (micro_batch_tokens < 1 or self.topo.pp.size > 1):
            raise ValueError(f"micro_batch_tokens {micro_batch_tokens} needs a positive budget and no pipeline "
                             f"stages (their micro-batches have one shape)")
        self._pending = False
        self.rollout_engine = RolloutEngine(chunk) if engine_supports(chunk) else None

    def micro_batches(self, batch: dict) -> list[dict]:
        """``batch`` cut into this backend's micro-batches (of ``micro_batch_size`` rows, or by
        ``micro_batch_tokens``), as :meth:`forward_backward` runs them."""
        first = next(iter(batch))  # input_ids for megalite's objectives; a user objective's batch may lack it
        size = batch[first].shape[0]
        for key, value in batch.items():
            if value.shape[0] != size:
                raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, {first} has {size}")
        if self.micro_batch_tokens is not None:
            return token_micro_batches(batch, self.micro_batch_tokens)
        if size % self.micro_batch_size:
            raise ValueError(f"batch of {size} sequences is not divisible by micro_batch_size={self.micro_batch_size}")
        return [{k: v[i:i + self.micro_batch_size] for k, v in batch.items()}
                for i in range(0, size, self.micro_batch_size)]

    def forward_backward(self, batch: dict, packing: tuple | None = None) -> dict[str, float]:
        """Accumulate the gradient of the objective's global mean over ``batch``; return its metrics.  ``packing``:
        the prefix-shared packing of :meth:`micro_batches` (``shared_groups.pack_micro_batches``), handed to the
        objective's forward as each micro-batch's ``packed``; None: the plain rows."""
        if self._pending:
            raise RuntimeError("forward_backward was called twice without optim_step in between")
        micro_batches = with_packing(self.micro_batches(batch), packing)
        topo = self.topo
        normalizer = global_normalizer(self.objective.normalizer_mask(batch), self.objective.mode, topo.dp.group)
        scale = len(micro_batches) * topo.dp.size

        def forward_step(iterator, chunk):
            mb = next(iterator)
            output = self.objective.forward(chunk, mb)

            def loss_func(out):
                loss, metrics = self.objective.loss(out, mb, normalizer, chunk)
                return loss * scale, metrics

            return output, loss_func

        self.chunk.train()
        try:
            results = forward_backward(forward_step, iter(micro_batches), self.chunk, len(micro_batches),
                                       pp_group=topo.pp.group, scale_loss=self.optimizer.scale_loss,
                                       finalize_grads_func=lambda chunks: finalize_model_grads(
                                           self.trained, topo.tp.group, topo.embedding.group))
        except BaseException:
            self.discard()  # the micro-batches before the failing one accumulated gradients
            raise
        self._pending = True
        return self._reduce(results)

    def _reduce(self, results: list[dict]) -> dict[str, float]:
        """Loss-like metrics (global-mean shares) are summed, the others averaged, over micro-batches and DP."""
        keys = sorted(results[0]) if results else []
        values = []
        for key in keys:
            total = sum(float(r[key]) for r in results)
            summed = key.endswith("loss") or key == "entropy"
            values.append(total if summed else total / len(results) / self.topo.dp.size)
        device = next(self.chunk.parameters()).device
        local = torch.tensor(values, dtype=torch.float64, device=device)
        if keys and self.topo.dp.size > 1:
            dist.all_reduce(local, group=self.topo.dp.group)
        return broadcast_from_last_stage(dict(zip(keys, local.tolist())), self.topo.pp.group)

    def discard(self) -> None:
        """Drop the accumulated gradient without an update, as if no ``forward_backward`` had run."""
        self.optimizer.zero_grad()
        self._pending = False

    def optim_step(self) -> dict[str, float]:
        """Apply the accumulated gradient and clear it."""
        ok, grad_norm, _ = self.optimizer.step()
        self.optimizer.zero_grad()
        self._pending = False
        return {"update_applied": float(ok), "grad_norm": float("nan") if grad_norm is None else float(grad_norm)}

    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator | None = None) -> GenerationOutput:
        """Decode continuations of this DP rank's left-padded prompts (see :func:`generation.generate`).

        Runs on the inference engine (one :class:`generation.RolloutEngine`, reused across calls); with
        pipeline stages, which the engine does not support yet, on the static decoder.
        """
        if self.rollout_engine is not None:
            return self.rollout_engine.generate(prompts, prompt_mask, sampling, generator)
        return generate(self.chunk, prompts, prompt_mask, sampling, generator, pp_group=self.topo.pp.group)

    def save(self, directory: str) -> None:
        """Save the model and optimizer in megalite's checkpoint format (collective; loads under any layout).
        Only for a backend whose optimizer trains ``chunk`` itself (not adapters hooked onto it)."""
        self._check_whole()
        save_sharded(directory, self.optimizer.num_steps, [self.chunk], self.optimizer, **self._groups())

    def load(self, directory: str) -> None:
        """Load a checkpoint written by :meth:`save` (or the trainer), whatever layout wrote it."""
        self._check_whole()
        groups = self._groups()
        load_sharded(directory, [self.chunk], self.optimizer, tp_group=groups["tp_group"],
                     ep_group=groups["ep_group"], expert_tp_group=groups["expert_tp_group"])

    def _check_whole(self) -> None:
        if self.trained != [self.chunk]:
            raise ValueError("save/load hold a model with its optimizer; this backend's optimizer trains other "
                             "modules (adapters) than its chunk")

    def _groups(self) -> dict:
        topo = self.topo
        return {"tp_group": topo.tp.group, "ep_group": topo.ep.group, "expert_tp_group": topo.expert_tp.group,
                "dp_group": topo.dp.group, "expert_dp_group": topo.expert_dp.group}
