"""Low-rank adapters attached from outside to a model's column- and row-parallel layers.

The model stays plain: :func:`apply_lora` registers a forward hook on each target layer that adds
``scaling * B(A(dropout(x)))`` to the layer's output, and the adapters live in a separate
:class:`LoRAModel`, so the model's own parameters and state dict are unchanged.

TP layout, with each adapter matching its base layer's split so no extra weight is gathered:

- column-parallel layer (weight ``[out/tp, in]``, input replicated): A ``[r, in]`` replicated and
  B ``[out/tp, r]`` split by rows like the weight (the SwiGLU fc1's ``[gate_i; up_i]`` rows too).
  ``x A^T`` is the same on every rank; its gradient, partial per rank, is all-reduced over TP, so
  A's gradient is whole everywhere.  Under sequence parallelism the input is all-gathered first.
- row-parallel layer (weight ``[out, in/tp]``, input split): A ``[r, in/tp]`` split by columns and
  B ``[out, r]`` replicated.  ``x A^T`` is all-reduced over TP (r values per token), then B runs
  replicated; under sequence parallelism its output is split along the sequence afterwards.

Adapters stay fp32 whatever the base dtype: the input is cast up and the update cast back.  Their matmuls are
the base layers' (batch-invariant under ``GPTConfig.batch_invariant``), so a batch-invariant model with adapters
gives the rollout engine's log-probs bit for bit too.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from megalite.distributed.unwrap import unwrap
from megalite.lora.config import LoRAConfig
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_rng_tracker, mappings
from megalite.tensor_parallel.initialization import mark_tensor_parallel
from megalite.tensor_parallel.layers import forward_linear


def _init_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The whole ``[rank, in]`` A of module ``name``: PEFT's kaiming-uniform, seeded by seed and name."""
    master = torch.empty(rank, in_features)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    nn.init.kaiming_uniform_(master, a=math.sqrt(5), generator=generator)
    return master


