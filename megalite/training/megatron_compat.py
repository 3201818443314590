"""Megatron-LM flags that megalite accepts without effect, and those it names as not implemented.

Megatron-LM's launch scripts carry flags that pick among its own implementations (Transformer Engine
or local layers, attention and fusion kernels, dataloader details).  megalite has one implementation
of each, so these rows (``COMPAT_FLAGS``) are accepted and ``accepted_without_effect`` gives the one
info line that the trainer prints, each flag with the reason it changes nothing here.  Flags that would
change the numerics and are not implemented are not parser rows: ``NOT_IMPLEMENTED`` only names them
so that the parser's "unrecognized arguments" error says why (``unrecognized_message``), and so that a
launch script can reject them before the heavy imports (``reject_not_implemented``).  This module imports
only ``megalite.flags`` (argparse), never torch.
"""

from __future__ import annotations

from megalite.flags import Flag, FlagTable

COMPAT = "Megatron-LM flags accepted with no effect here"

_KERNELS = ("megalite's fused kernels give the plain torch ops' results, and MEGALITE_NO_FUSED=1 turns all of "
            "them off")

COMPAT_FLAGS = FlagTable((
    Flag("--use-mcore-models", COMPAT, default=False, help="megalite has one model implementation, in plain PyTorch"),
    Flag("--transformer-impl", COMPAT, choices=("local", "transformer_engine"),
         help="megalite's layers are its own PyTorch modules, without Transformer Engine"),
    Flag("--attention-backend", COMPAT, choices=("auto", "flash", "fused", "unfused", "local"),
         help="megalite's attention is torch's scaled_dot_product_attention, which picks its own kernel"),
    Flag("--use-flash-attn", COMPAT, default=False,
         help="torch's scaled_dot_product_attention uses flash attention where the device supports it"),
    Flag("--no-masked-softmax-fusion", COMPAT, default=False,
         help="training attention is torch's scaled_dot_product_attention, without a separate softmax"),
    Flag("--no-bias-gelu-fusion", COMPAT, default=False, help=_KERNELS),
    Flag("--no-bias-dropout-fusion", COMPAT, default=False, help=_KERNELS),
    Flag("--no-bias-swiglu-fusion", COMPAT, default=False, help=_KERNELS),
    Flag("--no-rope-fusion", COMPAT, default=False, help=_KERNELS),
    Flag("--no-gradient-accumulation-fusion", COMPAT, default=False,
         help="megalite accumulates gradients with autograd into fp32 main gradients either way"),
    Flag("--no-async-tensor-model-parallel-allreduce", COMPAT, default=False,
         help="megalite's tensor-parallel all-reduce is synchronous"),
    Flag("--cross-entropy-loss-fusion", COMPAT, default=False,
         help="megalite's vocab-parallel cross entropy is one implementation, the same math"),
    Flag("--distributed-backend", COMPAT, choices=("nccl", "gloo"),
         help="megalite uses nccl on GPUs and gloo on CPUs"),
    Flag("--ckpt-format", COMPAT, choices=("torch", "torch_dist", "zarr", "fsdp_dtensor"),
         help="megalite has one checkpoint format, resharded on load to any layout"),
    Flag("--log-memory-to-tensorboard", COMPAT, default=False,
         help="with --tensorboard-dir the memory always goes to TensorBoard (--log-memory prints it too)"),
    Flag("--use-pytorch-profiler", COMPAT, default=False, help="--profile always uses the torch profiler"),
    Flag("--manual-gc", COMPAT, default=False, help="megalite leaves Python's garbage collector as it is"),
    Flag("--empty-unused-memory-level", COMPAT, type=int, choices=(0, 1, 2),
         help="megalite does not empty the CUDA cache between iterations"),
    Flag("--num-workers", COMPAT, type=int, help="megalite reads batches in the training process"),
    Flag("--no-mmap-bin-files", COMPAT, default=False, help="megalite always memory-maps the .bin files"),
    Flag("--no-create-attention-mask-in-dataloader", COMPAT, default=False,
         help="megalite never builds attention masks in the dataloader"),
    Flag("--tiktoken-pattern", COMPAT, help="only TikTokenizer uses it, which megalite does not have"),
    Flag("--rerun-mode", COMPAT, choices=("disabled", "validate_results", "report_stats"),
         help="megalite has no rerun state machine (see --check-for-nan-in-loss-and-grad)"),
    Flag("--optimizer", COMPAT, choices=("adam",), help="megalite's optimizer is Adam(W), as Megatron's adam"),
))
"""Accepted Megatron-LM flags without effect; each row's help text is the reason printed."""

