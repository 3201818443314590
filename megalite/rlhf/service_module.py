"""TrainingService workers for a user's own ``nn.Module``: ``strategy="fsdp2"`` or ``"ddp"`` over every worker.

The model comes from a zero-argument factory that every worker calls after ``torch.manual_seed(seed)``, so all
workers start from the weights one process seeded alike would build.  ``"fsdp2"`` wraps it in megalite's
:class:`~megalite.distributed.FullyShardedDataParallel` (torch's ``fully_shard`` over the data-parallel group:
parameters, gradients and optimizer state sharded), ``"ddp"`` in megalite's
:class:`~megalite.distributed.DistributedDataParallel`; either way the same :class:`~megalite.rlhf.backend
.TrainingBackend` splits micro-batches, normalizes the objective over the global batch and accumulates gradients.

The optimizer is megalite's (an ``OptimizerConfig``) or a factory ``params -> torch.optim.Optimizer`` that
:class:`TorchOptimizer` drives; either one's state goes into the service's checkpoints.  A factory that raises on any worker
fails ``ready`` on every worker at once (the others name the failed ranks) rather than leaving them waiting for
it in a collective.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel, FSDPConfig, FullyShardedDataParallel
from megalite.distributed.fsdp import owned_flat_range
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.optim.clip_grads import global_grad_norm

WRAPPERS = {"ddp": lambda module, topo: DistributedDataParallel(module, DDPConfig(), topo.dp.group,
                                                                topo.expert_dp.group),
            "fsdp2": lambda module, topo: FullyShardedDataParallel(module, FSDPConfig(), topo.dp.group,
                                                                   topo.expert_dp.group)}


class TorchOptimizer:
    """A ``torch.optim.Optimizer`` over a wrapped chunk, answering the calls :class:`TrainingBackend` makes.

    Under DDP the reduced gradient lives in ``param.main_grad``; it is lent to ``param.grad`` for the step.
    Under FSDP2 ``param.grad`` is already the persistent sharded gradient.  The wrapper's
    ``zero_grad_buffer`` clears either in place (``optimizer.zero_grad`` would drop FSDP's persistent grads).

    Checkpoints hold its state in megalite's format through the interface of megalite's optimizer (``shards``,
    ``sharded_state_dict``, ``load_sharded_state_dict``): every per-parameter state tensor of the parameter's shape
    (Adam's moments, SGD's momentum) as the global tensor ``optimizer.<key>.<parameter>`` (so it loads under
    any number of workers and either strategy), every scalar (Adam's ``step``) and the parameter groups'
    hyperparameters as JSON.
    """

    scale_loss = None  # no loss scaling: the parameters compute in fp32

    def __init__(self, factory, chunk):
        self.chunk = chunk
        self.params = [p for p in chunk.module.parameters() if p.requires_grad]
        self.optimizer = factory(self.params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, "
                            "not a torch.optim.Optimizer")
        self.sharded = isinstance(chunk, FullyShardedDataParallel)
        self.num_steps = 0
        self.torch_optimizer = type(self.optimizer).__name__
        ordered = [p for group in self.optimizer.param_groups for p in group["params"]]
        ranges = [owned_flat_range(p) if self.sharded else (0, p.numel()) for p in ordered]
        self.shards = [SimpleNamespace(key=index, param=p, lo=lo, hi=hi)
                       for index, (p, (lo, hi)) in enumerate(zip(ordered, ranges))]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def sharded_state_dict(self, copy: bool = False) -> dict:
        """This worker's state: each parameter's state tensors as its flat local range (views unless ``copy``),
        the scalars and the groups' hyperparameters as JSON.  A state value of another kind is a ValueError."""
        entries, scalars, keys = {}, {}, set()
        for shard in self.shards:
            entry = entries[shard.key] = {"shape": tuple(shard.param.shape), "offset": shard.lo}
            for key, value in self.optimizer.state.get(shard.param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.param.shape:
                    local = (value.to_local() if isinstance(value, DTensor) else value).detach().reshape(-1)
                    entry[key] = local.clone() if copy else local
                    keys.add(key)
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    scalars.setdefault(str(shard.key), {})[key] = [value.item(), str(value.dtype).split(".")[-1]]
                elif value is None or isinstance(value, (bool, int, float)):
                    scalars.setdefault(str(shard.key), {})[key] = [value, None]
                else:
                    raise ValueError(f"{self.torch_optimizer}'s state {key!r} ({type(value).__name__}) is neither a "
                                     f"tensor of its parameter's shape nor a scalar, so it cannot be checkpointed")
        return {"entries": entries, "num_steps": self.num_steps, "scaler": None,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "torch_optimizer": self.torch_optimizer, "state_keys": sorted(keys), "scalar_state": scalars}

    def load_sharded_state_dict(self, state: dict) -> None:
        """The state of :meth:`sharded_state_dict` (this worker's ranges read from the checkpoint)."""
        torch_state = {}
        for shard in self.shards:
            entry, values = state["entries"][shard.key], {}
            for key in state.get("state_keys", ()):
                if key in entry:
                    values[key] = torch.zeros_like(shard.param.detach())
                    local = values[key].to_local() if isinstance(values[key], DTensor) else values[key]
                    local.view(-1).copy_(entry[key])
            for key, (value, dtype) in state.get("scalar_state", {}).get(str(shard.key), {}).items():
                values[key] = value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))
            if values:
                torch_state[shard.key] = values
        groups, start = [], 0
        for group, saved in zip(self.param_groups, state["param_groups"]):
            groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        self.optimizer.load_state_dict({"state": torch_state, "param_groups": groups})
        self.num_steps = state["num_steps"]

    def grad_norm(self) -> float:
        """The L2 norm of the whole averaged gradient (its FSDP shards summed over the data-parallel group)."""
        dense = [self.chunk.dp_group] if self.sharded else []
        return global_grad_norm(self.params, [p.main_grad for p in self.params], dense, []).item()

    def step(self) -> tuple[bool, float, None]:
        norm = self.grad_norm()
        if not self.sharded:
            for p in self.params:
                p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        self.optimizer.step()
        if not self.sharded:
            for p in self.params:
                p.grad = None
        self.num_steps += 1
        return True, norm, None

    def zero_grad(self) -> None:
        self.chunk.zero_grad_buffer()


def _on_every_worker(what: str, build):
    """``build()``, with its failure on any worker raised on every worker (the others name the failed ranks)."""
    try:
        result, failure = build(), None
    except Exception as error:  # noqa: BLE001 - re-raised below, after every worker learnt of it
        result, failure = None, error
    world, rank = dist.get_world_size(), dist.get_rank()
    failed = torch.zeros(world, dtype=torch.int32, device=topology.device())
    failed[rank] = failure is not None
    dist.all_reduce(failed)
    if failure is not None:
        raise RuntimeError(f"the {what} raised {type(failure).__name__}: {failure}") from failure
    ranks = [r for r in range(world) if failed[r]]
    if ranks:
        raise RuntimeError(f"the {what} failed on worker{'s' if len(ranks) > 1 else ''} "
                           f"{', '.join(map(str, ranks))}")
    return result


def _call_model_factory(factory) -> nn.Module:
    module = factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"it returned {type(module).__name__}, not a torch.nn.Module")
    return module


def build_user_model(spec, topo: topology.Topology, device: torch.device):
    """``(chunk, optimizer)`` for ``spec.model`` (a factory) wrapped by ``spec.strategy`` on every worker."""
    torch.manual_seed(spec.seed)
    module = _on_every_worker("model factory", lambda: _call_model_factory(spec.model))
    module.to(device)
    chunk = _on_every_worker(f"{spec.strategy} wrapper", lambda: WRAPPERS[spec.strategy](module, topo))
    if isinstance(spec.optimizer, OptimizerConfig):
        return chunk, get_optimizer(spec.optimizer, [chunk])
    return chunk, _on_every_worker("optimizer factory", lambda: TorchOptimizer(spec.optimizer, chunk))


def tensor_shapes(chunk) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor the checkpoint holds for ``chunk`` (a model without a GPTConfig)."""
    return {name: tuple(tensor.shape) for name, tensor in chunk.module.state_dict(keep_vars=True).items()}
