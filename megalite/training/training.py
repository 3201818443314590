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

import os
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.moe import router_statistics
from megalite.training.arguments import lr_schedule_settings
from megalite.training.lr_schedule import LRScheduler
from megalite.training.metrics import memory_gib, peak_memory
from megalite.training.parent_death import exit_with_parent
from megalite.training.save_dir import checkpoint_bytes
from megalite.training.setup import (build_adapters, build_model, build_optimizer, claim_save_dir, initialize,
                                     micro_batch_iterator, num_samples, print_parameter_count, seed_model)
from megalite.training.signals import SigtermFlag
from megalite.training.trainer import LOSS_METRIC, Trainer, logged_name


WARMUP_ITERS = 1
"""Iterations at the start of a run left out of the measurement printed beside the plan's prediction (buffers,
optimizer state and caches are allocated in the first)."""


def _synchronize():
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def train(trainer: Trainer, train_iterator, valid_iterator, iteration: int, consumed_samples: int,
          sigterm: SigtermFlag, prediction=None) -> int:
    """Run iterations ``iteration+1 .. --train-iters``; returns the last iteration completed.

    Logged losses are means over the iterations since the last log; throughput
    counts training steps only, not evaluation or checkpointing.  With a ``prediction`` (see ``pretrain``),
    the first log after ``WARMUP_ITERS`` iterations also prints the measured step time, peak memory (the
    largest over ranks) and MFU of the iterations since the warm-up beside it.
    """
    args = trainer.args
    sums: dict[str, float] = {}
    steps, skipped, seconds, samples = 0, 0, 0.0, 0
    warm = [0, 0.0, 0]  # iterations, seconds, samples after the warm-up, until the measurement is printed
    saved_at, first_iteration = None, iteration
    profiler = None
    batch_size = trainer.global_batch_size(consumed_samples)
    while iteration < args.train_iters:
        previous, batch_size = batch_size, trainer.global_batch_size(consumed_samples)
        if batch_size != previous:
            # Megatron-LM saves when the ramp changes the number of micro-batches.
            if trainer.topo.global_rank == 0:
                print(f"ramping up batch size from {previous} to {batch_size}", flush=True)
            if args.save and saved_at != iteration:
                trainer.save(iteration, consumed_samples)
                saved_at = iteration
        if args.profile and iteration + 1 == args.profile_step_start:
            profiler = _start_profiler()
        start = time.perf_counter()
        metrics, ok, step_values, lr = trainer.train_step(train_iterator, iteration + 1, batch_size)
        _synchronize()
        elapsed = time.perf_counter() - start
        seconds += elapsed
        iteration += 1
        if iteration - first_iteration > WARMUP_ITERS:
            warm = [warm[0] + 1, warm[1] + elapsed, warm[2] + batch_size]
        if profiler is not None and (iteration + 1 == args.profile_step_end or iteration == args.train_iters):
            _stop_profiler(profiler, args, trainer.topo.global_rank)
            profiler = None
        consumed_samples += batch_size
        trainer.nan_guard.observe_loss(iteration, metrics.get(LOSS_METRIC), consumed_samples - batch_size,
                                       consumed_samples)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value
        steps, skipped, samples = steps + 1, skipped + int(not ok), samples + batch_size
        evaluated = {}
        if valid_iterator is not None and args.eval_interval and iteration % args.eval_interval == 0:
            evaluated = trainer.evaluate(valid_iterator)
        if iteration % args.log_interval == 0 or evaluated or iteration == args.train_iters:
            values = {logged_name(k): v / steps for k, v in sums.items()}
            values.update(lr=lr, global_batch_size=batch_size, loss_scale=float(trainer.optimizer.get_loss_scale()),
                          skipped=skipped, consumed_samples=consumed_samples,
                          **trainer.throughput(seconds / steps, samples / steps), **evaluated)
            values.update(step_values)
            if args.log_params_norm:
                values["params_norm"] = trainer.optimizer.params_norm()
            if args.num_experts:
                layers = args.num_layers + (args.mtp_num_layers or 0)  # MTP layers are numbered after the decoder's
                values.update(router_statistics(trainer.chunks, layers, args.num_experts,
                                                (trainer.topo.pp.group, trainer.topo.dp.group), topology.device()))
            if args.log_memory:
                values.update(memory_gib())
            trainer.logger.log(iteration, values, tensorboard_extra=None if args.log_memory else memory_gib())
            sums, steps, skipped, seconds, samples = {}, 0, 0, 0.0, 0
            if prediction is not None and prediction.estimate is not None and warm[0]:
                _print_measured(trainer, prediction, *warm)
                prediction = None
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


