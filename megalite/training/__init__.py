"""Pretraining: flags, the training loop, checkpoints, LR schedule, logging and signal handling.

The names below load on first use, so a light submodule (``megatron_compat``, which checks a launch
script's flags before torch is imported) does not pull in the trainer.
"""

_EXPORTS = {"pretrain": "megalite.training.training", "save_checkpoint": "megalite.training.checkpointing",
            "load_checkpoint": "megalite.training.checkpointing", "LRScheduler": "megalite.training.lr_schedule"}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megalite.training' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
