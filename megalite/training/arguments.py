"""Validation of pretraining's flags against the world size, and the architecture saved in a checkpoint.

``validate_args`` checks a parsed Namespace (``megalite.training.flags.parse_args``) against the
world size alone, building the configs (which validate themselves) and filling in derived values.
It runs before any process group exists, so a bad flag raises one ValueError on every rank and
nothing hangs.
"""

from __future__ import annotations

import argparse
import importlib.util
import math

from megalite.context_parallel import check_context_parallel
from megalite.data.gpt_dataset import parse_split
from megalite.flags import UNSET as _UNSET
from megalite.lora.state import check_model
from megalite.models import GPTConfig
from megalite.models.architecture import architecture_values, compare_architecture, config_from_dict
from megalite.models.mtp import check_mtp_layout
from megalite.pipeline import parse_layout, split_flags_layout, split_layers
from megalite.pipeline.schedules import check_schedule
from megalite.training.batch_ramp import batch_ramp
from megalite.training.flags import (FLAGS, context_parallel_config, ddp_config, gpt_config, lr_schedule_config,
                                     lora_config, nan_guard_config, optimizer_config)
from megalite.training.lr_schedule import ScheduleSettings, schedule_settings


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        _require(value is not None and value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _check_model(args):
    """Build the configs (their own validation runs) and copy the sizes they derive into ``args``."""
    _require(args.num_query_groups is not None or not args.group_query_attention,
             "--group-query-attention needs --num-query-groups")
    _require(not (args.swiglu and args.openai_gelu), "--swiglu and --openai-gelu are mutually exclusive")
    config = gpt_config(args, vocab_size=args.vocab_size or 1)
    config.validate(args.tensor_model_parallel_size)
    check_mtp_layout(config, pipelined=args.pipeline_model_parallel_size > 1)
    if config.moe is not None:
        config.moe.validate(args.expert_model_parallel_size,
                            args.expert_tensor_parallel_size or args.tensor_model_parallel_size)
        args.moe_ffn_hidden_size = config.moe.ffn_hidden_size
    elif args.expert_model_parallel_size != 1:
        raise ValueError(f"expert-parallel size {args.expert_model_parallel_size} needs --num-experts")
    args.ffn_hidden_size = config.ffn_hidden_size
    args.num_query_groups = config.num_query_groups
    args.max_position_embeddings = config.max_position_embeddings
    if config.position_embedding_type == "learned_absolute":
        _require(args.seq_length <= config.max_position_embeddings,
                 f"sequence length {args.seq_length} is greater than max position embeddings "
                 f"{config.max_position_embeddings}")
    optimizer_config(args)
    ddp_config(args)
    context_parallel_config(args)


def _check_parallel(args, world_size):
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    _require(world_size % (tp * pp * cp) == 0,
             f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    _check_context_parallel(args)
    etp = args.expert_tensor_parallel_size or tp
    ep = args.expert_model_parallel_size
    _require(world_size % (etp * ep * pp) == 0,
             f"world size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = {etp * ep * pp}")
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        _require(pp > 1, f"virtual pipeline size {vpp} needs pipeline size > 1, got {pp}")
    if tp == 1:
        args.sequence_parallel = False
    if args.sequence_parallel:
        _require(args.seq_length % tp == 0,
                 f"sequence length {args.seq_length} is not divisible by tensor-parallel size {tp} "
                 f"(needed by --sequence-parallel)")


def _check_fsdp(args):
    if not args.use_torch_fsdp2:
        return
    _require(not args.use_distributed_optimizer,
             "--use-torch-fsdp2 and --use-distributed-optimizer are alternatives (FSDP2 already shards the "
             "optimizer state); pass one")
    _require(args.pipeline_schedule not in ("zero-bubble-h1", "zbv"),
             f"--use-torch-fsdp2 does not compose with --pipeline-schedule {args.pipeline_schedule}: it defers "
             "weight gradients past the backward in which FSDP2 reduce-scatters them; use 1f1b or interleaved-1f1b")
    replicas = args.data_parallel_size * args.context_parallel_size
    _require(replicas > 1,
             f"--use-torch-fsdp2 needs data-parallel x context-parallel size > 1 to shard over, got "
             f"dp={args.data_parallel_size} x cp={args.context_parallel_size} (world size {args.world_size} / "
             f"(tp {args.tensor_model_parallel_size} * pp {args.pipeline_model_parallel_size} * "
             f"cp {args.context_parallel_size}))")


def _check_context_parallel(args):
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    check_context_parallel(args.seq_length, cp, args.cp_comm_type)
    if cp > 1 and args.cp_comm_type == "a2a":
        heads, groups = args.num_attention_heads // tp, args.num_query_groups // tp
        _require(heads % cp == 0 and groups % cp == 0,
                 f"--cp-comm-type a2a needs the attention heads {heads} and query groups {groups} per tensor-parallel "
                 f"rank to be divisible by the context-parallel size {cp}")
    if cp > 1 or args.reset_attention_mask:
        _require(args.attention_dropout == 0.0,
                 f"--attention-dropout {args.attention_dropout} is not supported with context parallelism or "
                 f"--reset-attention-mask; set it to 0")


def _check_batch(args):
    micro, dp = args.micro_batch_size, args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = micro * dp
    _positive(args, "global_batch_size")
    _require(args.global_batch_size % (micro * dp) == 0,
             f"global batch size {args.global_batch_size} is not divisible by micro batch size {micro} "
             f"* data-parallel size {dp} = {micro * dp}")
    args.num_microbatches = args.global_batch_size // (micro * dp)
    ramp = batch_ramp(args)
    if ramp is not None:
        _require(ramp.start % (micro * dp) == 0 and ramp.increment % (micro * dp) == 0,
                 f"--rampup-batch-size {ramp.start} {ramp.increment} {ramp.ramp_samples}: every global batch of "
                 f"the ramp must be divisible by micro batch size {micro} * data-parallel size {dp} = {micro * dp}")
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and args.pipeline_schedule in (None, "interleaved-1f1b"):
        for batch in _batch_sizes(args):
            _require(batch // (micro * dp) % pp == 0,
                     f"the interleaved schedule needs the number of micro-batches {batch // (micro * dp)} "
                     f"(global batch {batch} / (micro batch {micro} * dp {dp})) to be divisible by pipeline size {pp}")


def _batch_sizes(args) -> list[int]:
    """Every global batch size of the run: the ramp's (``--rampup-batch-size``), else ``--global-batch-size``."""
    ramp = batch_ramp(args)
    return [args.global_batch_size] if ramp is None else ramp.batch_sizes()


def _check_schedule(args):
    ramp = batch_ramp(args)
    _require(ramp is None or args.train_samples is not None,
             "--rampup-batch-size needs sample-based training (--train-samples), as in Megatron-LM")
    if args.train_samples is not None:
        _require(args.train_iters is None, f"--train-iters {args.train_iters} and --train-samples "
                                           f"{args.train_samples} are mutually exclusive")
        first = args.global_batch_size if ramp is None else ramp.start
        _require(args.train_samples >= first,
                 f"--train-samples {args.train_samples} is less than one global batch of {first}")
        args.train_iters = args.train_samples // args.global_batch_size if ramp is None else \
            ramp.train_iters(args.train_samples)
    elif args.train_iters is None:
        args.train_iters = 100
    _positive(args, "train_iters")
    for name in ("exit_interval", "exit_duration_in_mins"):
        if getattr(args, name) is not None:
            _require(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("save_interval", "eval_interval", "eval_iters"):
        if getattr(args, name) is not None:
            _require(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")
    if args.wandb_project:
        _require(bool(args.wandb_exp_name),
                 "--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM")
        _require(importlib.util.find_spec("wandb") is not None,
                 "--wandb-project needs the wandb package, which is not installed: pip install wandb")
    if args.profile:
        _require(1 <= args.profile_step_start < args.profile_step_end,
                 f"--profile-step-start {args.profile_step_start} must be at least 1 and below "
                 f"--profile-step-end {args.profile_step_end}")
    parse_split(args.split)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check ``args`` for a world of ``world_size`` ranks and fill in derived values.

    Raises ValueError naming the offending numbers.  Adds ``world_size``,
    ``data_parallel_size`` and ``num_microbatches``.
    """
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "seq_length", "micro_batch_size", "log_interval")
    _check_model(args)
    _check_pipeline_layout(args)
    _check_parallel(args, world_size)
    _check_fsdp(args)
    _check_batch(args)
    _check_pipeline_schedule(args)
    _check_schedule(args)
    _check_lr_schedule(args)
    _check_pipeline_split(args)
    _check_lora(args)
    nan_guard_config(args).validate()
    _require(args.distributed_timeout_minutes > 0,
             f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    if not math.isfinite(args.lr) or args.lr < 0:
        raise ValueError(f"--lr must be a non-negative number, got {args.lr}")
    return args


def _check_lora(args):
    """``--lora-*``: valid settings (a rank no target layer is too small for), on a loaded base, on the paths that
    train adapters (DDP, no MoE)."""
    config = lora_config(args)
    if config is None:
        return
    _require(args.finetune, "--lora-rank needs --finetune --load BASE: adapters train on top of a loaded base model")
    refused = [flag for flag, on in (("--use-torch-fsdp2", args.use_torch_fsdp2),
                                     ("--use-distributed-optimizer", args.use_distributed_optimizer),
                                     ("--num-experts", args.num_experts is not None)) if on]
    _require(not refused, f"--lora-rank does not work with {', '.join(refused)}: adapters train under plain "
                          "data parallelism (their optimizer state is small) on dense models")
    # the target layers' shapes do not depend on the vocabulary, which a tokenizer may only give later
    check_model(config, gpt_config(args, vocab_size=args.vocab_size or 1))


def lr_schedule_settings(args) -> ScheduleSettings:
    """The LR and weight-decay schedule of the flags, in samples as Megatron-LM builds it (after ``validate_args``)."""
    return schedule_settings(lr_schedule_config(args), lr=args.lr,
                             min_lr=args.min_lr, weight_decay=args.weight_decay,
                             global_batch_size=args.global_batch_size, train_iters=args.train_iters,
                             train_samples=args.train_samples)


def _check_lr_schedule(args):
    """The schedule flags against the run's length (Megatron's checks); fill in the decay length, as Megatron does."""
    lr_schedule_settings(args)
    if args.train_samples is None and args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.train_samples is not None and args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples


def _check_pipeline_schedule(args):
    """--pipeline-schedule against the pipeline sizes; zbv fills in its two chunks per rank."""
    schedule, pp = args.pipeline_schedule, args.pipeline_model_parallel_size
    if schedule is None or pp == 1 and schedule != "zbv":
        return
    if schedule == "zbv":
        if args.virtual_pipeline_model_parallel_size is None:
            args.virtual_pipeline_model_parallel_size = 2
        _require(not (pp > 1 and not args.untie_embeddings_and_output_weights),
                 f"--pipeline-schedule zbv puts the first and last stage on pipeline rank 0; tied embeddings "
                 f"need --untie-embeddings-and-output-weights (pp={pp})")
        _require(not (pp > 1 and args.mtp_num_layers),
                 f"--pipeline-schedule zbv puts the first and last stage on pipeline rank 0; --mtp-num-layers "
                 f"needs another schedule (pp={pp})")
    micro_times_dp = args.micro_batch_size * args.data_parallel_size
    for batch in _batch_sizes(args):
        check_schedule(schedule, pp, args.virtual_pipeline_model_parallel_size or 1, batch // micro_times_dp)


def stage_layers(args) -> tuple[int, ...] | None:
    """Every pipeline stage's layer count that ``--pipeline-model-parallel-layout`` or, at pp > 1,
    ``--account-for-embedding/loss-in-pipeline-split`` give (None without them: :func:`split_flags_layout`)."""
    layout = split_flags_layout(args.num_layers, args.pipeline_model_parallel_size,
                                args.virtual_pipeline_model_parallel_size, args.pipeline_model_parallel_layout,
                                args.mtp_num_layers, args.account_for_embedding_in_pipeline_split,
                                args.account_for_loss_in_pipeline_split)
    return None if layout is None else layout.stage_layers


def _check_pipeline_layout(args):
    """``--pipeline-model-parallel-layout``: a layout megalite builds, alone of the split flags; it sets the
    virtual pipeline size (its stages per pipeline rank).  The embedding/loss-as-a-layer splits exclude first/last
    stage layer counts (as in Megatron-LM)."""
    accounted = [f"--account-for-{what}-in-pipeline-split" for what in ("embedding", "loss")
                 if getattr(args, f"account_for_{what}_in_pipeline_split")]
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    _require(not (accounted and uneven), f"{' and '.join(accounted)} split the layers evenly; drop "
             "--decoder-first/last-pipeline-num-layers")
    if args.pipeline_model_parallel_layout is None:
        return
    layout = parse_layout(args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size, args.num_layers,
                          args.mtp_num_layers)
    _require(not uneven and not accounted, "--pipeline-model-parallel-layout gives every stage's layers; drop "
             f"{' and '.join(accounted) or '--decoder-first/last-pipeline-num-layers'}")
    _require(args.pipeline_schedule != "zbv", "--pipeline-model-parallel-layout orders stages as interleaved "
             "chunks; --pipeline-schedule zbv places them in a V")
    _require(args.pipeline_model_parallel_size > 1 or layout.vpp is None,
             f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r} has {layout.vpp} stages; "
             "without --pipeline-model-parallel-size it holds one")
    vpp = args.virtual_pipeline_model_parallel_size
    _require(vpp is None or vpp == (layout.vpp or 1),
             f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r} has {layout.vpp or 1} "
             f"stage(s) per pipeline rank, but --virtual-pipeline-model-parallel-size is {vpp}")
    args.virtual_pipeline_model_parallel_size = layout.vpp


def _check_pipeline_split(args):
    """Let the pipeline package reject layer counts that do not split over the stages."""
    split_layers(args.num_layers, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
                 args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                 v_shape=args.pipeline_schedule == "zbv", stage_layers=stage_layers(args))


def _flag_target(field: str) -> str:
    """An architecture field (``moe.<name>`` for a MoEConfig field) as the flag table names it."""
    return f"MoEConfig.{field[4:]}" if field.startswith("moe.") else f"GPTConfig.{field}"


def _flags_of(field: str) -> str:
    """The flag(s) that set architecture field ``field``, or the field itself when no flag does."""
    names = [f.name for f in FLAGS if _flag_target(field) in f.fields]
    return "/".join(names) if names else field


def architecture_differences(saved: dict, config: GPTConfig) -> list[str]:
    """Every architecture field where a saved config dict and ``config`` differ, named by its flag."""
    return [f"{_flags_of(d.field)} is {d.saved!r} in the checkpoint but {d.current!r} in this run"
            for d in compare_architecture(config_from_dict(saved), config)]


def use_checkpoint_architecture(args, saved: dict) -> list[str]:
    """Set every architecture flag on ``args`` from a saved config dict (``--use-checkpoint-args``).

    Returns the flags as they were set, for printing.
    """
    config = config_from_dict(saved)
    values = {_flag_target(field): value for field, value in architecture_values(config).items()}
    set_flags = []
    for flag in FLAGS:
        target = next((t for t in flag.fields if t in values), None)
        if target is None:
            continue
        value = values[target] if flag.sets is _UNSET else values[target] == flag.sets
        setattr(args, flag.dest, value)
        set_flags.append(flag.name if value is True else "" if value is False or value is None else f"{flag.name} {value}")
    args.vocab_size = config.vocab_size
    args.group_query_attention = config.num_query_groups != config.num_attention_heads
    return [f for f in set_flags if f]


def format_args(args: argparse.Namespace) -> str:
    """A readable, sorted listing of every flag's value, for printing once."""
    items = sorted(vars(args).items())
    width = max(len(k) for k, _ in items)
    lines = ["------------------------ arguments ------------------------"]
    lines += [f"  {k} {'.' * (width + 2 - len(k))} {v}" for k, v in items]
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
