"""The critic: a GPT whose last stage ends in a scalar value head instead of the output layer."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel
from megalite.pipeline import broadcast_from_last_stage, forward_backward
from megalite.topology import resolve_group

VALUE_HEAD_STREAM = 7_000_001
"""Offset added to the config seed for the value head's initial weights."""


class CriticModel(GPTModel):
    """One pipeline chunk of a GPT critic (or reward model); the last chunk returns values ``[b, s]`` (fp32).

    A GPTModel whose output layer is replaced by a value head ``Linear(h, 1)``, so
    parameter names, and therefore checkpoints, follow the GPT's.  The embeddings
    are untied (there is no output layer to tie them to), and the value head is
    replicated over TP and initialized from the config seed, so every layout
    starts from the same critic.
    """

    def __init__(self, config: GPTConfig, *, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, sequence_parallel: bool = False, tp_group=None):
        config = dataclasses.replace(config, untie_embeddings_and_output_weights=True)
        super().__init__(config, pre_process=pre_process, post_process=post_process, layer_range=layer_range,
                         sequence_parallel=sequence_parallel, tp_group=tp_group)
        self.output_layer = None
        self.value_head = None
        if post_process:
            generator = torch.Generator().manual_seed(config.seed + VALUE_HEAD_STREAM)
            weight = torch.randn(1, config.hidden_size, generator=generator) * config.init_method_std
            self.value_head = nn.Linear(config.hidden_size, 1)
            with torch.no_grad():
                self.value_head.weight.copy_(weight)
                self.value_head.bias.zero_()

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values ``[b, s]`` on the last chunk, hidden states ``[s, b, h]`` on the others."""
        if self.value_head is None:
            return super().forward(input_ids, attention_mask=attention_mask)
        hidden = super().forward(input_ids, attention_mask=attention_mask, return_hidden=True)
        return self.value_head(hidden).squeeze(-1).float()


def pipeline_values(chunk, micro_batches: list[dict], pp_group=None) -> torch.Tensor:
    """Forward-only critic values ``[B, s]`` over micro-batches (``input_ids``/``attention_mask``), on every stage.

    ``chunk`` is this rank's model chunk, or its list of chunks under an interleaved pipeline."""
    if not micro_batches:
        raise ValueError("pipeline_values needs at least one micro-batch, got 0")

    def forward_step(iterator, model):
        mb = next(iterator)
        return model(mb["input_ids"], mb["attention_mask"]), lambda values: (values.sum() * 0.0, {"values": values})

    pp_group = resolve_group(pp_group, "pp")
    with torch.no_grad():
        iterators = [iter(micro_batches) for _ in chunk] if isinstance(chunk, (list, tuple)) else iter(micro_batches)
        results = forward_backward(forward_step, iterators, chunk, len(micro_batches), forward_only=True,
                                   pp_group=pp_group)
    return torch.cat(broadcast_from_last_stage([r["values"].cpu() for r in results], pp_group))
