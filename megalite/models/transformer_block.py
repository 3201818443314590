"""Pre-norm transformer layers and the decoder stack of one pipeline chunk."""

from __future__ import annotations

import torch
from torch import nn

from megalite import kernels
from megalite.models.attention import AttentionCache, SelfAttention
from megalite.models.init import init_stream, layer_stream
from megalite.models.mla import MultiLatentAttention
from megalite.models.mlp import MLP
from megalite.models.norms import build_norm
from megalite.tensor_parallel import get_rng_tracker, recompute


class TransformerLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``, each with dropout on the branch."""

    def __init__(self, config, layer_number: int, *, tp_group=None, ep_group=None, expert_tp_group=None,
                 cp_group=None, cp_comm_type: str = "p2p", sequence_parallel: bool = False):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sequence_parallel
        norm_args = (config.normalization, config.hidden_size, config.norm_eps)
        self.input_layernorm = build_norm(*norm_args, sequence_parallel=sequence_parallel)
        attention = MultiLatentAttention if config.multi_latent_attention else SelfAttention
        self.self_attention = attention(config, layer_number, tp_group=tp_group, cp_group=cp_group,
                                        cp_comm_type=cp_comm_type, sequence_parallel=sequence_parallel)
        self.pre_mlp_layernorm = build_norm(*norm_args, sequence_parallel=sequence_parallel)
        self.is_moe = config.is_moe_layer(layer_number)
        if self.is_moe:
            from megalite.moe import MoELayer

            shared = None
            if config.moe.shared_expert_intermediate_size is not None:
                shared = MLP(config, tp_group=tp_group, sequence_parallel=sequence_parallel,
                             ffn_hidden_size=config.moe.shared_expert_intermediate_size)
            self.mlp = MoELayer(config.hidden_size, config.moe, layer_number=layer_number, tp_group=tp_group,
                                ep_group=ep_group, expert_tp_group=expert_tp_group, cp_group=cp_group,
                                sequence_parallel=sequence_parallel, shared_experts=shared)
        else:
            self.mlp = MLP(config, tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: AttentionCache | None = None, mask: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        out, bias = self.self_attention(self.input_layernorm(x), rotary, kv_cache, mask, documents)
        x = self._bias_dropout_add(out, bias, x)
        normed = self.pre_mlp_layernorm(x)
        out, bias = (self.mlp(normed), None) if self.is_moe else self.mlp(normed)
        return self._bias_dropout_add(out, bias, x)

    def _bias_dropout_add(self, out, bias, residual):
        # Under sequence parallelism each TP rank holds different tokens, so the
        # masks come from the per-rank model-parallel RNG state; otherwise the
        # activations are replicated over TP and must share the default state.
        if self.training and self.hidden_dropout > 0.0 and self.sequence_parallel:
            with get_rng_tracker().fork():
                return kernels.bias_dropout_add(out, bias, residual, self.hidden_dropout, True)
        return kernels.bias_dropout_add(out, bias, residual, self.hidden_dropout, self.training)


def _run_layers(layers, x, rotary, mask, documents):
    for layer in layers:
        x = layer(x, rotary, None, mask, documents)
    return x


class TransformerBlock(nn.Module):
    """The transformer layers ``layer_range = (start, end)`` (global indices), plus the final norm.

    Full recompute (Megatron's methods): "uniform" recomputes groups of
    ``recompute_num_layers`` consecutive layers; "block" recomputes the first
    ``recompute_num_layers`` layers of this chunk and runs the rest normally.

    ``layers`` is keyed by the global layer index, so parameter names are the
    same whichever pipeline chunk holds a layer.  Layer ``i`` is built in the
    RNG stream of layer ``i``, so every chunking gives the same weights.
    """

    def __init__(self, config, layer_range: tuple[int, int], *, post_process: bool = True, tp_group=None,
                 ep_group=None, expert_tp_group=None, cp_group=None, cp_comm_type: str = "p2p",
                 sequence_parallel: bool = False):
        super().__init__()
        self.recompute_full = config.recompute_granularity == "full"
        self.recompute_method = config.recompute_method or "uniform"
        self.recompute_num_layers = config.recompute_num_layers or 1
        self.layers = nn.ModuleDict()
        for number in range(*layer_range):
            with init_stream(config.seed, layer_stream(number)):
                self.layers[str(number)] = TransformerLayer(
                    config, number, tp_group=tp_group, ep_group=ep_group, expert_tp_group=expert_tp_group,
                    cp_group=cp_group, cp_comm_type=cp_comm_type, sequence_parallel=sequence_parallel)
        if post_process:
            self.final_layernorm = build_norm(config.normalization, config.hidden_size, config.norm_eps,
                                              sequence_parallel=sequence_parallel)
        else:
            self.final_layernorm = None

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: AttentionCache | None = None, mask: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: an optional boolean attention mask ``[b, 1, s, t]`` shared by every layer;
        ``documents [b, s]``: document ids of the whole sequence for packed samples."""
        layers = list(self.layers.values())
        if not (self.recompute_full and self.training and kv_cache is None):
            for layer in layers:
                x = layer(x, rotary, kv_cache, mask, documents)
        elif self.recompute_method == "uniform":
            n = self.recompute_num_layers
            for start in range(0, len(layers), n):
                x = recompute(_run_layers, layers[start:start + n], x, rotary, mask, documents)
        else:
            for index, layer in enumerate(layers):
                x = recompute(layer, x, rotary, None, mask, documents) if index < self.recompute_num_layers \
                    else layer(x, rotary, None, mask, documents)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
