"""Megatron-compatible command-line flags and their validation.

``parse_args`` turns argv into a Namespace and ``validate_args`` checks it
against the world size alone, filling in derived values (data-parallel size,
global batch, number of micro-batches).  Both run before any process group
exists, so a bad flag raises one ValueError on every rank and nothing hangs.
"""

from __future__ import annotations

import argparse
import math

from megalite.data.gpt_dataset import parse_split
from megalite.pipeline import split_layers


class _RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ValueError instead of printing usage and exiting."""

    def error(self, message):
        raise ValueError(message)


def _parallel_flags(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="reserved: only 1 is supported")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")


def _fsdp_flags(parser):
    g = parser.add_argument_group("fully sharded data parallelism (torch FSDP2)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard parameters, gradients and optimizer state over DP with torch's fully_shard")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP2: free gathered parameters after forward and gather again in backward")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="FSDP2: reduce-scatter gradients in fp32 under --bf16/--fp16 (DDP always does)")


def _check_fsdp(args):
    if not args.use_torch_fsdp2:
        return
    _require(not args.use_distributed_optimizer,
             "--use-torch-fsdp2 and --use-distributed-optimizer are alternatives (FSDP2 already shards the "
             "optimizer state); pass one")
    _require(args.data_parallel_size > 1,
             f"--use-torch-fsdp2 needs a data-parallel size > 1, got dp={args.data_parallel_size} (world size "
             f"{args.world_size} / (tp {args.tensor_model_parallel_size} * pp {args.pipeline_model_parallel_size}))")


def _model_flags(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden, or 2/3 of that rounded down to 64 with --swiglu")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)


def _moe_flags(parser):
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-layer-freq", type=int, default=1)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs")
    g.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="allgather")
    g.add_argument("--moe-grouped-gemm", action="store_true")


def _optim_flags(parser):
    g = parser.add_argument_group("batch and optimizer")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch size * dp")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm up over this fraction of --lr-decay-iters; ignored when --lr-warmup-iters > 0")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale; default: dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--seed", type=int, default=1234)


def _data_flags(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="prefixes, or weight prefix pairs: '0.3 a 0.7 b'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="needed when there is no --tokenizer-model")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset indexes are cached and the default corpus is built")


def _logging_flags(parser):
    g = parser.add_argument_group("checkpoints, evaluation and logging")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None, help="append one JSON object per logged iteration")
    g.add_argument("--timeline-dir", default=None, help="save each rank's pipeline timeline here")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """The full parser; ``extra_args_provider(parser)`` may add script-specific flags."""
    parser = _RaisingParser(prog="pretrain", allow_abbrev=False,
                            description="Megatron-style GPT pretraining on megalite")
    for add in (_parallel_flags, _fsdp_flags, _model_flags, _moe_flags, _optim_flags, _data_flags, _logging_flags):
        add(parser)
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


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        _require(value is not None and value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _check_model(args):
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    _require(args.hidden_size % heads == 0,
             f"hidden size {args.hidden_size} is not divisible by the number of attention heads {heads}")
    _require(heads % tp == 0,
             f"number of attention heads {heads} is not divisible by tensor-parallel size {tp}")
    if args.num_query_groups is None:
        _require(not args.group_query_attention, "--group-query-attention needs --num-query-groups")
        args.num_query_groups = heads
    groups = args.num_query_groups
    _require(heads % groups == 0,
             f"number of attention heads {heads} is not divisible by number of query groups {groups}")
    _require(groups % tp == 0, f"number of query groups {groups} is not divisible by tensor-parallel size {tp}")
    _require(args.ffn_hidden_size is None or args.ffn_hidden_size % tp == 0,
             f"ffn hidden size {args.ffn_hidden_size} is not divisible by tensor-parallel size {tp}")
    if args.position_embedding_type == "rope":
        _require(args.hidden_size // heads % 2 == 0,
                 f"rope needs an even head dimension, got hidden size {args.hidden_size} / {heads} heads")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(args.seq_length <= args.max_position_embeddings,
                 f"sequence length {args.seq_length} is greater than max position embeddings "
                 f"{args.max_position_embeddings}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:
            args.ffn_hidden_size = max(64, int(args.ffn_hidden_size * 2 / 3) // 64 * 64)
        _require(args.ffn_hidden_size % tp == 0,
                 f"ffn hidden size {args.ffn_hidden_size} is not divisible by tensor-parallel size {tp}")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, name)
        _require(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
    if args.num_experts is not None:
        _positive(args, "num_experts")
        ep = args.expert_model_parallel_size
        _require(args.num_experts % ep == 0,
                 f"number of experts {args.num_experts} is not divisible by expert-parallel size {ep}")
        _require(1 <= args.moe_router_topk <= args.num_experts,
                 f"--moe-router-topk {args.moe_router_topk} must be between 1 and the number of experts "
                 f"{args.num_experts}")
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
    elif args.expert_model_parallel_size != 1:
        raise ValueError(f"expert-parallel size {args.expert_model_parallel_size} needs --num-experts")


def _check_parallel(args, world_size):
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    _require(cp == 1, f"context parallelism is reserved: --context-parallel-size must be 1, got {cp}")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
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
    if vpp is not None and vpp > 1:
        _require(args.num_microbatches % pp == 0,
                 f"the interleaved schedule needs the number of micro-batches {args.num_microbatches} "
                 f"(global batch {args.global_batch_size} / (micro batch {micro} * dp {dp})) to be divisible "
                 f"by pipeline size {pp}")


def _check_schedule(args):
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    _require(args.loss_scale is None or args.loss_scale > 0,
             f"--loss-scale must be positive (omit it for a dynamic scale), got {args.loss_scale}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters == 0:
        _require(0.0 <= args.lr_warmup_fraction <= 1.0,
                 f"--lr-warmup-fraction must be between 0 and 1, got {args.lr_warmup_fraction}")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    _require(0 <= args.lr_warmup_iters <= args.lr_decay_iters,
             f"--lr-warmup-iters {args.lr_warmup_iters} must be between 0 and --lr-decay-iters "
             f"{args.lr_decay_iters}")
    _require(0.0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    for name in ("save_interval", "eval_interval", "eval_iters"):
        if getattr(args, name) is not None:
            _require(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")
    parse_split(args.split)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check ``args`` for a world of ``world_size`` ranks and fill in derived values.

    Raises ValueError naming the offending numbers.  Adds ``world_size``,
    ``data_parallel_size`` and ``num_microbatches``.
    """
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "micro_batch_size", "train_iters", "log_interval")
    _check_model(args)
    _check_parallel(args, world_size)
    _check_fsdp(args)
    _check_batch(args)
    _check_schedule(args)
    _check_pipeline_split(args)
    if not math.isfinite(args.lr) or args.lr < 0:
        raise ValueError(f"--lr must be a non-negative number, got {args.lr}")
    return args


def _check_pipeline_split(args):
    """Let the pipeline package reject layer counts that do not split over the stages."""
    split_layers(args.num_layers, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
                 args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)


def format_args(args: argparse.Namespace) -> str:
    """A readable, sorted listing of every flag's value, for printing once."""
    items = sorted(vars(args).items())
    width = max(len(k) for k, _ in items)
    lines = ["------------------------ arguments ------------------------"]
    lines += [f"  {k} {'.' * (width + 2 - len(k))} {v}" for k, v in items]
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
