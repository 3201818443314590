"""Autograd and fake-tensor registrations for the ops of the megalite._C extension."""

from __future__ import annotations

import torch

try:
    from megalite import _C
except ImportError:
    _C = None

BUILT = _C is not None
WITH_CUDA = BUILT and bool(_C.WITH_CUDA)
OPS = ("layer_norm", "rms_norm", "bias_gelu", "bias_swiglu", "apply_rotary", "bias_dropout_add",
       "scaled_upper_triang_masked_softmax", "scaled_masked_softmax", "permute", "unpermute")


def supports_device(device: torch.device) -> bool:
    """True when the extension has kernels for this device."""
    return BUILT and (device.type == "cpu" or (device.type == "cuda" and WITH_CUDA))
