"""``pretrain``: the Megatron-style loop that ties topology, model, data, optimizer and logging together.

A script supplies three callables, as in Megatron:

- ``model_provider(args, *, pre_process, post_process, layer_range) -> nn.Module``
  builds one model chunk holding global layers ``range(*layer_range)``;
  ``pre_process`` chunks own the embedding, ``post_process`` chunks the loss.
- ``train_valid_test_datasets_provider(args, num_samples) -> (train, valid, test)``
  where ``num_samples`` is the sample count each split must supply.
- ``forward_step_func(data_iterator, model) -> (output, loss_func)`` with
  ``loss_func(output) -> (loss, metrics)``, as the pipeline schedule expects;
  the metric named ``lm_loss`` is logged as ``loss``.

Every iteration runs through the pipeline schedule (one stage is plain
gradient accumulation), so all layouts share one code path.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint import AsyncSaver
from megalite.context_parallel import prepare_batch
from megalite.data.sampler import MicroBatchSampler, build_data_iterator
from megalite.distributed import DistributedDataParallel, FullyShardedDataParallel, finalize_model_grads
from megalite.moe import MoELayer, set_aux_loss_scale
from megalite.optim import get_optimizer
from megalite.pipeline import (PipelineRecorder, broadcast_from_last_stage, forward_backward, last_stage_rank,
                               split_layers)
from megalite.tensor_parallel import model_parallel_seed
from megalite.training.arguments import (architecture_differences, ddp_config, format_args, fsdp_config, gpt_config,
                                         nan_guard_config, optimizer_config, packing_config, parse_args,
                                         use_checkpoint_architecture, validate_args)
from megalite.training.checkpointing import checkpoint_info, load_checkpoint, save_checkpoint
from megalite.training.data_checks import check_data, eod_token_id
from megalite.training.lr_schedule import LRScheduler
from megalite.training.metrics import MetricsLogger, memory_gib, peak_tflops
from megalite.training.nan_guard import NanGuard, check_finite_weights
from megalite.training.parent_death import exit_with_parent
from megalite.training.save_dir import (SaveDirLock, check_not_overwriting, check_writable_with_room,
                                        checkpoint_bytes)
from megalite.training.signals import SigtermFlag

LOSS_METRIC = "lm_loss"
"""The metric of a loss function's report that is logged as the loss (and gives the perplexity)."""


