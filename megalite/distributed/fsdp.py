"""Fully sharded data parallelism through torch's FSDP2 (``fully_shard``), composed with TP, PP and EP.

``FullyShardedDataParallel`` applies ``fully_shard`` from outside the model, torchtitan style: the
experts of every MoE layer over the expert-data-parallel group, each transformer layer and then the
whole model chunk over the data-parallel group.  Each rank's tensor-parallel shard is what FSDP
shards further (dim 0, over DP), the 2-D layout Megatron and torchtitan use.

The wrapper offers the chunk interface the pipeline schedules, ``finalize_model_grads`` and the
optimizer use with :class:`~megalite.distributed.DistributedDataParallel`:

- ``no_sync()`` turns FSDP's gradient reduce-scatter off, so micro-batches accumulate unsharded
  gradients and the last one reduce-scatters their sum, once per step;
- every sharded parameter keeps a persistent gradient (FSDP accumulates into it in place), and
  ``param.main_grad`` is its local shard, the same name DDP gives the reduced gradient;
- ``owned_range`` / ``owned_values`` / ``owned_grad`` give the optimizer the flat slice of the local
  (TP) parameter this rank updates: the rows FSDP placed here.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megalite.distributed.config import FSDPConfig
from megalite.topology import group_size, resolve_group


def owned_rows(param: DTensor) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of dim 0 that this rank's shard of FSDP parameter ``param`` holds."""
    mesh = param.device_mesh
    rows, size, rank = param.shape[0], mesh.size(), mesh.get_local_rank()
    per = -(-rows // size)
    lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
    if param.to_local().shape[0] != hi - lo:
        raise RuntimeError(f"FSDP shard of a {tuple(param.shape)} parameter has {param.to_local().shape[0]} rows "
                           f"on rank {rank} of {size}; expected {hi - lo}")
    return lo, hi


def owned_flat_range(param: DTensor) -> tuple[int, int]:
    """This rank's shard of ``param`` as a range of the flattened (TP-local) parameter."""
    lo, hi = owned_rows(param)
    row = math.prod(param.shape[1:])
    return lo * row, hi * row


def _mesh(group, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(group, device_type)


def _expert_modules(module: nn.Module) -> list[nn.Module]:
    """Submodules whose own parameters are all MoE expert parameters (the ``Experts`` of each MoE layer)."""
    found = []
    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        if own and all(getattr(p, "expert_parallel", False) for p in own):
            found.append(sub)
    return found


def _transformer_layers(module: nn.Module) -> list[nn.Module]:
    decoder = getattr(module, "decoder", None)
    return list(decoder.layers.values()) if decoder is not None else []


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over the data-parallel group.

    Expert parameters (``expert_parallel``) are sharded over ``expert_dp_group`` and their reduced
    gradient divided by the dense DP size, the mean over dense-DP replicas that DDP also gives.
    ``module`` must hold fp32 parameters: they become the fp32 sharded main weights, and
    ``config.param_dtype`` sets the compute and all-gather dtype.
    """

    def __init__(self, module: nn.Module, config: FSDPConfig | None = None, dp_group=None, expert_dp_group=None):
        super().__init__()
        self.config = config or FSDPConfig()
        self.dp_group = resolve_group(dp_group, "dp")
        self.expert_dp_group = resolve_group(expert_dp_group, "expert_dp")
        bad = sorted({str(p.dtype) for p in module.parameters()} - {"torch.float32"})
        if bad:
            raise ValueError(f"FullyShardedDataParallel needs fp32 parameters (the sharded main weights), got {bad}; "
                             "set FSDPConfig.param_dtype for bf16/fp16 compute")
        attributes = {name: {k: v for k, v in vars(p).items() if not k.startswith("_")}
                      for name, p in module.named_parameters()}
        device_type = next(module.parameters()).device.type
        policy = MixedPrecisionPolicy(param_dtype=self.config.param_dtype,
                                      reduce_dtype=torch.float32 if self.config.grad_reduce_in_fp32 else None)
        options = dict(reshard_after_forward=self.config.reshard_after_forward, mp_policy=policy)
        dense_mesh = _mesh(self.dp_group, device_type)
        experts = _expert_modules(module)
        if experts:
            expert_mesh = _mesh(self.expert_dp_group, device_type)
            for sub in experts:
                fully_shard(sub, mesh=expert_mesh, **options)
                sub.set_gradient_divide_factor(float(group_size(self.dp_group)))
                # A divide factor other than the group size is a PREMUL_SUM, which gloo lacks: sum, then divide.
                sub.set_force_sum_reduction_for_comms(True)
        for layer in _transformer_layers(module):
            fully_shard(layer, mesh=dense_mesh, **options)
        fully_shard(module, mesh=dense_mesh, **options)
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for name, p in module.named_parameters():
                for key, value in attributes[name].items():
                    setattr(p, key, value)
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    p.main_grad = p.grad.to_local()
        self._range = {p: owned_flat_range(p) for p in self.params}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients without reduce-scattering (every micro-batch but the last)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP finishes its reduce-scatters at the end of the last backward."""

    def grad_tensors(self) -> list[torch.Tensor]:
        """This rank's sharded gradients, e.g. for finiteness checks."""
        return [p.main_grad for p in self.params]

    def zero_grad_buffer(self) -> None:
        """Zero the sharded gradients in place (FSDP accumulates into them)."""
        for p in self.params:
            p.main_grad.zero_()

    def start_param_sync(self) -> None:
        """Nothing to do: FSDP all-gathers the updated shards in the next forward."""

    def finish_param_sync(self) -> None:
        """Nothing to do: see :meth:`start_param_sync`."""

    @property
    def shards_optimizer_state(self) -> bool:
        return True

    def owned_range(self, param) -> tuple[int, int] | None:
        """The part ``(lo, hi)`` of the flattened TP-local parameter this rank updates, or None."""
        lo, hi = self._range[param]
        return (lo, hi) if hi > lo else None

    def owned_values(self, param) -> torch.Tensor:
        """This rank's shard of ``param`` as a flat tensor aliasing the parameter."""
        return param.to_local().detach().view(-1)

    def owned_grad(self, param) -> torch.Tensor:
        return param.main_grad.view(-1)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
