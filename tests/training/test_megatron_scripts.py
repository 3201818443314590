"""Every flag of Megatron-LM's GPT-3 175B and Llama launch scripts is implemented, accepted without effect
(with its reason on one info line), or rejected with a line that says why.

The flag names and values below are copied from NVIDIA/Megatron-LM (paths, URLs and shell variables
replaced by placeholders):
- GPT3_175B: examples/gpt3/train_gpt3_175b_distributed.sh at commit 157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9
- GPT3_175B_NOW: the same script at commit 779c5b748dbcf00ad9e36d539c576b404ab4abe9, whose
  --step-batch-size-schedule replaced --rampup-batch-size
- LLAMA3_8B_FP8: examples/llama/train_llama3_8b_h100_fp8.sh at commit 157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9, plus
  the --normalization RMSNorm of commit 779c5b748dbcf00ad9e36d539c576b404ab4abe9
- LLAMA3: examples/llama/train_llama3.sh at commit 089546167906108147d1b73cdf66e51e5e7ea64d (every optional
  block switched on: recompute, no rope fusion, profiling, flash attention, sequence parallel, mcore, TE FP8,
  W&B, checkpoint load and save)
"""

import argparse
import os
import subprocess
import sys

import pytest

from megalite.training.flags import COMPAT_FLAGS, FLAGS, parse_args
from megalite.training.megatron_compat import NOT_IMPLEMENTED, accepted_without_effect

GPT3_175B = [
    ("--num-layers", "96"), ("--hidden-size", "12288"), ("--num-attention-heads", "96"), ("--seq-length", "2048"),
    ("--max-position-embeddings", "2048"), ("--attention-backend", "auto"),
    ("--micro-batch-size", "1"), ("--global-batch-size", "1536"), ("--rampup-batch-size", "16", "16", "5859375"),
    ("--train-iters", "500000"), ("--weight-decay", "0.1"), ("--adam-beta1", "0.9"), ("--adam-beta2", "0.95"),
    ("--init-method-std", "0.006"), ("--clip-grad", "1.0"), ("--fp16",), ("--lr", "6.0e-5"),
    ("--lr-decay-style", "cosine"), ("--min-lr", "6.0e-6"), ("--lr-warmup-fraction", ".001"),
    ("--lr-decay-iters", "430000"),
    ("--tensor-model-parallel-size", "8"), ("--pipeline-model-parallel-size", "16"),
    ("--data-path", "DATA"), ("--vocab-file", "VOCAB"), ("--merge-file", "MERGES"), ("--split", "949,50,1"),
    ("--log-interval", "100"), ("--save-interval", "10000"), ("--eval-interval", "1000"), ("--save", "CKPT"),
    ("--load", "CKPT"), ("--eval-iters", "10"), ("--tensorboard-dir", "TB"),
]

GPT3_175B_NOW = [row if row[0] != "--rampup-batch-size" else
                 ("--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536")
                 for row in GPT3_175B]

LLAMA3_8B_FP8 = [
    ("--use-mcore-models",), ("--normalization", "RMSNorm"), ("--num-layers", "32"), ("--hidden-size", "4096"), ("--ffn-hidden-size", "14336"),
    ("--num-attention-heads", "32"), ("--group-query-attention",), ("--num-query-groups", "8"),
    ("--kv-channels", "128"), ("--seq-length", "8192"), ("--max-position-embeddings", "8192"),
    ("--position-embedding-type", "rope"), ("--rotary-base", "1000000"), ("--rotary-percent", "1.0"),
    ("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0"), ("--swiglu",), ("--init-method-std", "0.0134"),
    ("--attention-backend", "fused"), ("--apply-layernorm-1p",), ("--untie-embeddings-and-output-weights",),
    ("--disable-bias-linear",),
    ("--micro-batch-size", "1"), ("--global-batch-size", "128"), ("--train-samples", "1953125000"),
    ("--lr-decay-samples", "1949218748"), ("--lr-warmup-samples", "3906252"), ("--lr", "0.00015"),
    ("--min-lr", "0.00001"), ("--decoupled-lr", "5.0e-4"), ("--decoupled-min-lr", "4.5e-5"),
    ("--lr-decay-style", "cosine"), ("--clip-grad", "1.0"), ("--weight-decay", "0.1"), ("--adam-beta1", "0.9"),
    ("--adam-beta2", "0.95"), ("--bf16",), ("--grad-reduce-in-bf16",), ("--cross-entropy-loss-fusion",),
    ("--calculate-per-token-loss",), ("--manual-gc",), ("--empty-unused-memory-level", "1"),
    ("--exit-duration-in-mins", "235"),
    ("--fp8-format", "hybrid"), ("--fp8-amax-history-len", "1024"), ("--fp8-amax-compute-algo", "max"),
    ("--fp8-param-gather",),
    ("--tensor-model-parallel-size", "1"), ("--context-parallel-size", "1"), ("--sequence-parallel",),
    ("--use-distributed-optimizer",), ("--overlap-grad-reduce",), ("--overlap-param-gather",),
    ("--mock-data",), ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", "128256"),
    ("--data-cache-path", "CACHE"), ("--tiktoken-pattern", "v2"), ("--split", "99,1,0"),
    ("--no-create-attention-mask-in-dataloader",), ("--no-mmap-bin-files",), ("--num-workers", "1"),
    ("--log-interval", "1"), ("--eval-iters", "32"), ("--eval-interval", "100"), ("--save-interval", "1000"),
    ("--log-throughput",), ("--profile",), ("--profile-step-start", "4"), ("--profile-step-end", "6"),
    ("--ckpt-format", "torch_dist"), ("--distributed-timeout-minutes", "60"), ("--save", "CKPT"),
    ("--load", "CKPT"), ("--tensorboard-dir", "TB"),
]