_FP8 = "megalite has no FP8 training"
_DECOUPLED = "a separate learning rate for the embedding and output layer changes the update"

NOT_IMPLEMENTED = {
    "--step-batch-size-schedule": "newer Megatron-LM's step-wise batch schedule is not implemented; "
                                  "--rampup-batch-size START INCREMENT SAMPLES is (megatron-core 0.16's ramp)",
    "--apply-layernorm-1p": "zero-centered LayerNorm weights change the model",
    "--decoupled-lr": _DECOUPLED,
    "--decoupled-min-lr": _DECOUPLED,
    "--grad-reduce-in-bf16": "megalite reduces gradients in fp32",
    "--calculate-per-token-loss": "megalite averages the loss over each micro-batch's tokens, then over micro-batches "
                                "(Megatron-LM's default)",
    "--fp8-format": _FP8,
    "--fp8-amax-history-len": _FP8,
    "--fp8-amax-compute-algo": _FP8,
    "--fp8-param-gather": _FP8,
    "--fp8-margin": _FP8,
    "--fp8-interval": _FP8,
    "--attention-softmax-in-fp32": "megalite's attention softmax precision is torch's",
    "--dataloader-type": "megalite's sampler is Megatron's single (ordered) sampler only",
    "--no-position-embedding": "megalite has no model without position information; --position-embedding-type "
                               "rope has no learned position embedding",
}
"""Megatron-LM flags that megalite rejects, and why, for the error line."""


def accepted_without_effect(args) -> str | None:
    """One info line naming each given ``COMPAT_FLAGS`` flag and why it changes nothing, or None."""
    given = [flag for flag in COMPAT_FLAGS if getattr(args, flag.dest, None) not in (None, False)]
    if not given:
        return None
    return "info: accepted with no effect here: " + "; ".join(f"{f.name} ({f.help})" for f in given)


def _reasons(words: list[str]) -> list[str]:
    """"FLAG is not implemented in megalite: why" for each ``NOT_IMPLEMENTED`` flag among ``words``."""
    names = [word.split("=", 1)[0] for word in words if word.startswith("--")]
    return [f"{name} is not implemented in megalite: {NOT_IMPLEMENTED[name]}" for name in names
            if name in NOT_IMPLEMENTED]


def reject_not_implemented(argv: list[str]) -> None:
    """Raise ValueError naming every ``NOT_IMPLEMENTED`` flag in ``argv``, with why.

    Needs only this light module, so a launch script calls it before importing torch and the
    trainer, and a rejected Megatron-LM flag is reported at once; ``parse_args`` gives the
    same line (and names unknown flags too) after the imports.
    """
    known = _reasons(argv)
    if known:
        raise ValueError("; ".join(known))


def unrecognized_message(extras: list[str]) -> str:
    """The error for argv words the parser did not take, naming why each known Megatron-LM flag is rejected."""
    known = _reasons(extras)
    other = [word for word in extras if word.split("=", 1)[0] not in NOT_IMPLEMENTED]
    if known and all(not w.startswith("--") for w in other):
        return "; ".join(known)
    return "; ".join(known + [f"unrecognized arguments: {' '.join(other)}"])
