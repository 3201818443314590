"""Optimizers: mixed-precision AdamW (optionally ZeRO-1 sharded), loss scaling, gradient clipping."""

from megalite.optim.clip_grads import clip_grad_norm
from megalite.optim.config import OptimizerConfig
from megalite.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalite.optim.optimizer import MixedPrecisionOptimizer, get_optimizer

__all__ = ["OptimizerConfig", "get_optimizer", "clip_grad_norm", "DynamicGradScaler", "ConstantGradScaler",
           "MixedPrecisionOptimizer"]
