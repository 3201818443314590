"""Megatron-compatible command-line flags, mapped onto the config dataclasses in one table.

``FLAGS`` is the only place a flag is defined.  A flag whose ``fields`` name
config fields (``"GPTConfig.hidden_size"``) takes its default from that
dataclass and its value goes into that field, so the CLI and the Python API
share defaults and validation; the other flags are trainer options (layout,
batch, data, logging) with their default in the table.  Adding a flag is one
``Flag(...)`` line.

``parse_args`` turns argv into a Namespace and ``validate_args`` checks it
against the world size alone, building the configs (which validate
themselves) and filling in derived values.  Both run before any process group
exists, so a bad flag raises one ValueError on every rank and nothing hangs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import MISSING, dataclass

import torch

from megalite.context_parallel import COMM_TYPES, ContextParallelConfig, PackedSequenceConfig, check_context_parallel
from megalite.data.gpt_dataset import parse_split
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.distributed import DDPConfig, FSDPConfig
from megalite.models import GPTConfig
from megalite.models.architecture import architecture_values, compare_architecture, config_from_dict
from megalite.moe import MoEConfig
from megalite.optim import OptimizerConfig
from megalite.pipeline import SCHEDULES, split_layers
from megalite.pipeline.schedules import check_schedule
from megalite.training.lr_schedule import (DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES, LRScheduleConfig,
                                           ScheduleSettings, schedule_settings)
from megalite.training.nan_guard import NanGuardConfig

_UNSET = object()
"""Marks a Flag's ``default``/``sets`` as not given (``None`` is a real default)."""

CONFIGS = {cls.__name__: cls for cls in (GPTConfig, MoEConfig, OptimizerConfig, DDPConfig, FSDPConfig,
                                         ContextParallelConfig, PackedSequenceConfig, NanGuardConfig,
                                         LRScheduleConfig)}


@dataclass(frozen=True)
class Flag:
    """One flag.

    ``fields``: the config fields it sets (``"Class.field"``); the first one's
    dataclass default is the flag's default unless ``default`` is given (only
    for a field the trainer derives, or one without a default).  ``sets``: for
    a switch, the value the fields take when it is given (else they keep their
    defaults).  The remaining keywords go to ``argparse.add_argument``.
    """

    name: str
    group: str
    fields: tuple[str, ...] = ()
    default: object = _UNSET
    sets: object = _UNSET
    type: object = None
    choices: tuple | None = None
    nargs: object = None
    help: str = ""

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    def resolved_default(self):
        if self.default is not _UNSET or not self.fields:
            return None if self.default is _UNSET else self.default
        if self.sets is not _UNSET:
            return False
        cls_name, field = self.fields[0].split(".")
        spec = {f.name: f for f in dataclasses.fields(CONFIGS[cls_name])}[field]
        if spec.default is MISSING:
            raise ValueError(f"flag {self.name}: {self.fields[0]} has no default, so the table must give one")
        return spec.default


PAR, MODEL, MOE, OPT, DATA, LOG = ("parallelism", "model", "mixture of experts", "batch and optimizer", "data",
                                   "checkpoints, evaluation and logging")
SAFE = "faults and safety"
_BOTH_OPT = ("OptimizerConfig.use_distributed_optimizer", "DDPConfig.use_distributed_optimizer")