def _print_measured(trainer: Trainer, prediction, iterations: int, seconds: float, samples: int) -> None:
    """Rank 0 prints the measurement beside the prediction; the peak memory is the largest over all ranks."""
    peak, kind = peak_memory()
    largest = torch.tensor([peak], dtype=torch.int64, device=topology.device())
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if trainer.topo.global_rank == 0:
        tokens = samples / iterations * trainer.args.seq_length
        print(prediction.measured_line(seconds / iterations, tokens, int(largest.item()), kind), flush=True)


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
                            device=topology.device())
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if late.item():
            return f"--exit-duration-in-mins {args.exit_duration_in_mins} reached"
    return None


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, args_defaults=None,
             extra_args_provider=None, *, argv=None, prepare_data_func=None, flops_per_token_func=None,
             prediction_func=None):
    """Train a model with Megatron-style flags; returns the last iteration completed.

    ``argv`` defaults to ``sys.argv[1:]``.  ``prepare_data_func(args)`` runs
    on every rank after the process groups exist when no ``--data-path`` was
    given, and may set ``args.data_path``/``args.tokenizer_model``.
    ``flops_per_token_func(args)`` gives training FLOPs per token for the
    TFLOP/s and MFU figures on GPU.  ``prediction_func(args, world)`` gives the
    planner's prediction for this run (``megalite.plan.predict.predict_run``):
    rank 0 prints its ``line()`` at start and, after warm-up, its
    ``measured_line(seconds_per_iter, tokens_per_iter, peak_memory_bytes, kind)``
    when its ``estimate`` is not None.  Bad flags or data raise ValueError on
    every rank before any collective that could hang.
    """
    exit_with_parent()
    start_time = time.time()
    args, topo = initialize(argv, extra_args_provider, args_defaults, prepare_data_func)
    seed_model(args, topo)
    chunks = build_model(model_provider, args, topo)
    print_parameter_count(chunks, topo)
    adapters = build_adapters(args, chunks, topo)
    optimizer = build_optimizer(args, chunks if adapters is None else [adapters])
    scheduler = LRScheduler(optimizer, lr_schedule_settings(args),
                            override_opt_param_scheduler=args.override_opt_param_scheduler,
                            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler)
    flops = flops_per_token_func(args) if flops_per_token_func is not None else None
    trainer = Trainer(args, topo, chunks, optimizer, scheduler, forward_step_func, flops, adapters)
    trainer.start_time = start_time
    prediction = prediction_func(args, topo.world_size) if prediction_func is not None else None
    if prediction is not None and topo.global_rank == 0:
        print(prediction.line(), flush=True)
    needed = checkpoint_bytes(trainer.trained, topo.dp.size) if args.save else 0
    iteration, consumed_samples = trainer.load() if args.load else (0, 0)
    if iteration >= args.train_iters:
        if topo.global_rank == 0:
            print(f"this run is already finished: --load {args.load} holds iteration {iteration} and --train-iters "
                  f"is {args.train_iters}; nothing to train and nothing written", flush=True)
        trainer.logger.close()
        return iteration
    requested = num_samples(args)
    train_ds, valid_ds, test_ds = train_valid_test_datasets_provider(args, requested)
    if topo.global_rank == 0:
        sizes = "/".join("-" if d is None else str(n) for d, n in zip((train_ds, valid_ds, test_ds), requested))
        source = "mock data" if args.mock_data else " ".join(args.data_path or [])
        print(f"data: {source}; train/valid/test samples {sizes}; seq length {args.seq_length}, vocabulary "
              f"{args.vocab_size}", flush=True)
    train_iterator = micro_batch_iterator(train_ds, consumed_samples, args, topo, trainer.ramp)
    valid_consumed = (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size \
        if args.eval_interval else 0
    valid_iterator = micro_batch_iterator(valid_ds, valid_consumed, args, topo)
    resumed_from = args.save if adapters is not None and iteration else args.load
    lock = claim_save_dir(args, iteration, needed, topo, resumed_from) if args.save else None
    sigterm = SigtermFlag()
    try:
        iteration = train(trainer, train_iterator, valid_iterator, iteration, consumed_samples, sigterm, prediction)
        trainer.finish_saves()
        trainer.save_timeline()
        if test_ds is not None and args.eval_iters and iteration == args.train_iters:
            trainer.logger.log(iteration, trainer.evaluate(micro_batch_iterator(test_ds, 0, args, topo), split="test"))
    finally:
        sigterm.restore()
        trainer.logger.close()
        if lock is not None:
            lock.release()
    return iteration


