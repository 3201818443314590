"""Data-parallel wrapper: bucketed, overlapped gradient averaging over the DP group."""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn

from megalite.distributed.config import DDPConfig
from megalite.distributed.grad_buffer import GradBuffer
from megalite.topology import group_size, resolve_group


def _weakly(method):
    """A hook that calls ``method`` while its object lives, without keeping it alive.

    A parameter's hook that holds the wrapper makes a cycle through the tensor's C++ side, which
    Python's garbage collector cannot see: the wrapper, the model and every gradient buffer would
    stay allocated after the user drops them (on a GPU, device memory held until the process ends).
    """
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so its gradients are averaged over the data-parallel group.

    Every trainable parameter gets ``param.main_grad``, a view into a contiguous buffer (fp32 when
    ``config.grad_reduce_in_fp32``) laid out in backward order.  A post-accumulate-grad hook moves
    each autograd gradient into ``main_grad`` and frees ``param.grad``; with
    ``overlap_grad_reduce`` a bucket starts its asynchronous reduction as soon as all of its
    gradients have arrived in the last micro-batch (under a split backward, when the last weight
    gradient ran).  Parameters marked ``expert_parallel`` reduce
    over ``expert_dp_group`` instead of ``dp_group``.  Both are scaled by 1/DP size, so the result
    is the mean of per-rank losses.
    """

    def __init__(self, module: nn.Module, config: DDPConfig | None = None, dp_group=None, expert_dp_group=None):
        super().__init__()
        self.module = module
        self.config = config or DDPConfig()
        self.dp_group = resolve_group(dp_group, "dp")
        self.expert_dp_group = resolve_group(expert_dp_group, "expert_dp")
        scale = 1.0 / group_size(self.dp_group)
        self.is_last_microbatch = True

        backward_order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        groups: dict[tuple, list] = {}
        for p in backward_order:
            groups.setdefault((p.dtype, bool(getattr(p, "expert_parallel", False))), []).append(p)
        self.buffers: list[GradBuffer] = []
        self._buffer_of: dict = {}
        grad_hook = _weakly(self._grad_hook)
        for (dtype, expert), params in groups.items():
            grad_dtype = torch.float32 if self.config.grad_reduce_in_fp32 else dtype
            group = self.expert_dp_group if expert else self.dp_group
            buffer = GradBuffer(params, grad_dtype, group, scale, self.config.bucket_size,
                                shard=self.config.use_distributed_optimizer,
                                shard_collectives=self.config.shard_collectives)
            self.buffers.append(buffer)
            for p in params:
                self._buffer_of[p] = buffer
                p.register_post_accumulate_grad_hook(grad_hook)
        if self.config.use_distributed_optimizer:
            for sub in module.modules():
                if any(True for _ in sub.parameters(recurse=False)):
                    sub.register_forward_pre_hook(self._wait_params_hook)

    def _grad_hook(self, param: nn.Parameter) -> None:
        # A call without a gradient (a weight gradient deferred by a split backward, to arrive
        # later) does not mark the parameter ready; finish_grad_sync launches what is left.
        if param.grad is None:
            return
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.config.overlap_grad_reduce and self.is_last_microbatch:
            self._buffer_of[param].mark_ready(param)

    def _wait_params_hook(self, sub: nn.Module, args) -> None:
        for p in sub.parameters(recurse=False):
            buffer = self._buffer_of.get(p)
            if buffer is not None:
                buffer.wait_param_sync(buffer.bucket_of[p])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (every micro-batch but the last)."""
        previous = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    def finish_grad_sync(self) -> None:
        """Launch any bucket reductions not yet started and wait for all of them."""
        for buffer in self.buffers:
            buffer.finish_grad_sync()

    def grad_tensors(self) -> list[torch.Tensor]:
        """This rank's reduced gradients (the contiguous buffers), e.g. for finiteness checks."""
        return [buffer.grad_data for buffer in self.buffers]

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (and drop stray autograd grads) before the next iteration."""
        for buffer in self.buffers:
            buffer.grad_data.zero_()
            buffer.reset()
        for p in self._buffer_of:
            p.grad = None

    def scale_gradients(self, factor: float) -> None:
        """Multiply every accumulated gradient by ``factor``."""
        for buffer in self.buffers:
            buffer.grad_data.mul_(factor)

    def start_param_sync(self) -> None:
        """All-gather updated parameter shards (distributed optimizer), without waiting."""
        for buffer in self.buffers:
            buffer.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait until every parameter all-gather has landed."""
        for buffer in self.buffers:
            buffer.finish_param_sync()

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether the optimizer keeps only this rank's shard (ZeRO-1)."""
        return self.config.use_distributed_optimizer

    def owned_range(self, param) -> tuple[int, int] | None:
        """The part ``(lo, hi)`` of ``param.view(-1)`` this rank's optimizer updates, or None."""
        return self._buffer_of[param].local_range(param)

    def owned_values(self, param) -> torch.Tensor:
        """The elements of ``param`` in :meth:`owned_range`, as a flat tensor aliasing the parameter."""
        lo, hi = self.owned_range(param)
        return param.detach().view(-1)[lo:hi]

    def owned_grad(self, param) -> torch.Tensor:
        """The reduced gradient of the elements in :meth:`owned_range`."""
        lo, hi = self.owned_range(param)
        return param.main_grad.view(-1)[lo:hi]

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy ``state_dict`` into the wrapped module's parameters in place (keeping buffer views)."""
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict)
