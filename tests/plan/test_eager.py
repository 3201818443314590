"""torchtitan's eager ops (megalite/plan/eager.py) are the kernels and bytes torch dispatches for them.

The forward formulas are those of torchtitan at 9dec370 (``RMSNorm.forward`` in torchtitan/models/norms.py,
``apply_rotary_emb`` and ``FeedForward.forward``'s activation in torchtitan/models/llama/model.py); each
dispatched aten op that is not a view reads its inputs and writes its output in full.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.plan.eager import ROPE, RMSNORM, SWIGLU


class _Count(TorchDispatchMode):
    """Kernels (aten ops other than views) and the bytes of their tensor inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and any(a.alias_info for a in func._schema.returns):
            return out  # a view
        self.kernels += 1
        tensors = [a for a in (*args, *(kwargs or {}).values(), out) if isinstance(a, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _forward(fn, *inputs):
    with _Count() as count:
        fn(*inputs)
    return count


def test_rmsnorm_forward_kernels_and_bytes():
    x, weight = torch.randn(64, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)

    def rmsnorm(x, weight):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight

    count = _forward(rmsnorm, x, weight)
    assert count.kernels == RMSNORM.forward_kernels
    per_row_and_weight = 64 * 4 * 6 + 2 * 256 * 2  # the row statistics' small ops and the weight's read
    assert abs(count.bytes - x.numel() * RMSNORM.forward_bytes) <= per_row_and_weight


def test_rope_and_swiglu_forward_kernels_and_bytes():
    q = torch.randn(2, 16, 4, 32, dtype=torch.bfloat16)
    freqs = torch.polar(torch.ones(16, 16), torch.randn(16, 16)).view(1, 16, 1, 16)

    def rope(q):
        q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        return torch.view_as_real(q_ * freqs).flatten(3).type_as(q)

    count = _forward(rope, q)
    assert count.kernels == ROPE.forward_kernels
    assert count.bytes - freqs.numel() * 8 == q.numel() * ROPE.forward_bytes

    a, b = torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)
    count = _forward(lambda a, b: torch.nn.functional.silu(a) * b, a, b)
    assert count.kernels == SWIGLU.forward_kernels
    assert count.bytes == a.numel() * SWIGLU.forward_bytes
