"""A toy stack of Linear+tanh layers split into pipeline chunks, with its single-rank reference."""

import time

import torch
from torch import nn

from megalite.tensor_parallel.weight_grad import current_weight_grad_store

HIDDEN = 8


def full_stack(num_layers, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(num_layers))


class Chunk(nn.Module):
    """Layers ``[start, end)`` of the stack; takes [s, b, h] activations, from the data or upstream."""

    def __init__(self, layers, start, end, sleep_s=0.0):
        super().__init__()
        self.layers = nn.ModuleList(layers[start:end])
        self.start = start
        self.sleep_s = sleep_s
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x=None):
        h = x if x is not None else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if self.sleep_s:
            h = _Sleep.apply(h, self.sleep_s)
        return h


class _Sleep(torch.autograd.Function):
    """Identity that costs a fixed time in forward and in backward (twice as long, like real layers).

    Under a split backward (a weight-grad store is active) half of the backward's time is
    the deferred W pass, so F, B and W cost the same.
    """

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        store = current_weight_grad_store()
        seconds = ctx.seconds
        if store is None:
            time.sleep(2 * seconds)
        else:
            time.sleep(seconds)
            store.push(lambda: time.sleep(seconds))
        return grad, None


def microbatches(m, seq=3, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(seq, batch, HIDDEN, generator=g), "y": torch.randn(seq, batch, HIDDEN, generator=g)}
            for _ in range(m)]


def make_forward_step(first_chunk, last_chunk):
    """forward_step_func for chunks; ``first_chunk``/``last_chunk`` pick which chunk reads x / y."""

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        output = chunk(batch["x"] if chunk is first_chunk else None)

        def loss_func(out):
            loss = ((out - batch["y"]) ** 2).mean()
            return loss, {"loss": loss.detach().clone(), "output": out.detach().clone()}

        return output, (loss_func if chunk is last_chunk else None)

    return forward_step


def reference(num_layers, batches, seed=0):
    """Per-micro-batch losses, outputs and accumulated grads of the whole stack on one rank."""
    layers = full_stack(num_layers, seed)
    losses, outputs = [], []
    for batch in batches:
        h = batch["x"]
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = ((h - batch["y"]) ** 2).mean()
        (loss / len(batches)).backward()
        losses.append(loss.item())
        outputs.append(h.detach())
    grads = {i: (l.weight.grad.clone(), l.bias.grad.clone()) for i, l in enumerate(layers)}
    return losses, outputs, grads
