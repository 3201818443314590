"""TrainingService workers for a user's own ``nn.Module``: ``strategy="fsdp2"`` or ``"ddp"`` over every worker.

The model comes from a zero-argument factory that every worker calls after ``torch.manual_seed(seed)``, so all
workers start from the weights one process seeded alike would build.  ``"fsdp2"`` wraps it in megalite's
:class:`~megalite.distributed.FullyShardedDataParallel` (torch's ``fully_shard`` over the data-parallel group:
parameters, gradients and optimizer state sharded), ``"ddp"`` in megalite's
:class:`~megalite.distributed.DistributedDataParallel`; either way the same :class:`~megalite.rlhf.backend
.TrainingBackend` splits micro-batches, normalizes the objective over the global batch and accumulates gradients.

The optimizer is megalite's (an ``OptimizerConfig``: its state goes into checkpoints) or a factory
``params -> torch.optim.Optimizer`` that :class:`TorchOptimizer` drives.  A factory that raises on any worker
fails ``ready`` on every worker at once (the others name the failed ranks) rather than leaving them waiting for
it in a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel, FSDPConfig, FullyShardedDataParallel
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