FLAGS: tuple[Flag, ...] = (
    Flag("--tensor-model-parallel-size", PAR, default=1, type=int),
    Flag("--pipeline-model-parallel-size", PAR, default=1, type=int),
    Flag("--virtual-pipeline-model-parallel-size", PAR, type=int),
    Flag("--pipeline-schedule", PAR, choices=SCHEDULES,
         help="None: 1f1b, or interleaved-1f1b with a virtual size; zbv implies a virtual size of 2"),
    Flag("--decoder-first-pipeline-num-layers", PAR, type=int),
    Flag("--decoder-last-pipeline-num-layers", PAR, type=int),
    Flag("--expert-model-parallel-size", PAR, default=1, type=int),
    Flag("--expert-tensor-parallel-size", PAR, type=int, help="None: the tensor-parallel size"),
    Flag("--context-parallel-size", PAR, default=1, type=int,
         help="split every sequence over this many ranks (2*cp load-balanced chunks)"),
    Flag("--cp-comm-type", PAR, ("ContextParallelConfig.comm_type",), choices=COMM_TYPES,
         help="context-parallel attention: ring (p2p), all-gathered keys/values, or Ulysses all-to-all (a2a)"),
    Flag("--sequence-parallel", PAR, default=False),
    Flag("--use-distributed-optimizer", PAR, _BOTH_OPT, type=bool),
    Flag("--overlap-grad-reduce", PAR, ("DDPConfig.overlap_grad_reduce",), type=bool),
    Flag("--overlap-param-gather", PAR, ("OptimizerConfig.overlap_param_gather",), type=bool),
    Flag("--use-torch-fsdp2", PAR, default=False,
         help="shard parameters, gradients and optimizer state over DP with torch's fully_shard (FSDP2)"),
    Flag("--reshard-after-forward", PAR, ("FSDPConfig.reshard_after_forward",), type=bool,
         help="FSDP2: free gathered parameters after forward and gather them again in backward"),
    Flag("--accumulate-allreduce-grads-in-fp32", PAR, ("FSDPConfig.grad_reduce_in_fp32",), type=bool,
         help="FSDP2: reduce-scatter gradients in fp32 under --bf16/--fp16 (DDP always reduces in fp32)"),

    Flag("--num-layers", MODEL, ("GPTConfig.num_layers",), default=4, type=int),
    Flag("--hidden-size", MODEL, ("GPTConfig.hidden_size",), default=128, type=int),
    Flag("--ffn-hidden-size", MODEL, ("GPTConfig.ffn_hidden_size",), type=int,
         help="None: 4*hidden, or int(8*hidden/3/64)*64 with --swiglu"),
    Flag("--num-attention-heads", MODEL, ("GPTConfig.num_attention_heads",), default=4, type=int),
    Flag("--group-query-attention", MODEL, default=False),
    Flag("--num-query-groups", MODEL, ("GPTConfig.num_query_groups",), type=int),
    Flag("--seq-length", MODEL, default=64, type=int),
    Flag("--max-position-embeddings", MODEL, ("GPTConfig.max_position_embeddings",), default=None, type=int,
         help="None: --seq-length"),
    Flag("--position-embedding-type", MODEL, ("GPTConfig.position_embedding_type",),
         choices=("learned_absolute", "rope")),
    Flag("--rotary-base", MODEL, ("GPTConfig.rotary_base",), type=float),
    Flag("--normalization", MODEL, ("GPTConfig.normalization",), choices=("LayerNorm", "RMSNorm")),
    Flag("--norm-epsilon", MODEL, ("GPTConfig.norm_eps",), type=float),
    Flag("--kv-channels", MODEL, ("GPTConfig.kv_channels",), type=int, help="None: hidden / heads"),
    Flag("--rotary-percent", MODEL, ("GPTConfig.rotary_percent",), type=float),
    Flag("--swiglu", MODEL, ("GPTConfig.activation",), sets="swiglu"),
    Flag("--openai-gelu", MODEL, ("GPTConfig.activation",), sets="gelu_tanh", help="tanh-approximated GELU (GPT-2)"),
    Flag("--untie-embeddings-and-output-weights", MODEL, ("GPTConfig.untie_embeddings_and_output_weights",),
         type=bool),
    Flag("--disable-bias-linear", MODEL, ("GPTConfig.add_bias_linear",), sets=False),
    Flag("--hidden-dropout", MODEL, ("GPTConfig.hidden_dropout",), type=float),
    Flag("--attention-dropout", MODEL, ("GPTConfig.attention_dropout",), type=float),
    Flag("--init-method-std", MODEL, ("GPTConfig.init_method_std",), type=float),
    Flag("--make-vocab-size-divisible-by", MODEL, ("GPTConfig.make_vocab_size_divisible_by",), type=int),
    Flag("--recompute-granularity", MODEL, ("GPTConfig.recompute_granularity",), choices=("full", "selective")),
    Flag("--recompute-activations", MODEL, ("GPTConfig.recompute_granularity",), sets="selective",
         help="same as --recompute-granularity selective"),
    Flag("--recompute-method", MODEL, ("GPTConfig.recompute_method",), choices=("uniform", "block"),
         help="with --recompute-granularity full; None: uniform"),
    Flag("--recompute-num-layers", MODEL, ("GPTConfig.recompute_num_layers",), type=int, help="None: 1"),

    Flag("--num-experts", MOE, ("MoEConfig.num_experts",), default=None, type=int, help="None: a dense model"),
    Flag("--moe-ffn-hidden-size", MOE, ("MoEConfig.ffn_hidden_size",), default=None, type=int,
         help="None: --ffn-hidden-size"),
    Flag("--moe-router-topk", MOE, ("MoEConfig.topk",), type=int),
    Flag("--moe-layer-freq", MOE, ("GPTConfig.moe_layer_freq",), type=int),
    Flag("--moe-aux-loss-coeff", MOE, ("MoEConfig.aux_loss_coeff",), type=float),
    Flag("--moe-z-loss-coeff", MOE, ("MoEConfig.z_loss_coeff",), type=float),
    Flag("--moe-expert-capacity-factor", MOE, ("MoEConfig.capacity_factor",), type=float),
    Flag("--moe-token-drop-policy", MOE, ("MoEConfig.token_drop_policy",), choices=("probs", "position")),
    Flag("--moe-token-dispatcher-type", MOE, ("MoEConfig.dispatcher",), choices=("alltoall", "allgather")),
    Flag("--moe-grouped-gemm", MOE, ("MoEConfig.grouped_gemm",), type=bool),

    Flag("--micro-batch-size", OPT, default=1, type=int),
    Flag("--global-batch-size", OPT, type=int, help="None: micro-batch size * dp"),
    Flag("--train-iters", OPT, type=int, help="None: --train-samples / global batch, else 100"),
    Flag("--train-samples", OPT, type=int, help="train for this many samples (exclusive with --train-iters)"),
    Flag("--lr", OPT, ("OptimizerConfig.lr",), type=float),
    Flag("--min-lr", OPT, ("OptimizerConfig.min_lr",), type=float),
    # LR schedule (Megatron's OptimizerParamScheduler)
    Flag("--lr-decay-style", OPT, ("LRScheduleConfig.lr_decay_style",), choices=DECAY_STYLES),
    Flag("--lr-decay-iters", OPT, ("LRScheduleConfig.lr_decay_iters",), type=int, help="None: --train-iters"),
    Flag("--lr-decay-samples", OPT, ("LRScheduleConfig.lr_decay_samples",), type=int,
         help="with --train-samples; None: --train-samples"),
    Flag("--lr-warmup-iters", OPT, ("LRScheduleConfig.lr_warmup_iters",), type=int),
    Flag("--lr-warmup-samples", OPT, ("LRScheduleConfig.lr_warmup_samples",), type=int, help="with --train-samples"),
    Flag("--lr-warmup-fraction", OPT, ("LRScheduleConfig.lr_warmup_fraction",), type=float,
         help="warm up over this fraction of the decay length; ignored when --lr-warmup-iters/-samples > 0"),
    Flag("--lr-warmup-init", OPT, ("LRScheduleConfig.lr_warmup_init",), type=float,
         help="the learning rate the warmup starts from"),
    Flag("--lr-wsd-decay-style", OPT, ("LRScheduleConfig.lr_wsd_decay_style",), choices=WSD_DECAY_STYLES,
         help="how --lr-decay-style WSD anneals"),
    Flag("--lr-wsd-decay-iters", OPT, ("LRScheduleConfig.lr_wsd_decay_iters",), type=int,
         help="WSD: anneal over the last this many iterations of the decay"),
    Flag("--lr-wsd-decay-samples", OPT, ("LRScheduleConfig.lr_wsd_decay_samples",), type=int,
         help="WSD with --train-samples: anneal over the last this many samples of the decay"),
    Flag("--start-weight-decay", OPT, ("LRScheduleConfig.start_weight_decay",), type=float,
         help="with --weight-decay-incr-style linear/cosine"),
    Flag("--end-weight-decay", OPT, ("LRScheduleConfig.end_weight_decay",), type=float,
         help="with --weight-decay-incr-style linear/cosine"),
    Flag("--weight-decay-incr-style", OPT, ("LRScheduleConfig.weight_decay_incr_style",), choices=WD_INCR_STYLES,
         help="constant: --weight-decay throughout"),
    Flag("--override-opt-param-scheduler", OPT, ("LRScheduleConfig.override_opt_param_scheduler",), type=bool,
         help="on resume keep this run's schedule settings instead of requiring the checkpoint's"),
    Flag("--use-checkpoint-opt-param-scheduler", OPT, ("LRScheduleConfig.use_checkpoint_opt_param_scheduler",),
         type=bool, help="on resume take the checkpoint's schedule settings"),
    Flag("--weight-decay", OPT, ("OptimizerConfig.weight_decay",), type=float),
    Flag("--adam-beta1", OPT, ("OptimizerConfig.adam_beta1",), type=float),
    Flag("--adam-beta2", OPT, ("OptimizerConfig.adam_beta2",), type=float),
    Flag("--adam-eps", OPT, ("OptimizerConfig.adam_eps",), type=float),
    Flag("--clip-grad", OPT, ("OptimizerConfig.clip_grad",), type=float),
    Flag("--bf16", OPT, ("OptimizerConfig.bf16",), type=bool),
    Flag("--fp16", OPT, ("OptimizerConfig.fp16",), type=bool),
    Flag("--loss-scale", OPT, ("OptimizerConfig.loss_scale",), type=float, help="None: a dynamic scale"),
    Flag("--initial-loss-scale", OPT, ("OptimizerConfig.initial_loss_scale",), type=float),
    Flag("--min-loss-scale", OPT, ("OptimizerConfig.min_loss_scale",), type=float),
    Flag("--loss-scale-window", OPT, ("OptimizerConfig.loss_scale_window",), type=int),
    Flag("--hysteresis", OPT, ("OptimizerConfig.hysteresis",), type=int),
    Flag("--seed", OPT, ("GPTConfig.seed",), type=int),

    Flag("--data-path", DATA, nargs="+", help="prefixes, or weight prefix pairs: '0.3 a 0.7 b'"),
    Flag("--split", DATA, default="969,30,1"),
    Flag("--tokenizer-type", DATA, choices=TOKENIZER_TYPES,
         help="None: SentencePieceTokenizer with --tokenizer-model, else ByteTokenizer"),
    Flag("--tokenizer-model", DATA, help="a sentencepiece model, or a Hugging Face tokenizer directory"),
    Flag("--vocab-file", DATA, help="GPT2BPETokenizer's vocab.json"),
    Flag("--merge-file", DATA, help="GPT2BPETokenizer's merges.txt"),
    Flag("--vocab-size", DATA, type=int,
         help="the model's vocabulary without a tokenizer; NullTokenizer's ids (eod is one more)"),
    Flag("--mock-data", DATA, default=False, help="Megatron's synthetic documents instead of --data-path"),
    Flag("--data-cache-path", DATA, help="where dataset indexes are cached and the default corpus is built"),
    Flag("--reset-position-ids", DATA, ("PackedSequenceConfig.reset_position_ids",), type=bool,
         help="restart positions after each end-of-document token"),
    Flag("--reset-attention-mask", DATA, ("PackedSequenceConfig.reset_attention_mask",), type=bool,
         help="no attention across end-of-document tokens"),
    Flag("--eod-mask-loss", DATA, ("PackedSequenceConfig.eod_mask_loss",), type=bool,
         help="no loss where the input is the tokenizer's end-of-document token"),

    Flag("--save", LOG),
    Flag("--load", LOG),
    Flag("--save-interval", LOG, type=int),
    Flag("--use-checkpoint-args", LOG, default=False, help="take the model architecture from the --load checkpoint"),
    Flag("--finetune", LOG, default=False,
         help="load only the model weights: iteration 0, a fresh optimizer and schedule; needs a checkpoint"),
    Flag("--no-load-optim", LOG, default=False),
    Flag("--no-load-rng", LOG, default=False),
    Flag("--no-save-optim", LOG, default=False),
    Flag("--no-save-rng", LOG, default=False),
    Flag("--exit-interval", LOG, type=int, help="save (with --save) and exit when the iteration is a multiple"),
    Flag("--exit-duration-in-mins", LOG, type=float, help="save (with --save) and exit after this much training"),
    Flag("--log-throughput", LOG, default=False, help="log TFLOP/s per device (and MFU on a GPU)"),
    Flag("--async-save", LOG, default=False, type=bool,
         help="write checkpoints in the background while training goes on (one save in flight)"),
    Flag("--eval-interval", LOG, default=1000, type=int),
    Flag("--eval-iters", LOG, default=10, type=int),
    Flag("--log-interval", LOG, default=10, type=int),
    Flag("--tensorboard-dir", LOG),
    Flag("--metrics-file", LOG, help="append one JSON object per logged iteration"),
    Flag("--timeline-dir", LOG, help="save each rank's pipeline timeline here"),
    Flag("--profile", LOG, default=False,
         help="run the torch profiler over iterations [--profile-step-start, --profile-step-end); rank 0 prints "
              "the costliest ops and, with --tensorboard-dir, saves a Chrome trace there"),
    Flag("--profile-step-start", LOG, default=10, type=int),
    Flag("--profile-step-end", LOG, default=12, type=int),

    Flag("--check-for-nan-in-loss-and-grad", SAFE, ("NanGuardConfig.check_for_nan_in_loss_and_grad",), type=bool,
         help="stop with an error when the loss or a gradient is nan/inf"),
    Flag("--skip-nan-iterations", SAFE, ("NanGuardConfig.skip_nan_iterations",), type=int,
         help="skip the update of up to this many consecutive non-finite iterations before stopping"),
    Flag("--loss-spike-factor", SAFE, ("NanGuardConfig.loss_spike_factor",), type=float,
         help="warn when the loss exceeds this multiple of the running median; None: off"),
    Flag("--override-existing-checkpoints", SAFE, default=False,
         help="let --save write over checkpoints of a run that this run did not --load"),
    Flag("--distributed-timeout-minutes", SAFE, default=10.0, type=float,
         help="how long a collective may wait for a rank before the job fails"),
)


