"""A Megatron-LM training run with Megatron-Core's own optimizer, saved with its optimizer state and continued.

On tp=2 CPU ranks (gloo, local layer spec, fp32): Megatron-Core's GPTModel (:mod:`megatron_fixture`'s
architecture, saved without ``args.vocab_size`` so that the padded vocabulary is the model's, as Megatron's
softmax sees it) wrapped in Megatron-Core's ``DistributedDataParallel``, ``get_megatron_optimizer`` (torch
AdamW under its ``FP32Optimizer``), ``OptimizerParamScheduler``, ``forward_backward_no_pipelining`` and
``finalize_model_grads``, stepped the way Megatron-LM's ``train_step`` steps them.  After :data:`SAVED_AT`
iterations the run is saved as ``--ckpt-format torch_dist`` does (``generate_state_dict``: model, optimizer,
scheduler, args, iteration), then trained :data:`CONTINUED` more iterations: their losses are the reference.

Gradient clipping stays off (``clip_grad=0``): Megatron-Core's clipping asserts that gradients are CUDA tensors.
Megatron-Core's other CUDA-only calls (tensors created on ``device='cuda'``) are redirected to the CPU in the
rank processes only.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

from tests.checkpoint import megatron_fixture

SAVED_AT, CONTINUED = 2, 3
GLOBAL_BATCH, MICRO_BATCH, SEQ = 4, 2, 16
PADDED_VOCAB = megatron_fixture.ARGS["padded_vocab_size"]
# Megatron-LM's schedule lengths are in samples: 1 warmup iteration, cosine decay over 8, weight decay over the run.
SCHEDULE = dict(max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=GLOBAL_BATCH, lr_decay_steps=8 * GLOBAL_BATCH,
                lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=(SAVED_AT + CONTINUED) * GLOBAL_BATCH,
                wd_incr_style="constant")
# The same run in megalite's (Megatron-LM's) flags.
FLAGS = ["--seq-length", str(SEQ), "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
         "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
         "--lr-decay-iters", "8", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
         "--adam-eps", "1e-8", "--clip-grad", "0"]


def _on_cpu(function):
    """``function`` with ``device='cuda'`` (or a CUDA device index) replaced by the CPU."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or "cuda" in str(device)):
            kwargs["device"] = "cpu"
        return function(*args, **kwargs)
    return wrapper


def patch_cuda() -> None:
    """:func:`megatron_fixture.patch_cuda`, and tensors Megatron-Core creates on the GPU made on the CPU."""
    megatron_fixture.patch_cuda()
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def batches(samples) -> list[torch.Tensor]:
    """Micro-batches ``[MICRO_BATCH, SEQ + 1]`` of the dataset ``samples`` (megalite's ``--mock-data`` train split,
    whose samples equal Megatron-Core's MockGPTDataset's), in Megatron-LM's order."""
    return [torch.stack([torch.as_tensor(samples[i]["tokens"]) for i in range(start, start + MICRO_BATCH)])
            for start in range(0, len(samples), MICRO_BATCH)]


def _forward_step(data_iterator, model):
    """Megatron-LM's GPT forward step: mean loss over the micro-batch's tokens (no loss mask)."""
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    losses = model(inputs, positions, causal, labels=labels)

    def loss_func(output):
        total, count = output.float().sum(), torch.tensor(output.numel(), dtype=torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}
    return losses, loss_func


def _train_step(model, optimizer, scheduler, micro_batches) -> float:
    """One iteration as Megatron-LM's ``train_step`` runs it; its loss as Megatron-LM's ``training_log`` reports it."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    stats = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(micro_batches),
                                        model=[model], num_microbatches=len(micro_batches), seq_length=SEQ,
                                        micro_batch_size=MICRO_BATCH, forward_only=False)
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=GLOBAL_BATCH)
    total = torch.stack([s["lm loss"] for s in stats]).sum(0)
    return (total[0] / total[1]).item()


def _run(save_dir: str, micro_batches: list[torch.Tensor]) -> list[float]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    patch_cuda()
    tp = dist.get_world_size()
    module = megatron_fixture.build_model(tp, 1)
    module.config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=SCHEDULE["max_lr"], min_lr=SCHEDULE["min_lr"], weight_decay=SCHEDULE["start_wd"],
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0), [model])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, **SCHEDULE)
    per_iteration = len(micro_batches) // (SAVED_AT + CONTINUED)
    losses = []
    for i in range(SAVED_AT + CONTINUED):
        if i == SAVED_AT:
            _save(save_dir, model, optimizer, scheduler)
        batch = micro_batches[i * per_iteration:(i + 1) * per_iteration]
        losses.append(_train_step(model, optimizer, scheduler, batch))
    parallel_state.destroy_model_parallel()
    return losses


def _save(save_dir: str, model, optimizer, scheduler) -> None:
    """The state dict Megatron-LM's ``generate_state_dict`` builds for ``--ckpt-format torch_dist``, saved as it
    saves it."""
    tp = dist.get_world_size()
    args = argparse.Namespace(**{**megatron_fixture.ARGS, "vocab_size": None,
                                 "consumed_train_samples": SAVED_AT * GLOBAL_BATCH, "global_batch_size": GLOBAL_BATCH},
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, world_size=tp,
                              data_parallel_size=1)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": SAVED_AT,
             "model": model.module.sharded_state_dict()}  # Megatron-LM saves the unwrapped model
    state["optimizer"] = optimizer.sharded_state_dict(state)
    state["opt_param_scheduler"] = scheduler.state_dict()
    megatron_fixture.save_state(state, save_dir, SAVED_AT)


def train_and_save(save_dir: str, micro_batches: list[torch.Tensor]) -> list[float]:
    """Megatron-Core's run on 2 ranks (tp=2), saved into ``save_dir`` after :data:`SAVED_AT` iterations; the losses
    of all :data:`SAVED_AT` + :data:`CONTINUED` iterations (``micro_batches`` in order, 2 per iteration)."""
    from megalite.testing import run_distributed

    return run_distributed(_run, 2, save_dir, micro_batches, timeout=240)[0]
