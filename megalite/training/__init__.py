"""Pretraining: flags, the training loop, checkpoints, LR schedule, logging and signal handling."""

from megalite.training.checkpointing import load_checkpoint, save_checkpoint
from megalite.training.lr_schedule import LRScheduler
from megalite.training.training import pretrain

__all__ = ["pretrain", "save_checkpoint", "load_checkpoint", "LRScheduler"]
