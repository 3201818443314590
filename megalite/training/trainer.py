"""``Trainer``: one training step, evaluation, saving and loading of a pretraining run, over the pipeline schedule.

:func:`megalite.training.training.pretrain` builds it and drives it with the loop in
:func:`~megalite.training.training.train`.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint import AsyncSaver
from megalite.distributed import finalize_model_grads
from megalite.hardware import detect
from megalite.moe import set_aux_loss_scale, update_expert_bias
from megalite.pipeline import PipelineRecorder, broadcast_from_last_stage, forward_backward, last_stage_rank
from megalite.training.batch_ramp import batch_ramp
from megalite.training.checkpointing import load_checkpoint, resume_adapters, save_adapter_checkpoint, save_checkpoint
from megalite.training.flags import nan_guard_config
from megalite.training.metrics import MetricsLogger, wandb_init
from megalite.training.nan_guard import NanGuard, check_finite_weights
from megalite.training.setup import param_dtype


LOSS_METRIC = "lm_loss"
"""The metric of a loss function's report that is logged as the loss (and gives the perplexity)."""


def _layout_text(layout: dict) -> str:
    return " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "ep", "vpp") if k in layout)


def logged_name(key: str) -> str:
    """The loss function's ``lm_loss`` metric is logged as ``loss``; other metrics keep their names."""
    return "loss" if key == LOSS_METRIC else key


