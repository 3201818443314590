"""Column- and row-parallel linear layers.

Weights use ``nn.Linear``'s ``[out, in]`` layout.  ColumnParallelLinear splits
the output features (weight ``[out/tp, in]``), RowParallelLinear the input
features (weight ``[out, in/tp]``); TP rank i holds the i-th contiguous block.
A column layer followed by a row layer needs one all-reduce forward (after the
row layer) and one backward (before the column layer's input gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import batch_invariant, topology
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.initialization import InitMethod, mark_tensor_parallel, sharded_master_weight
from megalite.tensor_parallel.utils import divide
from megalite.tensor_parallel.weight_grad import current_weight_grad_store


def _weight_grad(grad_output: torch.Tensor, total_input: torch.Tensor) -> torch.Tensor:
    """``grad_output^T @ input`` over all leading dims: the gradient of an ``[out, in]`` weight."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(total_input.reshape(-1, total_input.shape[-1]))


def _defer_weight_grad(weight: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> bool:
    """Push this weight's gradient to the active :class:`WeightGradStore`; False when it must be computed now.

    Only a leaf weight (a parameter) can be deferred: its closure accumulates through autograd.
    """
    store = current_weight_grad_store()
    if store is None or not weight.is_leaf:
        return False
    store.push(lambda: torch.autograd.backward(weight, _weight_grad(grad_output, total_input)))
    return True


class _LinearFn(torch.autograd.Function):
    """``linear(input, weight)`` whose weight gradient may be deferred (split backward, no communication)."""

    @staticmethod
    def forward(ctx, input, weight):
        ctx.save_for_backward(input, weight)
        return forward_linear(input, weight)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1] and not _defer_weight_grad(weight, grad_output, input):
            grad_weight = _weight_grad(grad_output, input)
        return grad_input, grad_weight


def forward_linear(input, weight, bias=None):
    """``F.linear``, or under ``batch_invariant.mode`` its fixed-shape form (same function, batch-invariant bits)."""
    if batch_invariant.enabled():
        return batch_invariant.linear(input, weight, bias)
    return F.linear(input, weight, bias)


def _linear(input, weight, bias=None):
    """``F.linear``, or under an active weight-grad store the form whose weight gradient can be deferred."""
    if current_weight_grad_store() is None:
        return forward_linear(input, weight, bias)
    output = _LinearFn.apply(input, weight)
    return output if bias is None else output + bias