LLAMA3 = [
    ("--tensor-model-parallel-size", "8"), ("--pipeline-model-parallel-size", "1"), ("--context-parallel-size", "1"),
    ("--num-layers", "80"), ("--hidden-size", "8192"), ("--ffn-hidden-size", "28672"),
    ("--num-attention-heads", "64"), ("--seq-length", "2048"), ("--max-position-embeddings", "131072"),
    ("--untie-embeddings-and-output-weights",), ("--position-embedding-type", "rope"),
    ("--no-position-embedding",), ("--swiglu",), ("--disable-bias-linear",), ("--init-method-std", "0.02"),
    ("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0"), ("--normalization", "RMSNorm"),
    ("--micro-batch-size", "1"), ("--global-batch-size", "8"), ("--train-iters", "12"),
    ("--no-async-tensor-model-parallel-allreduce",), ("--bf16",), ("--no-masked-softmax-fusion",),
    ("--recompute-num-layers", "80"), ("--recompute-granularity", "full"), ("--recompute-method", "block"),
    ("--no-rope-fusion",),
    ("--lr", "1e-4"), ("--min-lr", "1e-5"), ("--lr-decay-iters", "320000"), ("--lr-decay-style", "cosine"),
    ("--weight-decay", "1.0e-1"), ("--clip-grad", "1.0"), ("--optimizer", "adam"), ("--adam-beta1", "0.9"),
    ("--adam-beta2", "0.95"),
    ("--tokenizer-type", "HuggingFaceTokenizer"), ("--tokenizer-model", "TOKENIZER"),
    ("--dataloader-type", "cyclic"), ("--save-interval", "200000"), ("--tensorboard-dir", "LOGS"),
    ("--log-interval", "1"), ("--eval-interval", "320000"), ("--eval-iters", "10"), ("--num-workers", "8"),
    ("--mock-data",), ("--log-throughput",), ("--no-save-optim",), ("--no-save-rng",),
    ("--ckpt-format", "torch"), ("--save", "CKPT"),
    ("--exit-on-missing-checkpoint",), ("--no-load-optim",), ("--no-load-rng",), ("--use-checkpoint-args",),
    ("--load", "CKPT"),
    ("--group-query-attention",), ("--num-query-groups", "8"), ("--no-gradient-accumulation-fusion",),
    ("--distributed-backend", "nccl"), ("--distributed-timeout-minutes", "120"), ("--overlap-grad-reduce",),
    ("--rerun-mode", "disabled"), ("--use-distributed-optimizer",), ("--overlap-param-gather",), ("--profile",),
    ("--use-pytorch-profiler",), ("--use-flash-attn",), ("--sequence-parallel",), ("--use-mcore-models",),
    ("--transformer-impl", "transformer_engine"), ("--fp8-margin", "0"), ("--fp8-format", "hybrid"),
    ("--fp8-interval", "1"), ("--fp8-amax-history-len", "1024"), ("--fp8-amax-compute-algo", "max"),
    ("--attention-softmax-in-fp32",),
    ("--wandb-project", "LLama"), ("--wandb-exp-name", "LLama_70B"), ("--wandb-save-dir", "logs/wandb"),
]

# The decision per flag that is not implemented as in Megatron-LM (all others are FLAGS rows that act).
ACCEPTED = {"--use-mcore-models", "--attention-backend", "--cross-entropy-loss-fusion", "--manual-gc",
            "--empty-unused-memory-level", "--tiktoken-pattern", "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files", "--num-workers", "--ckpt-format", "--no-async-tensor-model-parallel-allreduce",
            "--no-masked-softmax-fusion", "--no-rope-fusion", "--optimizer", "--no-gradient-accumulation-fusion",
            "--distributed-backend", "--rerun-mode", "--use-pytorch-profiler", "--use-flash-attn",
            "--transformer-impl"}
