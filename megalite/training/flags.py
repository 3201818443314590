"""Pretraining's command-line flags: Megatron's names, one row each, mapped onto the config dataclasses.

``FLAGS`` is the only place a pretraining flag is defined (with ``megalite.flags.SHARED_FLAGS``, the
parallel sizes and ``--save``/``--load`` that lower commands share, and
``megalite.training.megatron_compat.COMPAT_FLAGS``, Megatron-LM flags accepted without effect).  A
row whose ``fields`` name config fields (``"GPTConfig.hidden_size"``) takes its default from that
dataclass and its value goes into that field, so the CLI and the Python API share defaults and
validation; the other rows are trainer options (layout, batch, data, logging) with their default in
the row.  Adding a flag is one ``Flag(...)`` line.  ``parse_args`` turns argv into a Namespace (an
unknown flag is a ValueError; a Megatron-LM flag megalite rejects says why) and the ``*_config``
functions build the configs from it; ``megalite.training.arguments`` validates it.
"""

from __future__ import annotations

import argparse

import torch

from megalite.context_parallel import COMM_TYPES, ContextParallelConfig, PackedSequenceConfig
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.distributed import DDPConfig, FSDPConfig
from megalite.flags import SHARED_FLAGS, ArgumentParser, Flag, FlagTable
from megalite.lora import LoRAConfig
from megalite.models import GPTConfig
from megalite.moe.config import LOAD_BALANCING_TYPES, MoEConfig
from megalite.optim import OptimizerConfig
from megalite.pipeline import SCHEDULES
from megalite.training.flag_values import moe_layer_freq, rope_type, window_size
from megalite.training.lr_schedule import DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES, LRScheduleConfig
from megalite.training.megatron_compat import COMPAT_FLAGS, unrecognized_message
from megalite.training.nan_guard import NanGuardConfig

PAR, MODEL, MOE, OPT, DATA, LOG = ("parallelism", "model", "mixture of experts", "batch and optimizer", "data",
                                   "checkpoints, evaluation and logging")
SAFE = "faults and safety"
LORA = "LoRA adapters"