class _ColumnParallelLinearFn(torch.autograd.Function):
    """``linear(gather(input), weight, bias)`` whose backward overlaps communication.

    Backward computes the input gradient first and launches its reduction
    (all-reduce, or reduce-scatter under sequence parallelism) asynchronously,
    then computes the weight gradient while the reduction is in flight, or
    defers it to the active :class:`WeightGradStore` (split backward).
    """

    @staticmethod
    def forward(ctx, input, weight, bias, group, sequence_parallel, overlap):
        total = mappings.gather_first(input, group) if sequence_parallel else input
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sequence_parallel, ctx.overlap = group, sequence_parallel, overlap
        ctx.has_bias = bias is not None
        return forward_linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        total, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_input = work = None
        if need_input:
            grad_input = grad_output.matmul(weight)
            if ctx.sequence_parallel:
                grad_input, work = mappings.reduce_scatter_first(grad_input, ctx.group, async_op=True)
            else:
                grad_input = grad_input.contiguous()
                work = torch.distributed.all_reduce(grad_input, group=ctx.group, async_op=True)
            if not ctx.overlap:
                work.wait()
        grad_weight = grad_bias = None
        if need_weight and not _defer_weight_grad(weight, grad_output, total):
            grad_weight = _weight_grad(grad_output, total)
        if need_bias and ctx.has_bias:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        if work is not None and ctx.overlap:
            work.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def column_parallel_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                           tp_group=None, sequence_parallel: bool = False, gather_output: bool = False,
                           async_grad_allreduce: bool = True) -> torch.Tensor:
    """``input @ weight.T + bias`` with ``weight`` a column shard ``[out/tp, in]``.

    The functional form of :class:`ColumnParallelLinear`, for weights owned
    elsewhere (e.g. an output layer tied to the word embedding).  ``input`` is
    replicated over TP (``[s/tp, b, in]`` under sequence parallelism, gathered
    along dim 0 here).  Returns the ``[..., out/tp]`` shard, or the full output
    with ``gather_output=True``.
    """
    group = topology.resolve_group(tp_group, "tp")
    if topology.group_size(group) == 1:
        output = _linear(input, weight, bias)
    else:
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True cannot be combined with sequence_parallel=True")
        output = _ColumnParallelLinearFn.apply(input, weight, bias, group, sequence_parallel,
                                               async_grad_allreduce)
    if gather_output:
        output = mappings.gather_from_tensor_parallel_region(output, group)
    return output


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with A split along its output features across TP ranks.

    Returns the output (``[..., out/tp]``, or ``[..., out]`` when
    ``gather_output``), or ``(output, bias)`` with ``skip_bias_add=True`` so the
    caller can fuse the bias add (the bias matches the output: gathered too
    when ``gather_output``).  ``forward(input, weight=...)`` uses an
    external weight shard (tied embeddings).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, sequence_parallel: bool = False, tp_group=None,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32, device=None,
                 async_grad_allreduce: bool = True):
        super().__init__()
        self.tp_group = topology.resolve_group(tp_group, "tp")
        self.tp_size = topology.group_size(self.tp_group)
        self.tp_rank = topology.group_rank(self.tp_group)
        self.output_size_per_partition = divide(out_features, self.tp_size, "out_features")
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.async_grad_allreduce = async_grad_allreduce
        self.weight = mark_tensor_parallel(nn.Parameter(sharded_master_weight(
            (out_features, in_features), 0, self.tp_rank, self.tp_size, init_method, params_dtype, device)), 0)
        if bias:
            self.bias = mark_tensor_parallel(nn.Parameter(torch.zeros(
                self.output_size_per_partition, dtype=params_dtype, device=device)), 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor, weight: torch.Tensor | None = None):
        weight = self.weight if weight is None else weight
        if weight.shape != self.weight.shape:
            raise ValueError(f"ColumnParallelLinear: external weight has shape {tuple(weight.shape)}, "
                             f"expected {tuple(self.weight.shape)}")
        fused_bias = None if self.skip_bias_add else self.bias
        output = column_parallel_linear(input, weight, fused_bias, tp_group=self.tp_group,
                                        sequence_parallel=self.sequence_parallel, gather_output=self.gather_output,
                                        async_grad_allreduce=self.async_grad_allreduce)
        if not self.skip_bias_add:
            return output
        if self.gather_output and self.bias is not None:
            return output, mappings.gather_from_tensor_parallel_region(self.bias, self.tp_group)
        return output, self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp_size={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with A split along its input features across TP ranks.

    Partial products are summed over TP (all-reduce, or reduce-scatter to
    ``[s/tp, b, out]`` under sequence parallelism); the whole bias, held by
    every rank, is added once after the reduction.  Returns the output, or
    ``(output, bias)`` with ``skip_bias_add=True``.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, sequence_parallel: bool = False, tp_group=None,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.tp_group = topology.resolve_group(tp_group, "tp")
        self.tp_size = topology.group_size(self.tp_group)
        self.tp_rank = topology.group_rank(self.tp_group)
        self.input_size_per_partition = divide(in_features, self.tp_size, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.weight = mark_tensor_parallel(nn.Parameter(sharded_master_weight(
            (out_features, in_features), 1, self.tp_rank, self.tp_size, init_method, params_dtype, device)), 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor):
        if not self.input_is_parallel:
            input = mappings.scatter_to_tensor_parallel_region(input, self.tp_group)
        if self.tp_size == 1:
            output = _linear(input, self.weight, None if self.skip_bias_add else self.bias)
            return (output, self.bias) if self.skip_bias_add else output
        partial = _linear(input, self.weight)
        if self.sequence_parallel:
            output = mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            output = mappings.reduce_from_tensor_parallel_region(partial, self.tp_group, inplace=True)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            # The reduced output is a fresh tensor that no backward reads: add the bias in place.
            output = output.add_(self.bias)
        return output

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp_size={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")
