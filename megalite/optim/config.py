"""Configuration of the optimizer, mixed precision and gradient clipping."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters and precision of one training run.

    ZeRO-1 (main parameters and Adam state sharded over DP) follows the model chunks:
    ``DDPConfig(use_distributed_optimizer=True)``.

    clip_grad: maximum global L2 norm of the gradients; 0 disables clipping.
    bf16 / fp16: the model parameters' dtype; the optimizer keeps fp32 main copies.  fp16 adds a
        loss scaler: the constant ``loss_scale`` when set, else a dynamic one (initial_loss_scale,
        min_loss_scale, loss_scale_window, hysteresis).
    overlap_param_gather: leave the all-gather of updated parameters in flight after ``step`` and
        wait for each bucket just before the first module using it runs its forward.
    log_num_zeros_in_grad: count the gradient entries that are exactly zero at each step (one more
        all-reduce), returned by ``step``.
    """

    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    overlap_param_gather: bool = False
    log_num_zeros_in_grad: bool = False

    def __post_init__(self):
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 are exclusive; got bf16=True and fp16=True")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"loss_scale must be positive or None (dynamic), got {self.loss_scale}")
