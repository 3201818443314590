"""Activation recompute that replays the same dropout masks."""

from __future__ import annotations

import torch

from megalite.tensor_parallel.random import RNGStatesTracker, get_device_states, get_rng_tracker, set_device_states


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tracker, *args):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.device_states = get_device_states()
        ctx.tracker_states = tracker.get_states()
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_index))
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, saved in zip(ctx.tensor_index, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)
        now_device, now_tracker = get_device_states(), ctx.tracker.get_states()
        set_device_states(ctx.device_states)
        ctx.tracker.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*args)
        finally:
            set_device_states(now_device)
            ctx.tracker.set_states(now_tracker)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None) + input_grads


def recompute(fn, *args, tracker: RNGStatesTracker | None = None):
    """``fn(*args)`` without keeping its activations; backward recomputes them.

    The recompute restores the default RNG states (CPU, and CUDA when
    available) and the tracker's named states as they were at forward, so
    dropout draws the same masks in both passes.
    """
    return _Recompute.apply(fn, get_rng_tracker() if tracker is None else tracker, *args)
