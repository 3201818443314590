"""The RL trainer's models: this rank's pipeline chunk of a GPT or critic (DDP-wrapped, with its optimizer), the
actor's (and the guidance flow's guide's) warm-up pretraining on the arithmetic task, the ``--environment``'s
demonstrations or ``--prompt-data``'s completions (SFT), with a progress bar on rank 0's stderr, or its ``--load``,
and the scoring server's teacher.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace

import torch
from tqdm import tqdm

from megalite.checkpoint import load_sharded
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.distributed.unwrap import unwrap
from megalite.lora import apply_lora
from megalite.models import GPTModel
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.pipeline import build_chunks
from megalite.rlhf.arithmetic import pretrain_batch
from megalite.rlhf.backend import TrainingBackend
from megalite.rlhf.distillation import teacher_fn
from megalite.rlhf.env_tasks import make_environment, warmup_batch
from megalite.rlhf.objectives import LanguageModelObjective


def pipeline_chunk(model_cls, config, topo, device):
    """This rank's (unwrapped) pipeline chunk of ``model_cls``, built by ``pipeline.build_chunks``."""
    [module] = build_chunks(lambda **where: model_cls(config, **where), config.num_layers, topo.pp.group)
    return module.to(device)


def build(model_cls, config, topo, lr, device):
    """This rank's DDP-wrapped pipeline chunk of ``model_cls`` and its optimizer."""
    chunk = DistributedDataParallel(pipeline_chunk(model_cls, config, topo, device), DDPConfig(), topo.dp.group,
                                    topo.expert_dp.group)
    return chunk, get_optimizer(OptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0), [chunk])


def attach_adapters(args, chunk, topo, device):
    """``--lora-rank``: freeze the actor ``chunk`` and hook fp32 LoRA adapters onto it.  Returns the actor re-wrapped
    by a DDP with no gradient buffer (the warm-up's buffer is released) and ``DistributedDataParallel(adapters)``,
    the module the optimizer trains; the adapters' gradients are reduced over DP once per update."""
    module = unwrap(chunk)
    adapters = apply_lora(module, args.lora).to(device)
    for param in module.parameters():
        if hasattr(param, "main_grad"):
            del param.main_grad
    return (DistributedDataParallel(module, DDPConfig(), topo.dp.group, topo.expert_dp.group),
            DistributedDataParallel(adapters, DDPConfig(overlap_grad_reduce=False), topo.dp.group,
                                    topo.expert_dp.group))


def build_teacher(args, config, single_group, device):
    """The owner's teacher: an unsharded GPT (``--teacher-load``, else initialized from ``--seed`` + 1) and its
    served function (top-k with ``--teacher-topk``)."""
    torch.manual_seed(args.seed + 1)
    model = GPTModel(replace(config, seed=args.seed + 1), tp_group=single_group).to(device).eval()
    if args.teacher_load:
        load_sharded(args.teacher_load, [model], tp_group=single_group)
    return model, teacher_fn(model, args.teacher_topk)


def pretrain(args, topo, config, device, resume: bool = False, guide: bool = False) -> DistributedDataParallel:
    """The actor chunk, pretrained here or loaded from ``--load`` (a pretrained actor); as built when ``resume``
    (the RL checkpoint's weights come later).  ``guide``: the guidance flow's guide instead, warmed up on the
    hints of the environment's demonstrations."""
    chunk, optimizer = build(GPTModel, config, topo, args.pretrain_lr, device)
    backend = TrainingBackend(chunk, optimizer, LanguageModelObjective(), args.micro_batch_size, topo)
    if resume:
        return chunk
    if args.load:
        backend.load(args.load)
        return chunk
    rng = random.Random(args.seed + 17 * topo.dp.rank)
    name = "guide warm-up" if guide else "warm-up"
    steps = tqdm(range(1, args.pretrain_iters + 1), desc=name, unit="step", disable=topo.global_rank != 0,
                 mininterval=1.0, file=sys.stderr)
    metrics = None
    for step in steps:
        if args.environment:
            batch = warmup_batch(lambda: make_environment(args).guide_task() if guide else make_environment(args),
                                 rng, args.pretrain_batch_per_rank, args.max_total_tokens)
        elif args.prompt_set is not None:
            batch = args.prompt_set.warmup_batch(rng, args.pretrain_batch_per_rank)
        else:
            batch = pretrain_batch(rng, args.pretrain_batch_per_rank, args.max_operand)
        batch = {k: v.to(device) for k, v in batch.items()}
        metrics = backend.forward_backward(batch)
        backend.optim_step()
        steps.set_postfix_str(f"lm_loss {metrics['lm_loss']:.4f}", refresh=False)
    if topo.global_rank == 0 and metrics is not None:
        print(f"{name}: {args.pretrain_iters} steps | lm_loss {metrics['lm_loss']:.4f}", flush=True)
    return chunk
