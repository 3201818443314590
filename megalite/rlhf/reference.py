"""The reference policy: a frozen copy of the initial actor, optionally parked in CPU memory.

With ``offload=True`` the weights live in a host pool (pinned, when CUDA is
available) and are copied to the device asynchronously only for the duration
of a forward (:class:`~megalite.rlhf.offload.Offloader`), so the reference
model costs no device memory between uses.  A :class:`~megalite.rlhf.placement.Placement`
can manage ``self.module`` instead, per RL phase.  A LoRA policy's reference is its own frozen base
(:class:`LoRABaseReference`, :func:`lora_base`): no copy.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from megalite.distributed.unwrap import unwrap
from megalite.lora import adapters_disabled
from megalite.rlhf.actor import sequence_log_probs
from megalite.rlhf.offload import Offloader, module_tensors


class ReferenceModel(nn.Module):
    """Frozen, eval-mode ``model`` (a freshly built GPTModel chunk of the actor's shape).

    With ``source`` (the actor chunk, optionally DDP-wrapped) its current
    weights are copied in; building a fresh chunk instead of deep-copying the
    actor keeps the actor's DDP hooks and process groups out of the copy.
    """

    def __init__(self, model: nn.Module, source: nn.Module | None = None, offload: bool = False):
        super().__init__()
        self.module = unwrap(model).eval()
        if source is not None:
            self.module.load_state_dict(unwrap(source).state_dict())
        self.module.requires_grad_(False)
        self.offloader = None
        if offload:
            device = next(self.module.parameters()).device
            self.offloader = Offloader(module_tensors(self.module), device, writeback=False)
            self.offloader.offload()

    @contextmanager
    def on_device(self):
        """Inside the block the weights are on the device; afterwards the device copies are dropped."""
        if self.offloader is None:
            yield self.module
            return
        with self.offloader.on_device():
            yield self.module

    @torch.no_grad()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                  chunk_size: int | None = None) -> torch.Tensor:
        """Reference log-probs ``[b, s-1]`` of ``input_ids[:, 1:]`` (a whole, unpipelined model).

        Pipelined chunks go through ``with ref.on_device() as chunk: pipeline_log_probs(chunk, ...)``.
        """
        with self.on_device() as module:
            return sequence_log_probs(module, input_ids, attention_mask, temperature, chunk_size)[0]


@contextmanager
def lora_base(model):
    """Inside the block ``model`` (a LoRA policy, optionally DDP-wrapped) is its frozen base: its adapters disabled
    and in eval mode (its mode is restored afterwards).  Yields the unwrapped model."""
    module = unwrap(model)
    training = module.training
    module.eval()
    try:
        with adapters_disabled(module):
            yield module
    finally:
        module.train(training)


class LoRABaseReference:
    """The reference of a LoRA policy: the policy's own frozen base (:func:`lora_base`), as TRL does with PEFT, so
    no second copy of the weights exists.  ``module`` is the policy's chunk, which the placement plan manages as
    the actor's; :meth:`on_device` is :class:`ReferenceModel`'s interface."""

    def __init__(self, model: nn.Module):
        self.module = unwrap(model)

    def on_device(self):
        return lora_base(self.module)