def initialize(argv=None, extra_args_provider=None, args_defaults=None, prepare_data_func=None):
    """Parse and validate the flags, create the process groups and agree on one config.

    Everything that can be checked from the flags and the data files is
    checked before the process group exists.  Afterwards rank 0's config is
    broadcast to every rank and printed once.  Returns ``(args, topology)``.
    """
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    args = parse_args(argv, extra_args_provider, args_defaults)
    saved = _checkpoint_to_load(args, rank)
    validate_args(args, world)
    if args.data_path is not None or args.mock_data:
        check_data(args)
    if saved is not None and saved["config"] is not None and args.vocab_size is not None:
        differences = architecture_differences(saved["config"], gpt_config(args))
        if differences:
            raise ValueError(f"checkpoint {args.load} holds a different architecture: {'; '.join(differences)}")
    if args.load and saved is None and rank == 0:
        print(f"WARNING: --load {args.load} holds no checkpoint; training starts from scratch",
              file=sys.stderr, flush=True)
    topo = topology.initialize(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                               vpp=args.virtual_pipeline_model_parallel_size, cp=args.context_parallel_size,
                               ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                               timeout_s=args.distributed_timeout_minutes * 60)
    if prepare_data_func is not None and args.data_path is None and not args.mock_data:
        prepare_data_func(args)
        if args.data_path is not None:
            check_data(args)
    holder = [args if topo.global_rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    args = holder[0]
    if topo.global_rank == 0:
        print(format_args(args), flush=True)
    return args, topo


def _checkpoint_to_load(args, rank: int) -> dict | None:
    """Settle what ``--load`` gives, before any collective: the checkpoint's info, or None.

    A ``--load`` without a checkpoint gives None (``initialize`` warns once, after the flags
    and data have passed their checks, and training starts fresh: Megatron's behaviour, so the
    first launch of a restartable job works); under ``--finetune`` or ``--use-checkpoint-args``
    it is an error.  ``--use-checkpoint-args`` sets the architecture
    flags from the checkpoint.
    """
    needs = [flag for flag, on in (("--finetune", args.finetune), ("--use-checkpoint-args", args.use_checkpoint_args))
             if on]
    verb = "needs" if len(needs) == 1 else "need"
    if not args.load:
        if needs:
            raise ValueError(f"{' and '.join(needs)} {verb} --load")
        return None
    info = checkpoint_info(args.load)
    if info is None:
        if needs:
            raise ValueError(f"{' and '.join(needs)} {verb} a checkpoint, but --load {args.load} holds none")
        return None
    if args.use_checkpoint_args:
        if info["config"] is None:
            raise ValueError(f"--use-checkpoint-args: checkpoint {args.load} stores no model architecture")
        flags = use_checkpoint_architecture(args, info["config"])
        if rank == 0:
            print(f"architecture from checkpoint {args.load}: {' '.join(flags)}", flush=True)
    return info


def _param_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def build_model(model_provider, args, topo) -> list:
    """This rank's model chunks, each wrapped for data-parallel gradient reduction."""
    v_shape = args.pipeline_schedule == "zbv"
    ranges = split_layers(args.num_layers, topo.pp.size, args.virtual_pipeline_model_parallel_size,
                          args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers, v_shape)
    mine = ranges[topo.pp.rank]
    ddp = ddp_config(args)
    chunks = []
    for index, layer_range in enumerate(mine):
        if v_shape:  # chunk 0 on rank r is stage r, chunk 1 is stage 2*pp-1-r
            first, last = topo.pp.rank == 0 and index == 0, topo.pp.rank == 0 and index == 1
        else:
            first = topo.is_first_stage() and index == 0
            last = topo.is_last_stage() and index == len(mine) - 1
        module = model_provider(args, pre_process=first, post_process=last, layer_range=layer_range)
        # Dense weights are replicated over dp x cp (each CP rank sees other tokens of the same samples).
        if args.use_torch_fsdp2:
            module.to(device=_device())
            chunks.append(FullyShardedDataParallel(module, fsdp_config(args), topo.dp_cp.group, topo.expert_dp.group))
        else:
            module.to(device=_device(), dtype=_param_dtype(args))
            chunks.append(DistributedDataParallel(module, ddp, topo.dp_cp.group, topo.expert_dp.group))
    return chunks


def build_optimizer(args, model_chunks):
    config = optimizer_config(args)
    return get_optimizer(config, model_chunks)


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _num_samples(args) -> list[int]:
    train = args.train_iters * args.global_batch_size
    if not args.eval_interval or not args.eval_iters:
        return [train, 0, 0]
    evals = args.train_iters // args.eval_interval + 1
    return [train, evals * args.eval_iters * args.global_batch_size, args.eval_iters * args.global_batch_size]


def _iterator(dataset, consumed_samples, args, topo):
    """This DP rank's micro-batches from ``consumed_samples`` on; one iterator per model chunk under vpp.

    With context parallelism or packed-sequence flags each micro-batch becomes
    this CP rank's chunks plus their positions, documents and loss mask
    (:func:`megalite.context_parallel.prepare_batch`); otherwise it stays
    ``{"tokens": [mb, seq+1]}``.
    """
    if dataset is None:
        return None
    packing = packing_config(args)
    if packing.enabled:
        packing.eod_token_id = eod_token_id(args)
    prepare = packing.enabled or topo.cp.size > 1

    def one():
        sampler = MicroBatchSampler(len(dataset), consumed_samples, args.micro_batch_size,
                                    args.global_batch_size, topo.dp.rank, topo.dp.size)
        batches = build_data_iterator(dataset, sampler)
        if not prepare:
            return batches
        return (prepare_batch(batch["tokens"], packing, topo.cp.size, topo.cp.rank) for batch in batches)

    vpp = args.virtual_pipeline_model_parallel_size
    return one() if vpp is None else [one() for _ in range(vpp)]


class Trainer:
    """State of one training run: the step, evaluation, logging and checkpoint calls."""

    def __init__(self, args, topo, model_chunks, optimizer, scheduler, forward_step_func, flops_per_token=None):
        self.args = args
        self.topo = topo
        self.chunks = model_chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.forward_step_func = forward_step_func
        self.flops_per_token = flops_per_token
        seq = args.seq_length // topo.cp.size // (topo.tp.size if args.sequence_parallel else 1)
        self.tensor_shape = (seq, args.micro_batch_size, args.hidden_size)
        self.recorder = None
        if args.timeline_dir:
            self.recorder = PipelineRecorder(stage=topo.pp.rank)
        self.logger = MetricsLogger(topo.global_rank == 0, args.metrics_file, args.tensorboard_dir or None,
                                    args.train_iters)
        self.saver = AsyncSaver() if args.save and args.async_save else None
        self.nan_guard = NanGuard(nan_guard_config(args), check_grads=not args.fp16,
                                  log=topo.global_rank == 0)
        self.layout = {"tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size, "cp": topo.cp.size,
                       "ep": topo.ep.size,
                       "vpp": args.virtual_pipeline_model_parallel_size,
                       "distributed_optimizer": args.use_distributed_optimizer, "fsdp2": args.use_torch_fsdp2}

    def _finalize_grads(self, chunks):
        finalize_model_grads(chunks, self.topo.tp.group, self.topo.embedding.group)

    def _fetch_batches(self, data_iterator):
        """This iteration's micro-batches, read before the schedule starts; ranks agree none failed.

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
                               [next(iterator) for _ in range(self.args.num_microbatches)])
            except ValueError as err:
                error = str(err)
                break
        failed = torch.tensor([1.0 if error else 0.0], device=_device())
        dist.all_reduce(failed)
        if failed.item():
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, error)
            raise ValueError(next(m for m in messages if m))
        fresh = [None if b is None else iter(b) for b in batches]
        return fresh if isinstance(data_iterator, list) else fresh[0]

    def _run_schedule(self, data_iterator, forward_only: bool) -> dict[str, float]:
        """One global batch through the schedule; metrics averaged over micro-batches and DP ranks."""
        data_iterator = self._fetch_batches(data_iterator)
        results = forward_backward(self.forward_step_func, data_iterator, self.chunks, self.args.num_microbatches,
                                   tensor_shape=self.tensor_shape, dtype=_param_dtype(self.args),
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
                             dtype=torch.float64, device=_device())
        if keys and self.topo.dp_cp.size > 1:
            dist.all_reduce(local, group=self.topo.dp_cp.group)
            local /= self.topo.dp_cp.size
        values = broadcast_from_last_stage({k: v for k, v in zip(keys, local.tolist())}, self.topo.pp.group,
                                           last_stage_rank(self.topo.pp.size, self.args.pipeline_schedule))
        return values

    def train_step(self, data_iterator, iteration: int) -> tuple[dict[str, float], bool, float | None, float]:
        """Forward, backward and optimizer step on one global batch, the ``iteration``-th.

        Returns (metrics, update applied, grad norm, learning rate used).  The
        grad norm is None when clipping is off or a step was skipped (fp16
        overflow, or a non-finite iteration under ``--skip-nan-iterations``); a
        skipped step does not advance the LR schedule.  A non-finite loss or
        gradient otherwise raises :class:`NonFiniteError` before the update.
        """
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        if self.args.num_experts:
            for chunk in self.chunks:
                set_aux_loss_scale(chunk, self.optimizer.get_loss_scale() / self.args.num_microbatches)
        metrics = self._run_schedule(data_iterator, forward_only=False)
        lr = self.scheduler.get_lr()
        grads = [grad for chunk in self.chunks for grad in chunk.grad_tensors()]
        if not self.nan_guard.check(iteration, metrics.get(LOSS_METRIC), grads):
            return metrics, False, None, lr
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step()
        return metrics, ok, None if grad_norm is None else float(grad_norm), lr

    @torch.no_grad()
    def evaluate(self, data_iterator, split: str = "valid") -> dict[str, float]:
        """Metrics averaged over ``--eval-iters`` batches of ``split``, as ``{split}_*``; the loss's perplexity."""
        for chunk in self.chunks:
            chunk.eval()
        totals: dict[str, float] = {}
        for _ in range(self.args.eval_iters):
            for key, value in self._run_schedule(data_iterator, forward_only=True).items():
                totals[key] = totals.get(key, 0.0) + value / self.args.eval_iters
        for chunk in self.chunks:
            chunk.train()
        values = {f"{split}_{_logged_name(k)}": v for k, v in totals.items()}
        if LOSS_METRIC in totals:
            values[f"{split}_ppl"] = math.exp(min(20.0, totals[LOSS_METRIC]))
        return values

    def moe_stats(self) -> dict[str, float]:
        """Router statistics of the last training micro-batch, for the metrics file and TensorBoard.

        ``moe_aux_loss``/``moe_z_loss`` are means over MoE layers and DP ranks;
        ``moe_tokens_expert_<e>`` counts the (token, slot) assignments routed to
        expert e, summed over MoE layers and DP ranks (TP ranks see the same
        tokens and are not summed); ``moe_load_imbalance`` is max/mean of those
        per-layer counts, averaged over layers.  Layers are indexed by their
        global number, so summing over pipeline stages assembles the model.
        """
        experts = self.args.num_experts
        rows = torch.zeros(self.args.num_layers, 3 + experts, dtype=torch.float64, device=_device())
        for chunk in self.chunks:
            for layer in chunk.modules():
                if isinstance(layer, MoELayer) and layer.last_stats is not None:
                    stats = layer.last_stats
                    rows[layer.layer_number, :3] += torch.tensor([stats["aux_loss"], stats["z_loss"], 1.0],
                                                                 dtype=rows.dtype, device=rows.device)
                    rows[layer.layer_number, 3:] += torch.tensor(stats["tokens_per_expert"], dtype=rows.dtype,
                                                                 device=rows.device)
        for group in (self.topo.pp.group, self.topo.dp.group):
            if topology.group_size(group) > 1:
                dist.all_reduce(rows, group=group)
        rows = rows[rows[:, 2] > 0]
        if rows.shape[0] == 0:
            return {}
        seen = rows[:, 2].sum().item()
        tokens = rows[:, 3:]
        imbalance = tokens.max(1).values / tokens.mean(1).clamp_min(1e-12)
        values = {"moe_aux_loss": rows[:, 0].sum().item() / seen, "moe_z_loss": rows[:, 1].sum().item() / seen,
                  "moe_load_imbalance": imbalance.mean().item()}
        values.update({f"moe_tokens_expert_{e}": int(count) for e, count in enumerate(tokens.sum(0).tolist())})
        return values

    def throughput(self, seconds_per_iter: float) -> dict[str, float]:
        """Tokens/s of the whole job; with ``--log-throughput`` TFLOP/s per device (and MFU on a known GPU)."""
        tokens = self.args.global_batch_size * self.args.seq_length / seconds_per_iter
        values = {"tokens_per_sec": tokens, "iter_ms": 1000.0 * seconds_per_iter}
        if self.args.log_throughput and self.flops_per_token is not None:
            tflops = self.flops_per_token * tokens / self.topo.world_size / 1e12
            values["tflops"] = tflops
            dtype = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"
            peak = peak_tflops(dtype)
            if peak:
                values["mfu"] = tflops / peak
        return values

    def save(self, iteration: int, consumed_samples: int) -> None:
        """Save (with --async-save: wait for the previous save, then start this one in the background).

        Non-finite weights are never saved while the NaN guard is on."""
        if self.nan_guard.config.check_for_nan_in_loss_and_grad:
            check_finite_weights(self.chunks, iteration)
        save_checkpoint(self.args.save, iteration, self.chunks, self.optimizer, self.scheduler, consumed_samples,
                        layout=self.layout, args=self.args, save_optimizer=not self.args.no_save_optim,
                        save_rng=not self.args.no_save_rng, saver=self.saver)
        if self.topo.global_rank == 0:
            started = "started saving" if self.saver is not None else "saved"
            print(f"{started} checkpoint at iteration {iteration} to {self.args.save}", flush=True)

    def finish_saves(self) -> None:
        """Wait until the background save in flight (if any) is written, verified and published."""
        if self.saver is not None:
            self.saver.close()

    def load(self) -> tuple[int, int]:
        """Restore ``--load`` under the flags' options; prints one line: path, iteration, layout change."""
        args = self.args
        result = load_checkpoint(args.load, self.chunks, self.optimizer, self.scheduler, layout=self.layout,
                                 load_optimizer=not args.no_load_optim, load_rng=not args.no_load_rng,
                                 finetune=args.finetune)
        if self.topo.global_rank == 0 and result.saved_layout:
            start = " (--finetune: model weights only, starting at iteration 0)" if args.finetune else ""
            print(f"loaded checkpoint {args.load} at iteration {result.saved_iteration}{start}, layout "
                  f"{_layout_text(result.saved_layout)} -> {_layout_text(self.layout)}", flush=True)
        return result.iteration, result.consumed_samples

    def save_timeline(self) -> None:
        if self.recorder is not None:
            os.makedirs(self.args.timeline_dir, exist_ok=True)
            self.recorder.save(os.path.join(self.args.timeline_dir, f"rank_{self.topo.global_rank:05d}.json"))


def _layout_text(layout: dict) -> str:
    return " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "ep", "vpp") if k in layout)


def _synchronize():
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def train(trainer: Trainer, train_iterator, valid_iterator, iteration: int, consumed_samples: int,
          sigterm: SigtermFlag) -> int:
    """Run iterations ``iteration+1 .. --train-iters``; returns the last iteration completed.

    Logged losses are means over the iterations since the last log; throughput
    counts training steps only, not evaluation or checkpointing.
    """
    args = trainer.args
    sums: dict[str, float] = {}
    steps, skipped, seconds = 0, 0, 0.0
    saved_at, first_iteration = None, iteration
    profiler = None
    while iteration < args.train_iters:
        if args.profile and iteration + 1 == args.profile_step_start:
            profiler = _start_profiler()
        start = time.perf_counter()
        metrics, ok, grad_norm, lr = trainer.train_step(train_iterator, iteration + 1)
        _synchronize()
        seconds += time.perf_counter() - start
        iteration += 1
        if profiler is not None and (iteration + 1 == args.profile_step_end or iteration == args.train_iters):
            _stop_profiler(profiler, args, trainer.topo.global_rank)
            profiler = None
        consumed_samples += args.global_batch_size
        trainer.nan_guard.observe_loss(iteration, metrics.get(LOSS_METRIC), consumed_samples - args.global_batch_size,
                                       consumed_samples)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value
        steps, skipped = steps + 1, skipped + int(not ok)
        evaluated = {}
        if valid_iterator is not None and args.eval_interval and iteration % args.eval_interval == 0:
            evaluated = trainer.evaluate(valid_iterator)
        if iteration % args.log_interval == 0 or evaluated or iteration == args.train_iters:
            values = {_logged_name(k): v / steps for k, v in sums.items()}
            values.update(lr=lr, loss_scale=float(trainer.optimizer.get_loss_scale()),
                          skipped=skipped, consumed_samples=consumed_samples, **trainer.throughput(seconds / steps),
                          **evaluated)
            if grad_norm is not None:
                values["grad_norm"] = grad_norm
            if args.num_experts:
                values.update(trainer.moe_stats())
            trainer.logger.log(iteration, values, tensorboard_extra=memory_gib())
            sums, steps, skipped, seconds = {}, 0, 0, 0.0
        stop = f"{sigterm.name} received" if sigterm.agreed() else _exit_reason(args, iteration, trainer.start_time)
        if args.save and (stop or (args.save_interval and iteration % args.save_interval == 0)):
            trainer.save(iteration, consumed_samples)
            saved_at = iteration
        if stop:
            if trainer.topo.global_rank == 0:
                print(f"{stop}: stopping after iteration {iteration}", flush=True)
            break
    if args.save and saved_at != iteration and iteration > first_iteration:
        trainer.save(iteration, consumed_samples)
    return iteration


def _start_profiler():
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def _stop_profiler(profiler, args, rank: int) -> None:
    """Rank 0 prints the ops that cost the most device (else CPU) time; a trace goes to --tensorboard-dir."""
    profiler.stop()
    if rank != 0:
        return
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=key, row_limit=30), flush=True)
    if args.tensorboard_dir:
        os.makedirs(args.tensorboard_dir, exist_ok=True)
        path = os.path.join(args.tensorboard_dir, f"profile_iter{args.profile_step_start}.json")
        profiler.export_chrome_trace(path)
        print(f"profiler trace saved to {path}", flush=True)


