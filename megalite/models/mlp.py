"""The transformer's feed-forward block: column-parallel fc1, activation, row-parallel fc2.

SwiGLU layout of ``linear_fc1``: the full model has a gate weight and an up
weight, each ``[ffn, h]``.  TP rank ``i`` holds ``[gate_i; up_i]`` (its
``ffn/tp`` gate rows, then its ``ffn/tp`` up rows), so the activation splits
each rank's output into halves.  The master weight handed to the TP layer is
therefore ``[gate_0; up_0; gate_1; up_1; ...]`` for the run's TP size, built
from gate and up drawn the same way under every TP size.  The bias follows the
same layout.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megalite import batch_invariant, kernels, topology
from megalite.models.init import normal_init, scaled_normal_init
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def swiglu_fc1_init(std: float, tp: int):
    """Init of the ``[2*ffn, h]`` fc1 master weight: gate then up drawn N(0, std), interleaved per TP rank."""

    def init(master: torch.Tensor) -> None:
        ffn, h = master.shape[0] // 2, master.shape[1]
        gate, up = torch.empty(ffn, h), torch.empty(ffn, h)
        torch.nn.init.normal_(gate, mean=0.0, std=std)
        torch.nn.init.normal_(up, mean=0.0, std=std)
        blocks = torch.stack([gate.view(tp, ffn // tp, h), up.view(tp, ffn // tp, h)], dim=1)
        with torch.no_grad():
            master.copy_(blocks.reshape(2 * ffn, h))

    return init


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": partial(kernels.bias_gelu, bias=None),
    "swiglu": partial(kernels.bias_swiglu, bias=None),
}


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``; returns ``(output, fc2_bias)`` for the fused bias-dropout-add.

    fc1 adds its bias inside the matmul (one fused addmm), so the activation
    runs without a separate bias pass.  ``ffn_hidden_size`` (default
    ``config.ffn_hidden_size``) sizes an MoE layer's shared expert.
    """

    def __init__(self, config, *, tp_group=None, sequence_parallel: bool = False, ffn_hidden_size: int | None = None):
        super().__init__()
        gated = config.activation == "swiglu"
        std = config.init_method_std
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        self.activation = ACTIVATIONS[config.activation]
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if gated else ffn, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, tp_group=tp_group,
            init_method=swiglu_fc1_init(std, topology.group_size(tp_group)) if gated else normal_init(std))
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            sequence_parallel=sequence_parallel, tp_group=tp_group,
            init_method=scaled_normal_init(std, config.num_layers))

    def forward(self, x: torch.Tensor):
        hidden = self.linear_fc1(x)
        if batch_invariant.enabled():  # a fixed-shape call per row: no element in a vector loop's scalar tail
            return self.linear_fc2(batch_invariant.rowwise(self.activation, hidden))
        return self.linear_fc2(self.activation(hidden))