REJECTED = {"--step-batch-size-schedule", "--apply-layernorm-1p", "--decoupled-lr", "--decoupled-min-lr",
            "--grad-reduce-in-bf16", "--calculate-per-token-loss", "--fp8-format", "--fp8-amax-history-len",
            "--fp8-amax-compute-algo", "--fp8-param-gather", "--dataloader-type", "--fp8-margin", "--fp8-interval",
            "--attention-softmax-in-fp32", "--no-position-embedding"}


def _argv(rows):
    return [word for row in rows for word in row]


SCRIPTS = {"gpt3_175b": GPT3_175B, "gpt3_175b_now": GPT3_175B_NOW, "llama3_8b_fp8": LLAMA3_8B_FP8, "llama3": LLAMA3}


@pytest.mark.parametrize("script", list(SCRIPTS.values()), ids=list(SCRIPTS))
def test_each_flag_is_implemented_accepted_or_rejected_with_a_reason(script):
    names = {row[0] for row in script}
    implemented = {f.name for f in FLAGS} - {f.name for f in COMPAT_FLAGS}
    assert names <= implemented | ACCEPTED | REJECTED, names - implemented - ACCEPTED - REJECTED
    assert not (ACCEPTED | REJECTED) & implemented

    kept = [row for row in script if row[0] not in REJECTED]
    args = parse_args(_argv(kept))
    for row in kept:
        value = getattr(args, row[0][2:].replace("-", "_"))
        assert value is True if len(row) == 1 else value is not None, row
    notes = accepted_without_effect(args)
    given = sorted(names & ACCEPTED)
    if given:
        assert notes.startswith("info: accepted with no effect here: ") and "\n" not in notes
        assert [part.split(" (")[0] for part in notes.removeprefix("info: accepted with no effect here: ").split("; ")] == \
            [f.name for f in COMPAT_FLAGS if f.name in given]
    else:
        assert notes is None

    for row in script:
        if row[0] in REJECTED:
            with pytest.raises(ValueError) as info:
                parse_args(_argv(kept) + list(row))
            reason = NOT_IMPLEMENTED.get(row[0], "")
            assert str(info.value) == (f"{row[0]} is not implemented in megalite: {reason}" if reason
                                       else f"unrecognized arguments: {' '.join(row)}"), str(info.value)


def test_unknown_flags_are_still_named():
    with pytest.raises(ValueError) as info:
        parse_args(["--fp8-format", "hybrid", "--no-such-flag", "3"])
    assert str(info.value) == ("--fp8-format is not implemented in megalite: megalite has no FP8 training; "
                               "unrecognized arguments: hybrid --no-such-flag 3")
    with pytest.raises(ValueError, match="^argument --transformer-impl: invalid choice: 'te'"):
        parse_args(["--transformer-impl", "te"])
    assert isinstance(parse_args([]), argparse.Namespace) and accepted_without_effect(parse_args([])) is None


@pytest.mark.parametrize("name", ["gpt3_175b_now", "llama3_8b_fp8"])
def test_a_rejected_flag_is_reported_before_torch_is_imported(name):
    """examples/pretrain_gpt.py names the rejected flags (the line parse_args would give) and exits 2, having
    imported neither torch nor the trainer (``-X importtime`` lists every module the process imported)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = SCRIPTS[name]
    done = subprocess.run([sys.executable, "-X", "importtime", os.path.join(root, "examples", "pretrain_gpt.py"),
                           *_argv(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    lines = done.stderr.splitlines()
    errors = [line for line in lines if not line.startswith("import time:")]
    reasons = "; ".join(f"{row[0]} is not implemented in megalite: {NOT_IMPLEMENTED[row[0]]}"
                        for row in script if row[0] in REJECTED)
    assert done.returncode == 2 and errors == [f"error: {reasons}"], done.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert "megalite.training.megatron_compat" in imported
    assert not {"torch", "numpy", "megalite.topology", "megalite.training.training"} & imported


def test_gpt3_ramp_needs_sample_based_training_as_in_megatron():
    """The GPT-3 script's --rampup-batch-size with --train-iters fails Megatron-LM's own check (core_v0.16.1
    arguments.py: "expected no batch-size rampup for iteration-based training"); with --train-samples it runs."""
    from megalite.training.arguments import validate_args
    from megalite.training.batch_ramp import BatchSizeRamp

    kept = [row for row in GPT3_175B if row[0] not in REJECTED]
    with pytest.raises(ValueError, match=r"^--rampup-batch-size needs sample-based training \(--train-samples\)"):
        validate_args(parse_args(_argv(kept)), world_size=128)
    by_samples = [row for row in kept if row[0] not in ("--train-iters", "--lr-decay-iters")]
    args = validate_args(parse_args(_argv(by_samples) + ["--train-samples", "768000000"]), world_size=128)
    assert args.rampup_batch_size == [16, 16, 5859375] and args.data_parallel_size == 1
    # counted by walking the ramp (test_batch_ramp.py checks that walk against Megatron-Core's calculator)
    assert args.train_iters == BatchSizeRamp(16, 16, 5859375, 1536).train_iters(768000000) > 768000000 // 1536