class Trainer:
    """State of one training run: the step, evaluation, logging and checkpoint calls.

    ``adapters``: under ``--lora-rank``, the ``DistributedDataParallel(LoRAModel)`` the optimizer steps; its
    gradients are the ones reduced and checked, and checkpoints hold it alone (the chunks are the frozen base).
    """

    def __init__(self, args, topo, model_chunks, optimizer, scheduler, forward_step_func, flops_per_token=None,
                 adapters=None):
        self.args = args
        self.topo = topo
        self.chunks = model_chunks
        self.adapters = adapters
        self.trained = model_chunks if adapters is None else [adapters]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.forward_step_func = forward_step_func
        self.flops_per_token = flops_per_token
        self.hardware = detect()  # the running GPU's profile (its peak FLOP/s for MFU); None on CPU
        self.ramp = batch_ramp(args)
        seq = args.seq_length // topo.cp.size // (topo.tp.size if args.sequence_parallel else 1)
        self.tensor_shape = (seq, args.micro_batch_size, args.hidden_size)
        self.recorder = None
        if args.timeline_dir:
            self.recorder = PipelineRecorder(stage=topo.pp.rank)
        self.logger = MetricsLogger(topo.global_rank == 0, args.metrics_file, args.tensorboard_dir or None,
                                    args.train_iters, wandb_init=wandb_init(args))
        self.saver = AsyncSaver() if args.save and args.async_save else None
        self.hf_origin = None  # a converted Hugging Face checkpoint's origin, from --load
        self.nan_guard = NanGuard(nan_guard_config(args), check_grads=not args.fp16,
                                  log=topo.global_rank == 0)
        self.layout = {"tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size, "cp": topo.cp.size,
                       "ep": topo.ep.size,
                       "vpp": args.virtual_pipeline_model_parallel_size,
                       "distributed_optimizer": args.use_distributed_optimizer, "fsdp2": args.use_torch_fsdp2}

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration after ``consumed_samples`` samples (``--rampup-batch-size``)."""
        return self.args.global_batch_size if self.ramp is None else self.ramp.batch_size(consumed_samples)

    def _finalize_grads(self, chunks):
        finalize_model_grads(self.trained, self.topo.tp.group, self.topo.embedding.group)

    def _fetch_batches(self, data_iterator, num_microbatches: int):
        """This iteration's ``num_microbatches`` micro-batches, read before the schedule starts; ranks agree
        none failed.

        Reading a batch may raise ValueError (e.g. a token id outside the
        vocabulary).  Raised inside the schedule on one rank it would leave the
        others waiting in a collective, so every rank reads first, then one
        all-reduce tells all of them, and each raises the first failing rank's message.
        """
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        batches, error = [], ""
        for iterator in iterators:
            try:
                batches.append(None if iterator is None else
                               [next(iterator) for _ in range(num_microbatches)])
            except ValueError as err:
                error = str(err)
                break
        failed = torch.tensor([1.0 if error else 0.0], device=topology.device())
        dist.all_reduce(failed)
        if failed.item():
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, error)
            raise ValueError(next(m for m in messages if m))
        fresh = [None if b is None else iter(b) for b in batches]
        return fresh if isinstance(data_iterator, list) else fresh[0]

    def _run_schedule(self, data_iterator, forward_only: bool, num_microbatches: int) -> dict[str, float]:
        """One global batch through the schedule; metrics averaged over micro-batches and DP ranks."""
        data_iterator = self._fetch_batches(data_iterator, num_microbatches)
        results = forward_backward(self.forward_step_func, data_iterator, self.chunks, num_microbatches,
                                   tensor_shape=self.tensor_shape, dtype=param_dtype(self.args),
                                   forward_only=forward_only, pp_group=self.topo.pp.group,
                                   finalize_grads_func=None if forward_only else self._finalize_grads,
                                   scale_loss=None if forward_only else self.optimizer.scale_loss,
                                   recorder=None if forward_only else self.recorder,
                                   schedule=self.args.pipeline_schedule)
        return self._reduce_metrics(results)

    def _reduce_metrics(self, results) -> dict[str, float]:
        """Mean over micro-batches on the last stage, mean over DP x CP, then sent to every pipeline stage."""
        keys = sorted(results[0]) if results else []
        local = torch.tensor([sum(float(r[k]) for r in results) / len(results) for k in keys],
                             dtype=torch.float64, device=topology.device())
        if keys and self.topo.dp_cp.size > 1:
            dist.all_reduce(local, group=self.topo.dp_cp.group)
            local /= self.topo.dp_cp.size
        values = broadcast_from_last_stage({k: v for k, v in zip(keys, local.tolist())}, self.topo.pp.group,
                                           last_stage_rank(self.topo.pp.size, self.args.pipeline_schedule))
        return values

    def train_step(self, data_iterator, iteration: int, global_batch_size: int | None = None
                   ) -> tuple[dict[str, float], bool, dict[str, float], float]:
        """Forward, backward and optimizer step on one global batch, the ``iteration``-th, of
        ``global_batch_size`` samples (None: ``--global-batch-size``).

        Returns (metrics, update applied, the step's ``grad_norm`` and, under
        ``--log-num-zeros-in-grad``, ``num_zeros``, learning rate used).  The
        step values are empty when a step was skipped (fp16 overflow, or a
        non-finite iteration under ``--skip-nan-iterations``), and there is no
        grad norm when clipping is off; a skipped step does not advance the LR schedule.  A non-finite loss or
        gradient otherwise raises :class:`NonFiniteError` before the update.
        """
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        global_batch_size = global_batch_size or self.args.global_batch_size
        num_microbatches = global_batch_size // (self.args.micro_batch_size * self.topo.dp.size)
        if self.args.num_experts or self.args.mtp_num_layers:
            for chunk in self.chunks:
                set_aux_loss_scale(chunk, self.optimizer.get_loss_scale() / num_microbatches)
        metrics = self._run_schedule(data_iterator, forward_only=False, num_microbatches=num_microbatches)
        update_expert_bias(self.chunks, self.topo.dp.group)
        lr = self.scheduler.get_lr()
        grads = [grad for chunk in self.trained for grad in chunk.grad_tensors()]
        if not self.nan_guard.check(iteration, metrics.get(LOSS_METRIC), grads):
            return metrics, False, {}, lr
        ok, grad_norm, num_zeros = self.optimizer.step()
        if ok:
            self.scheduler.step(global_batch_size)
        step_values = {"grad_norm": grad_norm, "num_zeros": num_zeros}
        return metrics, ok, {k: v for k, v in step_values.items() if v is not None}, lr

    @torch.no_grad()
    def evaluate(self, data_iterator, split: str = "valid") -> dict[str, float]:
        """Metrics averaged over ``--eval-iters`` batches of ``split``, as ``{split}_*``; the loss's perplexity."""
        for chunk in self.chunks:
            chunk.eval()
        totals: dict[str, float] = {}
        for _ in range(self.args.eval_iters):
            for key, value in self._run_schedule(data_iterator, True, self.args.num_microbatches).items():
                totals[key] = totals.get(key, 0.0) + value / self.args.eval_iters
        for chunk in self.chunks:
            chunk.train()
        values = {f"{split}_{logged_name(k)}": v for k, v in totals.items()}
        if LOSS_METRIC in totals:
            values[f"{split}_ppl"] = math.exp(min(20.0, totals[LOSS_METRIC]))
        return values

    def throughput(self, seconds_per_iter: float, samples_per_iter: float) -> dict[str, float]:
        """Tokens/s of the whole job; with ``--log-throughput`` TFLOP/s per device (and MFU on a GPU that
        a :mod:`megalite.hardware` profile names)."""
        tokens = samples_per_iter * self.args.seq_length / seconds_per_iter
        values = {"tokens_per_sec": tokens, "iter_ms": 1000.0 * seconds_per_iter}
        if self.args.log_throughput and self.flops_per_token is not None:
            tflops = self.flops_per_token * tokens / self.topo.world_size / 1e12
            values["tflops"] = tflops
            dtype = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"
            if self.hardware is not None:
                values["mfu"] = tflops * 1e12 / self.hardware.peak(dtype)
        return values

    def save(self, iteration: int, consumed_samples: int) -> None:
        """Save (with --async-save: wait for the previous save, then start this one in the background).

        Non-finite weights are never saved while the NaN guard is on.  A LoRA run's adapter checkpoints are
        small and written at once, even with --async-save."""
        if self.nan_guard.config.check_for_nan_in_loss_and_grad:
            check_finite_weights(self.trained, iteration)
        if self.adapters is not None:
            save_adapter_checkpoint(self.args.save, iteration, self.adapters, self.optimizer, self.scheduler,
                                    consumed_samples, args=self.args, save_optimizer=not self.args.no_save_optim,
                                    save_rng=not self.args.no_save_rng)
        else:
            save_checkpoint(self.args.save, iteration, self.chunks, self.optimizer, self.scheduler, consumed_samples,
                            layout=self.layout, args=self.args, save_optimizer=not self.args.no_save_optim,
                            save_rng=not self.args.no_save_rng, saver=self.saver, hf=self.hf_origin)
        if self.topo.global_rank == 0:
            started = "started saving" if self.saver is not None else "saved"
            print(f"{started} checkpoint at iteration {iteration} to {self.args.save}", flush=True)

    def finish_saves(self) -> None:
        """Wait until the background save in flight (if any) is written, verified and published."""
        if self.saver is not None:
            self.saver.close()

    def load(self) -> tuple[int, int]:
        """Restore ``--load`` under the flags' options; prints one line: path, iteration, layout change.

        Under ``--lora-rank`` ``--load`` is the base (weights only) and the run resumes from the adapter
        checkpoints in ``--save``, if any."""
        args = self.args
        result = load_checkpoint(args.load, self.chunks, self.optimizer if self.adapters is None else None,
                                 self.scheduler, layout=self.layout, load_optimizer=not args.no_load_optim,
                                 load_rng=not args.no_load_rng, finetune=args.finetune)
        self.hf_origin = result.hf
        if self.topo.global_rank == 0 and result.saved_layout:
            start = " (--finetune: model weights only, starting at iteration 0)" if args.finetune else ""
            print(f"loaded checkpoint {args.load} at iteration {result.saved_iteration}{start}, layout "
                  f"{_layout_text(result.saved_layout)} -> {_layout_text(self.layout)}", flush=True)
        if self.adapters is not None and args.save:
            result = resume_adapters(args.save, self.adapters, self.optimizer, self.scheduler,
                                     load_optimizer=not args.no_load_optim)
            if self.topo.global_rank == 0 and result.iteration:
                print(f"resuming LoRA adapters from {args.save} at iteration {result.iteration}", flush=True)
        return result.iteration, result.consumed_samples

    def save_timeline(self) -> None:
        if self.recorder is not None:
            os.makedirs(self.args.timeline_dir, exist_ok=True)
            self.recorder.save(os.path.join(self.args.timeline_dir, f"rank_{self.topo.global_rank:05d}.json"))