def flag_for_field(cls_name: str, field: str) -> str | None:
    """The flag that sets ``cls_name.field``, for messages that name what a user types."""
    target = f"{cls_name}.{field}"
    return next((f.name for f in FLAGS if target in f.fields), None)


class _RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ValueError instead of printing usage and exiting."""

    def error(self, message):
        raise ValueError(message)


def _add(group, flag: Flag) -> None:
    default = flag.resolved_default()
    help_text = f"{flag.help} (default: %(default)s)" if flag.help else "default: %(default)s"
    if flag.sets is not _UNSET or flag.type is bool or (flag.type is None and isinstance(default, bool)):
        action = "store_true" if not default else argparse.BooleanOptionalAction
        group.add_argument(flag.name, action=action, default=default, help=help_text)
        return
    group.add_argument(flag.name, type=flag.type, default=default, choices=flag.choices, nargs=flag.nargs,
                       help=help_text)


def add_flag(group, name: str, default=_UNSET, help: str | None = None) -> None:
    """Add ``FLAGS``' flag ``name`` to another script's parser (the RL examples), with that script's default
    and help when given, so the same option keeps one spelling and type."""
    flag = next((f for f in FLAGS if f.name == name), None)
    if flag is None:
        raise ValueError(f"{name} is not a pretraining flag")
    changes = {"help": help} if help else {}
    if default is not _UNSET:
        changes.update(default=default, fields=())
    _add(group, dataclasses.replace(flag, **changes))


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """The full parser; ``extra_args_provider(parser)`` may add script-specific flags."""
    parser = _RaisingParser(prog="pretrain", allow_abbrev=False,
                            description="Megatron-style GPT pretraining on megalite")
    groups = {}
    for flag in FLAGS:
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        _add(groups[flag.group], flag)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(argv=None, extra_args_provider=None, args_defaults=None) -> argparse.Namespace:
    """Parse ``argv`` (default sys.argv[1:]); ``args_defaults`` overrides the parser's defaults."""
    parser = build_parser(extra_args_provider)
    if args_defaults:
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(args_defaults) - known)
        if unknown:
            raise ValueError(f"args_defaults names unknown flags: {', '.join(unknown)}")
        parser.set_defaults(**args_defaults)
    return parser.parse_args(argv)