class LoRAAdapter(nn.Module):
    """The A and B of one base layer (see the module docstring for their TP split)."""

    def __init__(self, name: str, base: nn.Module, config: LoRAConfig):
        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        if not self.column and not isinstance(base, RowParallelLinear):
            raise ValueError(f"{name} is a {type(base).__name__}, not a column- or row-parallel linear layer")
        config.check_rank(name, base.out_features, base.in_features)
        self.tp_group, self.tp_size, self.tp_rank = base.tp_group, base.tp_size, base.tp_rank
        self.sequence_parallel = base.sequence_parallel
        self.scaling = config.scaling
        self.dropout = config.dropout
        self.enabled = True
        """False inside :func:`adapters_disabled`: the hook leaves the base layer's output as it is."""
        device = base.weight.device
        master = _init_a(name, config.rank, base.in_features, config.seed)
        if self.column:
            self.lora_A = nn.Parameter(master.to(device))
            self.lora_B = mark_tensor_parallel(nn.Parameter(torch.zeros(base.output_size_per_partition, config.rank,
                                                                        device=device)), 0)
        else:
            self.lora_A = mark_tensor_parallel(nn.Parameter(
                master.chunk(self.tp_size, dim=1)[self.tp_rank].clone().to(device)), 1)
            self.lora_B = nn.Parameter(torch.zeros(base.out_features, config.rank, device=device))

    def _dropout(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        if not training or self.dropout == 0.0:
            return x
        if self.column or self.tp_size == 1:
            return F.dropout(x, self.dropout)  # a replicated input: the default stream, equal on every TP rank
        with get_rng_tracker().fork():
            return F.dropout(x, self.dropout)

    def update(self, x: torch.Tensor, training: bool = True) -> torch.Tensor:
        """``scaling * B A dropout(x)`` in fp32, laid out like the base layer's output.

        ``training``: whether dropout applies; the hook passes the base layer's mode, so
        ``model.eval()`` turns the adapters' dropout off as it does the model's.
        """
        x = self._dropout(x.to(self.lora_A.dtype), training)
        if self.column:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=False)
            low = mappings.copy_to_tensor_parallel_region(forward_linear(x, self.lora_A), self.tp_group)
            return forward_linear(low, self.lora_B) * self.scaling
        low = mappings.reduce_from_tensor_parallel_region(forward_linear(x, self.lora_A), self.tp_group)
        out = forward_linear(low, self.lora_B) * self.scaling
        if self.sequence_parallel:
            out = mappings.scatter_to_sequence_parallel_region(out, self.tp_group)
        return out

    def hook(self, module, args, output):
        """Forward hook of the base layer: its output (or ``(output, bias)``) plus the update."""
        if not self.enabled:
            return output
        if isinstance(output, tuple):
            main, bias = output
            return main + self.update(args[0], module.training).to(main.dtype), bias
        return output + self.update(args[0], module.training).to(output.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A``: this rank's shard of the update to the base weight."""
        return (self.lora_B @ self.lora_A) * self.scaling


class LoRAModel(nn.Module):
    """The adapters of a model's chunks (one module per pipeline chunk list), hooked into its layers.

    ``parameters()`` are the adapters only, so an optimizer built on them keeps state for adapters
    only.  Under data parallelism wrap it like a model chunk: ``DistributedDataParallel(lora)``
    reduces the adapters' gradients (its hooks fire whoever calls the model) and
    ``megalite.optim.get_optimizer(config, [ddp])`` steps them.  ``named_adapters()`` yields ``(module name, adapter)`` with the model's global module names.
    """

    def __init__(self, model_chunks, config: LoRAConfig):
        super().__init__()
        self.config = config
        self.model_chunks = [unwrap(chunk) for chunk in model_chunks]
        self.adapters = nn.ModuleDict()
        self._names: dict[str, str] = {}
        self._hooks = []
        for chunk in self.model_chunks:
            model_config = getattr(chunk, "config", None)
            if model_config is not None and getattr(model_config, "moe", None) is not None:
                raise ValueError("LoRA on MoE models is not supported (expert layers are not column/row-parallel "
                                 "linear layers)")
            for name, module in chunk.named_modules():
                if config.targets(name):
                    adapter = LoRAAdapter(name, module, config)
                    key = name.replace(".", "__")
                    self.adapters[key] = adapter
                    self._names[key] = name
                    self._hooks.append(module.register_forward_hook(adapter.hook))

    def named_adapters(self):
        for key, adapter in self.adapters.items():
            yield self._names[key], adapter

    def remove_hooks(self) -> None:
        """Detach the adapters from the model (the model computes its base output again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @torch.no_grad()
    def merge(self):
        """Add every adapter's ``scaling * B @ A`` into its base weight and detach the adapters.

        Returns the model chunks, now plain models whose output equals the adapted one's.  Merging
        twice would add the update twice: ValueError.
        """
        if not self._hooks:
            raise ValueError("these adapters are already merged (or detached) from the model")
        modules = {name: module for chunk in self.model_chunks for name, module in chunk.named_modules()}
        for name, adapter in self.named_adapters():
            weight = modules[name].weight
            weight.add_(adapter.delta_weight().to(weight.dtype))
        self.remove_hooks()
        return self.model_chunks


def _hooked_adapters(model) -> list[LoRAAdapter]:
    """The adapters :func:`apply_lora` hooked onto ``model``'s layers (a data-parallel wrapper is looked through)."""
    return [hook.__self__ for module in unwrap(model).modules() for hook in module._forward_hooks.values()
            if isinstance(getattr(hook, "__self__", None), LoRAAdapter)]


@contextmanager
def adapters_disabled(model):
    """Inside the block ``model`` computes its base model's output: every adapter hooked onto it adds nothing
    (PEFT's ``disable_adapter()``).  A LoRA run's frozen base serves as the DPO reference this way, with no
    second copy of the weights.  Raises ValueError when no adapter is hooked onto ``model``."""
    adapters = _hooked_adapters(model)
    if not adapters:
        raise ValueError("no LoRA adapter is hooked onto this model")
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield model
    finally:
        for adapter in adapters:
            adapter.enabled = True


def apply_lora(model_chunks, config: LoRAConfig, *, base_dtype: torch.dtype | None = None) -> LoRAModel:
    """Freeze the chunks' own parameters (cast to ``base_dtype`` if given) and attach fp32 adapters.

    ``model_chunks``: one model or this rank's list of pipeline chunks, before any data-parallel
    wrapping.  A target name that matches no layer fails in :class:`LoRAConfig` (naming the available
    ones); a rank larger than a layer, or an MoE model, raises ValueError here.
    """
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        unwrap(chunk).requires_grad_(False)
        if base_dtype is not None:
            unwrap(chunk).to(base_dtype)
    return LoRAModel(chunks, config)
