"""Where logged training metrics go: a JSON-lines file, TensorBoard, Weights & Biases and a compact stdout line.

Only the rank that owns a :class:`MetricsLogger` with ``enabled=True`` (rank 0)
writes; values arrive already reduced across data-parallel ranks.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys

import torch

from megalite.checkpoint.files import WANDB_DIR

def _on_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def memory_gib() -> dict[str, float]:
    """Peak memory of this process: GPU allocator peak on GPU, resident set peak on CPU."""
    if _on_gpu():
        return {"mem_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                "mem_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30}
    return {"max_rss_gib": peak_memory()[0] / 2 ** 30}


def peak_memory() -> tuple[int, str]:
    """This process's peak memory in bytes and what it counts: the GPU allocator's peak, or on CPU the resident
    set's (the whole process: interpreter, libraries and data too)."""
    if _on_gpu():
        return torch.cuda.max_memory_allocated(), "allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS"


def wandb_init(args) -> dict | None:
    """``wandb.init``'s arguments under ``--wandb-project``, as Megatron-LM gives them (the flags as the config;
    the directory ``--wandb-save-dir``, else ``--save``/wandb); None without it."""
    if not args.wandb_project:
        return None
    save_dir = args.wandb_save_dir or (os.path.join(args.save, WANDB_DIR) if args.save else None)
    return {"project": args.wandb_project, "name": args.wandb_exp_name, "dir": save_dir, "config": vars(args)}


def _fmt(value) -> str:
    if not isinstance(value, float):
        return str(value)
    if value != 0 and abs(value) < 1e-2:
        return f"{value:.3E}"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4f}"


class MetricsLogger:
    """Appends one JSON object per logged iteration, mirrors scalars to TensorBoard and W&B, and prints a line.

    ``wandb_init``: keyword arguments of ``wandb.init`` (the ``wandb`` package, an optional extra); W&B then
    gets the scalars TensorBoard gets, under the same names, at the iteration as its step.
    """

    _SHOWN = ("loss", "valid_loss", "valid_ppl", "test_loss", "test_ppl", "lr", "global_batch_size", "grad_norm", "params_norm", "num_zeros",
              "loss_scale", "tokens_per_sec", "iter_ms", "tflops", "mfu", "skipped", "moe_load_imbalance",
              "moe_expert_bias_norm", "mem_allocated_gib",
              "mem_reserved_gib", "max_rss_gib")

    def __init__(self, enabled: bool, metrics_file: str | None = None, tensorboard_dir: str | None = None,
                 train_iters: int | None = None, stream=None, wandb_init: dict | None = None):
        self.enabled = enabled
        self.train_iters = train_iters
        self.stream = stream or sys.stdout
        self.metrics_file = metrics_file if enabled else None
        self.writer = None
        if enabled and self.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        self.wandb = None
        if enabled and wandb_init is not None:
            import wandb

            if wandb_init.get("dir"):
                os.makedirs(wandb_init["dir"], exist_ok=True)
            wandb.init(**wandb_init)
            self.wandb = wandb

    def log(self, iteration: int, values: dict, tensorboard_extra: dict | None = None) -> None:
        """Record ``values`` for ``iteration`` in every sink; ``tensorboard_extra`` goes to TensorBoard only."""
        if not self.enabled:
            return
        record = {"iteration": iteration, **{k: _plain(v) for k, v in values.items()}}
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        scalars = {_tb_name(key): value for key, value in {**record, **(tensorboard_extra or {})}.items()
                   if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value)}
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, iteration)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)
        total = f"/{self.train_iters}" if self.train_iters else ""
        parts = [f"iteration {iteration}{total}"]
        mtp = tuple(k for k in record if k.startswith("mtp_"))  # multi-token prediction losses, after the loss
        parts += [f"{k} {_fmt(record[k])}" for k in self._SHOWN[:1] + mtp + self._SHOWN[1:] if k in record]
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _tb_name(key: str) -> str:
    """Group TensorBoard scalars: train/*, valid/*, memory/*, moe/*, throughput/*."""
    if key.startswith(("valid_", "test_")):
        split, name = key.split("_", 1)
        return f"{split}/{name}"
    if key.startswith(("mem_", "max_rss")):
        return "memory/" + key
    if key.startswith("moe_"):
        return "moe/" + key[len("moe_"):]
    if key in ("tokens_per_sec", "tflops", "mfu", "iter_ms"):
        return "throughput/" + key
    return "train/" + key