def _config_values(args, cls_name: str) -> dict:
    """The ``cls_name`` fields the flags set; a switch that was not given leaves its field alone."""
    values = {}
    for flag in FLAGS:
        for target in flag.fields:
            owner, field = target.split(".")
            if owner != cls_name:
                continue
            value = getattr(args, flag.dest)
            if flag.sets is _UNSET:
                values[field] = value
            elif value:
                values[field] = flag.sets
    return values


def gpt_config(args, vocab_size: int | None = None) -> GPTConfig:
    """The model architecture the flags describe (``vocab_size`` defaults to ``--vocab-size``)."""
    values = _config_values(args, "GPTConfig")
    values["vocab_size"] = vocab_size if vocab_size is not None else args.vocab_size
    if values["max_position_embeddings"] is None:
        values["max_position_embeddings"] = args.seq_length
    config = GPTConfig(**values)
    if args.num_experts is not None:
        moe = _config_values(args, "MoEConfig")
        if moe["ffn_hidden_size"] is None:
            moe["ffn_hidden_size"] = config.ffn_hidden_size
        config.moe = MoEConfig(**moe, activation=config.activation, init_method_std=config.init_method_std)
    return config


def optimizer_config(args) -> OptimizerConfig:
    return OptimizerConfig(**_config_values(args, "OptimizerConfig"))


