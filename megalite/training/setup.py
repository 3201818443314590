"""Setting up a training run: flags and process groups, this rank's model chunks, optimizer, seeds, data.

``pretrain`` (:mod:`megalite.training.training`) calls these in order; each step that can fail on
bad flags or data raises ValueError on every rank before any collective that could hang.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from functools import partial

import torch
import torch.distributed as dist

from megalite import topology
from megalite.context_parallel import prepare_batch
from megalite.data.sampler import MicroBatchSampler, build_data_iterator
from megalite.distributed import DistributedDataParallel, FullyShardedDataParallel
from megalite.lora import apply_lora
from megalite.optim import get_optimizer
from megalite.optim.replicas import counts_on_this_rank
from megalite.pipeline import build_chunks
from megalite.tensor_parallel import model_parallel_seed
from megalite.training.arguments import (architecture_differences, format_args, stage_layers,
                                         use_checkpoint_architecture, validate_args)
from megalite.training.checkpointing import checkpoint_info
from megalite.training.data_checks import check_data, eod_token_id
from megalite.training.flags import (ddp_config, fsdp_config, gpt_config, lora_config, optimizer_config, packing_config,
                                     parse_args)
from megalite.training.megatron_compat import accepted_without_effect
from megalite.training.save_dir import SaveDirLock, check_not_overwriting, check_writable_with_room


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
    notes = accepted_without_effect(args)
    if notes and rank == 0:
        print(notes, flush=True)
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
    needs = [flag for flag, on in (("--finetune", args.finetune), ("--use-checkpoint-args", args.use_checkpoint_args),
                                   ("--exit-on-missing-checkpoint", args.exit_on_missing_checkpoint)) if on]
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
    if info["lora"] is not None:
        raise ValueError(f"--load {args.load} holds LoRA adapters, not a base model: pass the base model as --load "
                         "(with --finetune --lora-rank) and the adapters' directory as --save to resume them")
    if args.use_checkpoint_args:
        if info["config"] is None:
            raise ValueError(f"--use-checkpoint-args: checkpoint {args.load} stores no model architecture")
        flags = use_checkpoint_architecture(args, info["config"])
        if rank == 0:
            print(f"architecture from checkpoint {args.load}: {' '.join(flags)}", flush=True)
    return info


def param_dtype(args) -> torch.dtype:
    """The parameter (and activation) dtype of ``--bf16`` / ``--fp16``, else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def build_model(model_provider, args, topo) -> list:
    """This rank's model chunks (:func:`megalite.pipeline.build_chunks`), each wrapped for data-parallel
    gradient reduction; frozen under ``--lora-rank`` (so DDP keeps no gradient buffer for them)."""
    ddp = ddp_config(args)
    modules = build_chunks(partial(model_provider, args), args.num_layers, topo.pp.group,
                           vpp=args.virtual_pipeline_model_parallel_size, schedule=args.pipeline_schedule,
                           first_stage_layers=args.decoder_first_pipeline_num_layers,
                           last_stage_layers=args.decoder_last_pipeline_num_layers,
                           stage_layers=stage_layers(args))
    chunks = []
    for module in modules:
        # Dense weights are replicated over dp x cp (each CP rank sees other tokens of the same samples).
        if args.use_torch_fsdp2:
            module.to(device=topology.device())
            chunks.append(FullyShardedDataParallel(module, fsdp_config(args), topo.dp_cp.group, topo.expert_dp.group))
        else:
            module.to(device=topology.device(), dtype=param_dtype(args))
            if args.lora_rank is not None:
                module.requires_grad_(False)
            chunks.append(DistributedDataParallel(module, ddp, topo.dp_cp.group, topo.expert_dp.group))
    return chunks


def build_adapters(args, model_chunks, topo) -> DistributedDataParallel | None:
    """``--lora-rank``: fp32 adapters hooked onto the (frozen) chunks, wrapped for DP gradient averaging;
    the optimizer, gradient reduction and checkpoints then take this one module.  None without the flag.

    The adapters' gradients are reduced once, after the last micro-batch (no overlap): the schedule's
    ``no_sync`` covers the model chunks, not this module, and the adapters are small.
    """
    config = lora_config(args)
    if config is None:
        return None
    lora = apply_lora(model_chunks, config)
    lora.to(device=topology.device())
    ddp = dataclasses.replace(ddp_config(args), overlap_grad_reduce=False)
    return DistributedDataParallel(lora, ddp, topo.dp_cp.group, topo.expert_dp.group)