def _exit_reason(args, iteration: int, start_time: float) -> str | None:
    """Why Megatron's --exit-interval / --exit-duration-in-mins stop training now (all ranks agree), or None."""
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval} reached"
    if args.exit_duration_in_mins:
        late = torch.tensor([time.time() - start_time > 60.0 * args.exit_duration_in_mins], dtype=torch.int32,
                            device=_device())
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if late.item():
            return f"--exit-duration-in-mins {args.exit_duration_in_mins} reached"
    return None


def _logged_name(key: str) -> str:
    """The loss function's ``lm_loss`` metric is logged as ``loss``; other metrics keep their names."""
    return "loss" if key == LOSS_METRIC else key


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, args_defaults=None,
             extra_args_provider=None, *, argv=None, prepare_data_func=None, flops_per_token_func=None):
    """Train a model with Megatron-style flags; returns the last iteration completed.

    ``argv`` defaults to ``sys.argv[1:]``.  ``prepare_data_func(args)`` runs
    on every rank after the process groups exist when no ``--data-path`` was
    given, and may set ``args.data_path``/``args.tokenizer_model``.
    ``flops_per_token_func(args)`` gives training FLOPs per token for the
    TFLOP/s and MFU figures on GPU.  Bad flags or data raise ValueError on
    every rank before any collective that could hang.
    """
    exit_with_parent()
    start_time = time.time()
    args, topo = initialize(argv, extra_args_provider, args_defaults, prepare_data_func)
    _seed(args, topo)
    chunks = build_model(model_provider, args, topo)
    _print_parameter_count(chunks, topo)
    optimizer = build_optimizer(args, chunks)
    scheduler = LRScheduler(optimizer, args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                            args.lr_decay_style)
    flops = flops_per_token_func(args) if flops_per_token_func is not None else None
    trainer = Trainer(args, topo, chunks, optimizer, scheduler, forward_step_func, flops)
    trainer.start_time = start_time
    needed = checkpoint_bytes(chunks, topo.dp.size) if args.save else 0
    iteration, consumed_samples = trainer.load() if args.load else (0, 0)
    if iteration >= args.train_iters:
        if topo.global_rank == 0:
            print(f"this run is already finished: --load {args.load} holds iteration {iteration} and --train-iters "
                  f"is {args.train_iters}; nothing to train and nothing written", flush=True)
        trainer.logger.close()
        return iteration
    train_ds, valid_ds, test_ds = train_valid_test_datasets_provider(args, _num_samples(args))
    if topo.global_rank == 0:
        sizes = "/".join("-" if d is None else str(len(d)) for d in (train_ds, valid_ds, test_ds))
        source = "mock data" if args.mock_data else " ".join(args.data_path or [])
        print(f"data: {source}; train/valid/test samples {sizes}; seq length {args.seq_length}, vocabulary "
              f"{args.vocab_size}", flush=True)
    train_iterator = _iterator(train_ds, consumed_samples, args, topo)
    valid_consumed = (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size \
        if args.eval_interval else 0
    valid_iterator = _iterator(valid_ds, valid_consumed, args, topo)
    lock = _claim_save_dir(args, iteration, needed, topo) if args.save else None
    sigterm = SigtermFlag()
    try:
        iteration = train(trainer, train_iterator, valid_iterator, iteration, consumed_samples, sigterm)
        trainer.finish_saves()
        trainer.save_timeline()
        if test_ds is not None and args.eval_iters and iteration == args.train_iters:
            trainer.logger.log(iteration, trainer.evaluate(_iterator(test_ds, 0, args, topo), split="test"))
    finally:
        sigterm.restore()
        trainer.logger.close()
        if lock is not None:
            lock.release()
    return iteration


def _print_parameter_count(chunks, topo) -> None:
    """Rank 0 prints the model's parameter count: each parameter counted on the ranks that own its pieces."""
    local = 0
    for chunk in chunks:
        for param in chunk.parameters():
            sharded = getattr(param, "tensor_model_parallel", False)
            if getattr(param, "expert_parallel", False):
                owner = topo.expert_dp.rank == 0 and (sharded or topo.expert_tp.rank == 0)
            else:
                owner = topo.dp.rank == 0 and (sharded or topo.tp.rank == 0)
            if getattr(param, "shared_embedding", False) and not topo.is_first_stage():
                owner = False
            local += param.numel() if owner else 0
    count = torch.tensor([local], dtype=torch.int64, device=_device())
    dist.all_reduce(count)
    if topo.global_rank == 0:
        print(f"model: {count.item():,} parameters", flush=True)


def _claim_save_dir(args, loaded_iteration: int, needed_bytes: int, topo) -> SaveDirLock | None:
    """Rank 0 checks and locks ``--save`` (see :mod:`save_dir`); every rank raises the same error.

    Returns rank 0's lock, None elsewhere.
    """
    lock, message = None, None
    if topo.global_rank == 0:
        try:
            warning = check_not_overwriting(args.save, args.load, loaded_iteration, args.override_existing_checkpoints)
            check_writable_with_room(args.save, needed_bytes)
            lock = SaveDirLock(args.save)
            if warning:
                print(warning, flush=True)
        except ValueError as err:
            message = str(err)
            if lock is not None:
                lock.release()
    holder = [message]
    dist.broadcast_object_list(holder, src=0)
    if holder[0] is not None:
        raise ValueError(holder[0])
    return lock


def _seed(args, topo) -> None:
    """Same seed on every rank for weight init; the TP tracker gives each TP rank its own dropout stream."""
    model_parallel_seed(args.seed, topo.tp.rank)