_TRAINING_ROWS = (
    Flag("--virtual-pipeline-model-parallel-size", PAR, type=int),
    Flag("--pipeline-schedule", PAR, choices=SCHEDULES,
         help="None: 1f1b, or interleaved-1f1b with a virtual size; zbv implies a virtual size of 2"),
    Flag("--decoder-first-pipeline-num-layers", PAR, type=int),
    Flag("--decoder-last-pipeline-num-layers", PAR, type=int),
    Flag("--account-for-embedding-in-pipeline-split", PAR, default=False,
         help="count the embedding as a layer in the pipeline split (the first stage builds one layer fewer)"),
    Flag("--account-for-loss-in-pipeline-split", PAR, default=False,
         help="count the loss as a layer in the pipeline split (the last stage builds one layer fewer)"),
    Flag("--pipeline-model-parallel-layout", PAR,
         help="Megatron-LM's stage string, e.g. 'Ettt|(tt|)*2,tL' (E embedding, t layer, m MTP layer, L loss): "
              "each stage's layers; its stage count sets the virtual size"),
    Flag("--cp-comm-type", PAR, ("ContextParallelConfig.comm_type",), choices=COMM_TYPES,
         help="context-parallel attention: ring (p2p), all-gathered keys/values, or Ulysses all-to-all (a2a)"),
    Flag("--sequence-parallel", PAR, default=False),
    Flag("--use-distributed-optimizer", PAR, ("DDPConfig.use_distributed_optimizer",), type=bool,
         help="ZeRO-1: shard the fp32 main parameters and Adam state over DP"),
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
    Flag("--kv-channels", MODEL, ("GPTConfig.kv_channels",), type=int,
         help="the head dimension, free to differ from hidden / heads; None: hidden / heads"),
    Flag("--rotary-percent", MODEL, ("GPTConfig.rotary_percent",), type=float),
    Flag("--rotary-interleaved", MODEL, ("GPTConfig.rotary_interleaved",), type=bool,
         help="rotate neighbouring channel pairs (GPT-J) instead of the two halves of each head"),
    Flag("--rope-scaling-type", MODEL, ("GPTConfig.rope_scaling",), choices=("linear", "llama3", "yarn"),
         help="stretch the RoPE frequencies for long context; None: no scaling"),
    Flag("--use-rope-scaling", MODEL, ("GPTConfig.rope_scaling",), sets="llama3",
         help="Llama 3.1 RoPE scaling: same as --rope-scaling-type llama3"),
    Flag("--rope-scaling-factor", MODEL, ("GPTConfig.rope_scaling_factor",), type=float),
    Flag("--rope-low-freq-factor", MODEL, ("GPTConfig.rope_low_freq_factor",), type=float, help="llama3 scaling"),
    Flag("--rope-high-freq-factor", MODEL, ("GPTConfig.rope_high_freq_factor",), type=float, help="llama3 scaling"),
    Flag("--original-max-position-embeddings", MODEL, ("GPTConfig.rope_original_max_position_embeddings",),
         type=int, help="the context the model was first trained on (llama3 and yarn scaling)"),
    Flag("--beta-fast", MODEL, ("GPTConfig.yarn_beta_fast",), type=float, help="yarn scaling"),
    Flag("--beta-slow", MODEL, ("GPTConfig.yarn_beta_slow",), type=float, help="yarn scaling"),
    Flag("--yarn-attention-factor", MODEL, ("GPTConfig.yarn_attention_factor",), type=float,
         help="yarn: cos/sin scale; None: 0.1*ln(factor)+1"),
    Flag("--yarn-truncate", MODEL, ("GPTConfig.yarn_truncate",), type=bool,
         help="yarn: round the ramp's ends to whole dimensions"),
    Flag("--mscale", MODEL, ("GPTConfig.yarn_mscale",), type=float,
         help="yarn (DeepSeek, Megatron): cos/sin scale numerator's ln(factor) weight"),
    Flag("--mscale-all-dim", MODEL, ("GPTConfig.yarn_mscale_all_dim",), type=float,
         help="yarn: cos/sin scale denominator's ln(factor) weight; MLA's softmax scale"),
    Flag("--rope-type", MODEL, ("GPTConfig.rope_scaling",), type=rope_type,
         help="Megatron's spelling: 'yarn' is --rope-scaling-type yarn, 'rope' no scaling"),
    Flag("--rotary-scaling-factor", MODEL, ("GPTConfig.rope_scaling_factor",), type=float,
         help="Megatron's spelling of --rope-scaling-factor"),
    Flag("--add-qkv-bias", MODEL, ("GPTConfig.add_qkv_bias",), type=bool,
         help="a bias on the QKV projection even with --disable-bias-linear (Qwen2)"),
    Flag("--qk-layernorm", MODEL, ("GPTConfig.qk_layernorm",), type=bool,
         help="normalize each query and key head before RoPE (Qwen3)"),
    Flag("--swiglu", MODEL, ("GPTConfig.activation",), sets="swiglu"),
    Flag("--openai-gelu", MODEL, ("GPTConfig.activation",), sets="gelu_tanh", help="tanh-approximated GELU (GPT-2)"),
    Flag("--untie-embeddings-and-output-weights", MODEL, ("GPTConfig.untie_embeddings_and_output_weights",),
         type=bool),
    Flag("--disable-bias-linear", MODEL, ("GPTConfig.add_bias_linear",), sets=False),
    Flag("--hidden-dropout", MODEL, ("GPTConfig.hidden_dropout",), type=float),
    Flag("--attention-dropout", MODEL, ("GPTConfig.attention_dropout",), type=float),
    Flag("--window-size", MODEL, ("GPTConfig.window_size",), type=window_size,
         help="sliding-window attention '(left, 0)': each token sees itself and the left tokens before it; "
              "None: full causal"),
    Flag("--multi-latent-attention", MODEL, ("GPTConfig.multi_latent_attention",), type=bool,
         help="DeepSeek's multi-latent attention (MLA)"),
    Flag("--q-lora-rank", MODEL, ("GPTConfig.q_lora_rank",), type=int, help="MLA query latent; None: no latent"),
    Flag("--kv-lora-rank", MODEL, ("GPTConfig.kv_lora_rank",), type=int),
    Flag("--qk-head-dim", MODEL, ("GPTConfig.qk_head_dim",), type=int, help="MLA non-rotary query/key channels"),
    Flag("--qk-pos-emb-head-dim", MODEL, ("GPTConfig.qk_pos_emb_head_dim",), type=int,
         help="MLA rotary query/key channels"),
    Flag("--v-head-dim", MODEL, ("GPTConfig.v_head_dim",), type=int),
    Flag("--mtp-num-layers", MODEL, ("GPTConfig.mtp_num_layers",), type=int,
         help="multi-token prediction depths (DeepSeek-V3); None: none"),
    Flag("--mtp-loss-scaling-factor", MODEL, ("GPTConfig.mtp_loss_scaling_factor",), type=float,
         help="weight of the mean MTP loss in the training loss"),
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
    Flag("--moe-layer-freq", MOE, ("GPTConfig.moe_layer_freq",), type=moe_layer_freq,
         help="k (layers 0, k, 2k, ... are MoE) or a per-layer 0/1 list such as '[0,1,0,1]' or '([0]+[1]*3)*2'"),
    Flag("--moe-router-pre-softmax", MOE, ("MoEConfig.pre_softmax",), type=bool,
         help="softmax over all experts, then keep the top-k probabilities as they are"),
    Flag("--moe-shared-expert-intermediate-size", MOE, ("MoEConfig.shared_expert_intermediate_size",), type=int,
         help="None: no shared expert"),
    Flag("--moe-shared-expert-gate", MOE, ("MoEConfig.shared_expert_gate",), type=bool,
         help="scale the shared expert's output by sigmoid(x . w) (Qwen2-MoE)"),
    Flag("--moe-shared-expert-overlap", MOE, ("MoEConfig.shared_expert_overlap",), type=bool,
         help="run the shared expert while the alltoall dispatcher's token exchange is in flight"),
    Flag("--moe-router-score-function", MOE, ("MoEConfig.score_function",), choices=("softmax", "sigmoid")),
    Flag("--moe-router-enable-expert-bias", MOE, ("MoEConfig.enable_expert_bias",), type=bool,
         help="aux-loss-free balancing: a per-expert selection bias moved toward equal load after each step"),
    Flag("--moe-router-bias-update-rate", MOE, ("MoEConfig.bias_update_rate",), type=float),
    Flag("--moe-router-topk-scaling-factor", MOE, ("MoEConfig.routed_scaling_factor",), type=float),
    Flag("--moe-router-num-groups", MOE, ("MoEConfig.num_groups",), type=int, help="group-limited routing"),
    Flag("--moe-router-group-topk", MOE, ("MoEConfig.group_topk",), type=int),
    Flag("--moe-aux-loss-coeff", MOE, ("MoEConfig.aux_loss_coeff",), type=float),
    Flag("--moe-router-load-balancing-type", MOE, ("MoEConfig.load_balancing_type",),
         choices=LOAD_BALANCING_TYPES, help="seq_aux_loss: DeepSeek-V3's per-sequence balance loss"),
    Flag("--moe-z-loss-coeff", MOE, ("MoEConfig.z_loss_coeff",), type=float),
    Flag("--moe-expert-capacity-factor", MOE, ("MoEConfig.capacity_factor",), type=float),
    Flag("--moe-token-drop-policy", MOE, ("MoEConfig.token_drop_policy",), choices=("probs", "position")),
    Flag("--moe-token-dispatcher-type", MOE, ("MoEConfig.dispatcher",), choices=("alltoall", "allgather")),
    Flag("--moe-grouped-gemm", MOE, ("MoEConfig.grouped_gemm",), type=bool),

    Flag("--micro-batch-size", OPT, default=1, type=int),
    Flag("--global-batch-size", OPT, type=int, help="None: micro-batch size * dp"),
    Flag("--rampup-batch-size", OPT, type=int, nargs=3,
         help="START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over SAMPLES samples "
              "(Megatron-LM's ramp-up; needs --train-samples)"),
    Flag("--train-iters", OPT, type=int, help="None: --train-samples / global batch, else 100"),
    Flag("--train-samples", OPT, type=int, help="train for this many samples (exclusive with --train-iters)"),
    Flag("--lr", OPT, ("OptimizerConfig.lr",), type=float),
    Flag("--min-lr", OPT, default=0.0, type=float, help="the learning rate the schedule decays to"),
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
    Flag("--seed", OPT, ("GPTConfig.seed", "LoRAConfig.seed"), type=int),

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
    Flag("--data-cache-path", DATA,
         help="where dataset indexes and SFT jsonl renderings are cached and the default corpus is built"),
    Flag("--reset-position-ids", DATA, ("PackedSequenceConfig.reset_position_ids",), type=bool,
         help="restart positions after each end-of-document token"),
    Flag("--reset-attention-mask", DATA, ("PackedSequenceConfig.reset_attention_mask",), type=bool,
         help="no attention across end-of-document tokens"),
    Flag("--eod-mask-loss", DATA, ("PackedSequenceConfig.eod_mask_loss",), type=bool,
         help="no loss where the input is the tokenizer's end-of-document token"),

    Flag("--save-interval", LOG, type=int),
    Flag("--use-checkpoint-args", LOG, default=False, help="take the model architecture from the --load checkpoint"),
    Flag("--finetune", LOG, default=False,
         help="load only the model weights: iteration 0, a fresh optimizer and schedule; needs a checkpoint"),
    Flag("--lora-rank", LORA, ("LoRAConfig.rank",), default=None, type=int,
         help="None: train every weight; a rank: with --finetune, train low-rank adapters on the frozen base "
              "and save adapter-only checkpoints"),
    Flag("--lora-alpha", LORA, ("LoRAConfig.alpha",), type=float, help="adapters scale by alpha / rank"),
    Flag("--lora-dropout", LORA, ("LoRAConfig.dropout",), type=float),
    Flag("--lora-target-modules", LORA, ("LoRAConfig.target_modules",), type=str,
         help="comma-separated layers that get adapters"),
    Flag("--no-load-optim", LOG, default=False),
    Flag("--no-load-rng", LOG, default=False),
    Flag("--no-save-optim", LOG, default=False),
    Flag("--no-save-rng", LOG, default=False),
    Flag("--exit-on-missing-checkpoint", LOG, default=False,
         help="stop with an error when --load holds no checkpoint, instead of starting from scratch"),
    Flag("--exit-interval", LOG, type=int, help="save (with --save) and exit when the iteration is a multiple"),
    Flag("--exit-duration-in-mins", LOG, type=float, help="save (with --save) and exit after this much training"),
    Flag("--log-throughput", LOG, default=False, help="log TFLOP/s per device (and MFU on a GPU)"),
    Flag("--async-save", LOG, default=False, type=bool,
         help="write checkpoints in the background while training goes on (one save in flight)"),
    Flag("--eval-interval", LOG, default=1000, type=int),
    Flag("--eval-iters", LOG, default=10, type=int),
    Flag("--log-interval", LOG, default=10, type=int),
    Flag("--tensorboard-dir", LOG),
    Flag("--wandb-project", LOG, help="log the TensorBoard scalars to this Weights & Biases project too "
                                      "(pip install wandb)"),
    Flag("--wandb-exp-name", LOG, help="the W&B run name; needed with --wandb-project"),
    Flag("--wandb-save-dir", LOG, help="W&B's local directory; None: --save/wandb"),
    Flag("--log-memory", LOG, default=False,
         help="print rank 0's peak memory on each logged line too (TensorBoard always gets it)"),
    Flag("--log-params-norm", LOG, default=False, help="log the global L2 norm of the parameters"),
    Flag("--log-num-zeros-in-grad", LOG, ("OptimizerConfig.log_num_zeros_in_grad",), type=bool,
         help="log how many gradient entries are exactly zero"),
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

FLAGS = SHARED_FLAGS + FlagTable(_TRAINING_ROWS, (GPTConfig, MoEConfig, OptimizerConfig, DDPConfig, FSDPConfig,
                                                  ContextParallelConfig, PackedSequenceConfig, NanGuardConfig,
                                                  LRScheduleConfig, LoRAConfig)) + COMPAT_FLAGS


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """The full parser; ``extra_args_provider(parser)`` may add script-specific flags."""
    parser = ArgumentParser(prog="pretrain", description="Megatron-style GPT pretraining on megalite")
    FLAGS.add_to(parser)
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
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise ValueError(unrecognized_message(extras))
    return args


def gpt_config(args, vocab_size: int | None = None) -> GPTConfig:
    """The model architecture the flags describe (``vocab_size`` defaults to ``--vocab-size``)."""
    values = FLAGS.config_values(args, "GPTConfig")
    values["vocab_size"] = vocab_size if vocab_size is not None else args.vocab_size
    if values["max_position_embeddings"] is None:
        values["max_position_embeddings"] = args.seq_length
    config = GPTConfig(**values)
    if args.num_experts is not None:
        moe = FLAGS.config_values(args, "MoEConfig")
        if moe["ffn_hidden_size"] is None:
            moe["ffn_hidden_size"] = config.ffn_hidden_size
        config.moe = MoEConfig(**moe, activation=config.activation, init_method_std=config.init_method_std)
    return config


def optimizer_config(args) -> OptimizerConfig:
    return OptimizerConfig(**FLAGS.config_values(args, "OptimizerConfig"))


def ddp_config(args) -> DDPConfig:
    return DDPConfig(**FLAGS.config_values(args, "DDPConfig"))


def fsdp_config(args) -> FSDPConfig:
    """FSDP2 keeps fp32 sharded main weights; --bf16/--fp16 set the gather and compute dtype."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    return FSDPConfig(**FLAGS.config_values(args, "FSDPConfig"), param_dtype=dtype)


def context_parallel_config(args) -> ContextParallelConfig:
    return ContextParallelConfig(**FLAGS.config_values(args, "ContextParallelConfig"))


def packing_config(args) -> PackedSequenceConfig:
    """The packed-sequence flags; the trainer fills in the tokenizer's end-of-document id."""
    return PackedSequenceConfig(**FLAGS.config_values(args, "PackedSequenceConfig"))


def nan_guard_config(args) -> NanGuardConfig:
    return NanGuardConfig(**FLAGS.config_values(args, "NanGuardConfig"))


def lora_config(args) -> LoRAConfig | None:
    """The adapters of ``--lora-rank``; None without it (every weight trains)."""
    if args.lora_rank is None:
        return None
    return LoRAConfig(**FLAGS.config_values(args, "LoRAConfig"))


def lr_schedule_config(args) -> LRScheduleConfig:
    return LRScheduleConfig(**FLAGS.config_values(args, "LRScheduleConfig"))