def build_optimizer(args, model_chunks):
    """The optimizer of the flags (mixed precision, ZeRO-1, clipping) over every chunk's parameters."""
    config = optimizer_config(args)
    return get_optimizer(config, model_chunks)


def num_samples(args) -> list[int]:
    """Samples the train, valid and test splits are asked for, as Megatron-LM asks: ``--train-samples`` (else
    ``--train-iters`` global batches) and the evaluations' global batches."""
    train = args.train_samples if args.train_samples is not None else args.train_iters * args.global_batch_size
    if not args.eval_interval or not args.eval_iters:
        return [train, 0, 0]
    evals = args.train_iters // args.eval_interval + 1
    return [train, evals * args.eval_iters * args.global_batch_size, args.eval_iters * args.global_batch_size]


PREPARED = ("tokens", "assistant_mask", "document_ids")  # the fields prepare_batch turns into its own


def micro_batch_iterator(dataset, consumed_samples, args, topo, ramp=None):
    """This DP rank's micro-batches from ``consumed_samples`` on; one iterator per model chunk under vpp.

    ``ramp`` (a :class:`megalite.training.batch_ramp.BatchSizeRamp`) sizes the global batches of a
    ``--rampup-batch-size`` run.

    With context parallelism or packed-sequence flags each micro-batch becomes
    this CP rank's chunks plus their positions, documents and loss mask
    (:func:`megalite.context_parallel.prepare_batch`), as does a dataset of packed chat samples
    (``packed_documents``, :class:`megalite.data.sft.SFTDataset`); otherwise it stays ``{"tokens": [mb, seq+1]}``.
    A prepared micro-batch keeps the dataset's other per-sample fields (KTO's ``desirable`` labels) as they are.
    """
    if dataset is None:
        return None
    packing = packing_config(args)
    if packing.enabled:
        packing.eod_token_id = eod_token_id(args)
    prepare = packing.enabled or topo.cp.size > 1 or getattr(dataset, "packed_documents", False)

    def one():
        sampler = MicroBatchSampler(len(dataset), consumed_samples, args.micro_batch_size,
                                    args.global_batch_size, topo.dp.rank, topo.dp.size,
                                    batch_size_at=None if ramp is None else ramp.batch_size)
        batches = build_data_iterator(dataset, sampler)
        if not prepare:
            return batches
        return ({**prepare_batch(batch["tokens"], packing, topo.cp.size, topo.cp.rank, batch.get("assistant_mask"),
                                 batch.get("document_ids")),
                 **{key: value for key, value in batch.items() if key not in PREPARED}} for batch in batches)

    vpp = args.virtual_pipeline_model_parallel_size
    return one() if vpp is None else [one() for _ in range(vpp)]


def print_parameter_count(chunks, topo) -> None:
    """Rank 0 prints the model's parameter count: each parameter counted on the ranks that own its pieces."""
    local = 0
    for chunk in chunks:
        for param in chunk.parameters():
            dp = topo.expert_dp if getattr(param, "expert_parallel", False) else topo.dp_cp
            if dp.rank == 0 and counts_on_this_rank(param, topo.tp.rank, topo.expert_tp.rank, topo.pp.rank):
                local += param.numel()
    count = torch.tensor([local], dtype=torch.int64, device=topology.device())
    dist.all_reduce(count)
    if topo.global_rank == 0:
        print(f"model: {count.item():,} parameters", flush=True)


def claim_save_dir(args, loaded_iteration: int, needed_bytes: int, topo, load_dir: str | None = None,
                   group=None) -> SaveDirLock | None:
    """Rank 0 checks and locks ``--save`` (see :mod:`save_dir`); every rank of ``group`` (default: the default
    group) raises the same error.

    ``load_dir``: where this run resumed from (None: ``--load``; a LoRA run resumes from ``--save``).
    Returns rank 0's lock, None elsewhere.
    """
    lock, message = None, None
    if topo.global_rank == 0:
        try:
            warning = check_not_overwriting(args.save, load_dir or args.load, loaded_iteration,
                                            args.override_existing_checkpoints)
            check_writable_with_room(args.save, needed_bytes)
            lock = SaveDirLock(args.save)
            if warning:
                print(warning, flush=True)
        except ValueError as err:
            message = str(err)
            if lock is not None:
                lock.release()
    holder = [message]
    dist.broadcast_object_list(holder, src=0, group=group)
    if holder[0] is not None:
        raise ValueError(holder[0])
    return lock


def seed_model(args, topo) -> None:
    """Same seed on every rank for weight init; the TP tracker gives each TP rank its own dropout stream."""
    model_parallel_seed(args.seed, topo.tp.rank)