def ddp_config(args) -> DDPConfig:
    return DDPConfig(**_config_values(args, "DDPConfig"))


def fsdp_config(args) -> FSDPConfig:
    """FSDP2 keeps fp32 sharded main weights; --bf16/--fp16 set the gather and compute dtype."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    return FSDPConfig(**_config_values(args, "FSDPConfig"), param_dtype=dtype)


def context_parallel_config(args) -> ContextParallelConfig:
    return ContextParallelConfig(**_config_values(args, "ContextParallelConfig"))


def packing_config(args) -> PackedSequenceConfig:
    """The packed-sequence flags; the trainer fills in the tokenizer's end-of-document id."""
    return PackedSequenceConfig(**_config_values(args, "PackedSequenceConfig"))


def nan_guard_config(args) -> NanGuardConfig:
    return NanGuardConfig(**_config_values(args, "NanGuardConfig"))


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
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and args.pipeline_schedule in (None, "interleaved-1f1b"):
        _require(args.num_microbatches % pp == 0,
                 f"the interleaved schedule needs the number of micro-batches {args.num_microbatches} "
                 f"(global batch {args.global_batch_size} / (micro batch {micro} * dp {dp})) to be divisible "
                 f"by pipeline size {pp}")


def _check_schedule(args):
    if args.train_samples is not None:
        _require(args.train_iters is None, f"--train-iters {args.train_iters} and --train-samples "
                                           f"{args.train_samples} are mutually exclusive")
        _require(args.train_samples >= args.global_batch_size,
                 f"--train-samples {args.train_samples} is less than one global batch of {args.global_batch_size}")
        args.train_iters = args.train_samples // args.global_batch_size
    elif args.train_iters is None:
        args.train_iters = 100
    _positive(args, "train_iters")
    for name in ("exit_interval", "exit_duration_in_mins"):
        if getattr(args, name) is not None:
            _require(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("save_interval", "eval_interval", "eval_iters"):
        if getattr(args, name) is not None:
            _require(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")
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
    _check_parallel(args, world_size)
    _check_fsdp(args)
    _check_batch(args)
    _check_pipeline_schedule(args)
    _check_schedule(args)
    _check_lr_schedule(args)
    _check_pipeline_split(args)
    nan_guard_config(args).validate()
    _require(args.distributed_timeout_minutes > 0,
             f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    if not math.isfinite(args.lr) or args.lr < 0:
        raise ValueError(f"--lr must be a non-negative number, got {args.lr}")
    return args


def lr_schedule_settings(args) -> ScheduleSettings:
    """The LR and weight-decay schedule of the flags, in samples as Megatron-LM builds it (after ``validate_args``)."""
    return schedule_settings(LRScheduleConfig(**_config_values(args, "LRScheduleConfig")), lr=args.lr,
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
    check_schedule(schedule, pp, args.virtual_pipeline_model_parallel_size or 1, args.num_microbatches)


def _check_pipeline_split(args):
    """Let the pipeline package reject layer counts that do not split over the stages."""
    split_layers(args.num_layers, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
                 args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                 v_shape=args.pipeline_schedule == "zbv")


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
