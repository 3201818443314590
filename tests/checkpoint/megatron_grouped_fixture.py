"""Megatron-Core's GroupedMLP experts (``--moe-grouped-gemm``) run on CPU ranks, in the test process only.

GroupedMLP (Megatron-Core 0.16, ``megatron/core/transformer/moe/experts.py``, built by the local spec when
``moe_use_legacy_grouped_gemm``) computes its experts with ``grouped_gemm.ops.gmm(a, b, batch_sizes,
trans_b=False)`` of the grouped_gemm package (a CUDA kernel: rows ``a[sum(batch_sizes[:e]):][:batch_sizes[e]]``
times ``b[e]`` for each expert ``e``, concatenated), looked up at each call as ``grouped_gemm_util.ops.gmm``.
:func:`patch_grouped_gemm` puts an exact CPU stand-in there: a loop of fp32 matmuls over the per-expert row
counts, differentiable by autograd as the kernel's own backward is (the same two products per expert).
GroupedMLP's forward also asserts ``config.bf16`` (its kernel's only dtype); :func:`allow_fp32` gives each
GroupedMLP a copy of the config that says bf16, the model's own config (its softmax's dtype) untouched.
"""

from __future__ import annotations

import copy
import types

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm's ``gmm`` on the CPU: expert ``e``'s ``batch_sizes[e]`` rows of ``a`` times ``b[e]`` (its
    transpose with ``trans_b``), the experts' products concatenated in row order."""
    rows = [int(n) for n in batch_sizes.tolist()]
    return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(a.split(rows), b)])


def patch_grouped_gemm() -> None:
    """Megatron-Core's grouped_gemm hooks (availability check and ``ops``) pointed at :func:`gmm`; GroupedMLP's
    activation closures run eagerly (``jit_fuser``, torch.compile, is a fusion that would compile them on each rank:
    seconds of CPU for the same fp32 values)."""
    from megatron.core.transformer.moe import experts, grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    grouped_gemm_util.ops = types.SimpleNamespace(gmm=gmm)
    experts.jit_fuser = lambda function: function


def allow_fp32(model) -> None:
    """Each GroupedMLP of ``model`` sees a copy of its config with ``bf16`` set (its forward asserts it); the
    weights and the computation stay fp32."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    for module in model.modules():
        if isinstance(module, GroupedMLP):
            module.config = copy.copy(module.config)
            module.config.bf16 = True
