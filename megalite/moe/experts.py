"""This rank's expert MLPs, run over rows that are already grouped by expert.

Each expert is ``fc2(act(fc1(x)))``.  Under expert tensor parallelism (ETP)
fc1 is split by output columns and fc2 by input columns, so a rank returns a
partial sum that the dispatcher reduces over the ETP group; fc2's bias is added
on ETP rank 0 only, while every ETP rank gets its full gradient (all of them
see the same rows and the same output gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.moe.config import MoEConfig
from megalite.tensor_parallel.weight_grad import current_weight_grad_store

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _FirstRankOnly(torch.autograd.Function):
    """Forward: ``x`` on the first rank, zeros elsewhere.  Backward: the gradient unchanged on every rank."""

    @staticmethod
    def forward(ctx, x, first):
        return x.clone() if first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _SplitGroupedLinear(torch.autograd.Function):
    """Row block e of ``x`` times ``weight[e].T`` with a deferrable weight gradient (split backward).

    Used only while a :class:`WeightGradStore` is active: the input gradient is
    computed in backward, the ``[E, out, in]`` weight gradient is pushed to the store.
    """

    @staticmethod
    def forward(ctx, x, weight, counts):
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        return torch.cat([F.linear(rows, weight[e]) for e, rows in enumerate(x.split(counts))])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        blocks = grad.split(ctx.counts)
        grad_x = torch.cat([g.matmul(weight[e]) for e, g in enumerate(blocks)]) if ctx.needs_input_grad[0] else None

        def weight_grad():
            return torch.stack([g.t().matmul(rows) for g, rows in zip(blocks, x.split(ctx.counts))])

        grad_weight = None
        if ctx.needs_input_grad[1]:
            store = current_weight_grad_store()
            if store is None:
                grad_weight = weight_grad()
            else:
                store.push(lambda: torch.autograd.backward(weight, weight_grad()))
        return grad_x, grad_weight, None


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def grouped_mm_usable(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """True when torch's grouped matmul takes these operands and its output.

    It needs CPU tensors or bf16 on GPU, 16-byte aligned pointers, and 16-byte
    row strides for both operands and the output (also needed by its backward).
    """
    if _GROUPED_MM is None:
        return False
    if x.device.type != "cpu" and x.dtype != torch.bfloat16:
        return False
    return _aligned(x) and _aligned(weight_t) and (weight_t.shape[-1] * x.element_size()) % 16 == 0


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], rows_expert: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Row block e of ``x`` times ``weight[e].T`` (+ ``bias[e]``) for every expert e."""
    weight_t = weight.transpose(1, 2)
    x = x.contiguous()
    if current_weight_grad_store() is not None:
        out = _SplitGroupedLinear.apply(x, weight, counts)
    elif grouped_mm_usable(x, weight_t):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        out = _ContiguousGrad.apply(_GROUPED_MM(x, weight_t, offs=offsets))
    else:
        out = _padded_bmm(x, weight_t, counts, rows_expert)
    if bias is not None:
        out = out + bias.index_select(0, rows_expert)
    return out


def _padded_bmm(x: torch.Tensor, weight_t: torch.Tensor, counts: list[int], rows_expert: torch.Tensor):
    """Grouped matmul through a zero-padded [E, max rows, in] batch."""
    starts = torch.tensor([0] + counts[:-1], device=x.device).cumsum(0)
    slot = torch.arange(x.shape[0], device=x.device) - starts.index_select(0, rows_expert)
    padded = x.new_zeros(len(counts), max(counts, default=0), x.shape[1])
    padded = padded.index_put((rows_expert, slot), x)
    return torch.bmm(padded, weight_t)[rows_expert, slot]


class Experts(nn.Module):
    """``num_local`` experts (global ids ``first .. first + num_local - 1``), each an ETP shard.

    Every rank draws all ``config.num_experts`` full weights from the default
    generator in expert order and keeps its own, so one seed gives one model
    under every EP/ETP layout.  All parameters carry ``expert_parallel=True``;
    the ETP shards (fc1 weight and bias, fc2 weight) also ``tensor_model_parallel``
    with their ``partition_dim`` (for SwiGLU, fc1 keeps matching gate and up
    blocks), so gradient norms count them on every ETP rank.
    """

    def __init__(self, hidden_size: int, config: MoEConfig, num_local: int, first: int,
                 etp_rank: int = 0, etp_size: int = 1):
        super().__init__()
        self.config, self.first_etp_rank = config, etp_rank == 0
        ffn, std = config.ffn_hidden_size, config.init_method_std
        shard = ffn // etp_size
        cols = slice(etp_rank * shard, (etp_rank + 1) * shard)
        gated = config.activation == "swiglu"
        fc1_rows = 2 * shard if gated else shard

        self.fc1_weight = nn.Parameter(torch.empty(num_local, fc1_rows, hidden_size))
        self.fc2_weight = nn.Parameter(torch.empty(num_local, hidden_size, shard))
        self.fc1_bias = nn.Parameter(torch.zeros(num_local, fc1_rows)) if config.add_bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(num_local, hidden_size)) if config.add_bias else None
        with torch.no_grad():
            for expert in range(config.num_experts):
                fc1 = torch.empty((2 if gated else 1) * ffn, hidden_size).normal_(0.0, std)
                fc2 = torch.empty(hidden_size, ffn).normal_(0.0, std)
                local = expert - first
                if 0 <= local < num_local:
                    if gated:
                        gate, up = fc1.chunk(2)
                        self.fc1_weight[local].copy_(torch.cat([gate[cols], up[cols]]))
                    else:
                        self.fc1_weight[local].copy_(fc1[cols])
                    self.fc2_weight[local].copy_(fc2[:, cols])
        for param in self.parameters():
            param.expert_parallel = True
        for param, dim in ((self.fc1_weight, 1), (self.fc1_bias, 1), (self.fc2_weight, 2)):
            if param is not None:
                param.tensor_model_parallel, param.partition_dim = True, dim

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.activation == "swiglu":
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        approximate = "tanh" if self.config.activation == "gelu_tanh" else "none"
        return F.gelu(x, approximate=approximate)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` [N, h] holds ``counts[e]`` rows for local expert e, in order; returns [N, h].

        While a weight-grad store is active (a zero-bubble schedule) both paths use the
        grouped form with a deferrable weight gradient.
        """
        fc2_bias = None
        if self.fc2_bias is not None:
            fc2_bias = _FirstRankOnly.apply(self.fc2_bias, self.first_etp_rank)
        if not self.config.grouped_gemm and current_weight_grad_store() is None:
            outputs = []
            for e, rows in enumerate(x.split(counts)):
                hidden = F.linear(rows, self.fc1_weight[e], None if self.fc1_bias is None else self.fc1_bias[e])
                outputs.append(F.linear(self._activation(hidden), self.fc2_weight[e],
                                        None if fc2_bias is None else fc2_bias[e]))
            return torch.cat(outputs)
        rows_expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                              torch.tensor(counts, device=x.device), output_size=x.shape[0])
        hidden = _grouped_linear(x, self.fc1_weight, counts, rows_expert, self.fc1_bias)
        return _grouped_linear(self._activation(hidden), self.fc2_weight, counts, rows_expert, fc2_bias)
