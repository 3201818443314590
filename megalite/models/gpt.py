"""Decoder-only GPT built from megalite's tensor-parallel layers.

``GPTModel`` is one pipeline chunk: the embedding when ``pre_process``, the
transformer layers ``layer_range``, and the final norm and output layer when
``post_process``.  Activations are ``[s, b, h]`` inside (``[s/tp, b, h]``
between the embedding and the output layer under sequence parallelism).

Parameter names (HF-convertible)::

    embedding.word_embeddings.weight              [v_pad/tp, h]  (vocab rows, TP-split)
    embedding.position_embeddings.weight          [max_pos, h]   (learned_absolute only)
    decoder.layers.{i}.input_layernorm.{weight,bias}
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}   grouped QKV layout, see attention.py
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight      [head_dim]  (qk_layernorm only)
    decoder.layers.{i}.self_attention.linear_proj.{weight,bias}
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}              [gate_i; up_i] for SwiGLU, see mlp.py
    decoder.layers.{i}.mlp.linear_fc2.{weight,bias}
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                            [v_pad/tp, h]  (untied, or tied on a separate last stage)

``{i}`` is the global layer index.  The vocabulary is padded to a multiple of
``make_vocab_size_divisible_by * tp``; padding rows are zero and padding
logits are masked, so neither changes the function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from megalite import topology
from megalite.context_parallel import check_comm_type, check_context_parallel, chunk_indices
from megalite.models.attention import AttentionCache, padding_causal_mask
from megalite.models.embedding import GPTEmbedding
from megalite.models.init import EMBEDDING_STREAM, OUTPUT_LAYER_STREAM, init_stream, vocab_init
from megalite.models.mla import check_mla_config, mla_flops_per_token
from megalite.models.rotary import RotaryEmbedding
from megalite.models.transformer_block import TransformerBlock
from megalite.tensor_parallel import (ColumnParallelLinear, column_parallel_linear,
                                      gather_from_sequence_parallel_region, pad_vocab_size,
                                      vocab_parallel_cross_entropy)

if TYPE_CHECKING:
    from megalite.moe import MoEConfig

PADDING_LOGIT = -1.0e4
"""Logit given to padding vocabulary ids: exp() of it underflows to exactly 0, yet it stays finite."""

_CHOICES = {
    "position_embedding_type": ("learned_absolute", "rope"),
    "rope_scaling": (None, "linear", "llama3", "yarn"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "activation": ("gelu", "gelu_tanh", "swiglu"),
    "recompute_granularity": (None, "full", "selective"),
    "recompute_method": (None, "uniform", "block"),
}


@dataclass
class GPTConfig:
    """Architecture of a GPT model (parallel layout and training options live elsewhere).

    ``ffn_hidden_size`` defaults to ``4h`` (GELU) or Megatron's SwiGLU size
    ``int(8h/3 / 64) * 64``; ``num_query_groups`` defaults to the number of
    heads (plain multi-head attention) and ``kv_channels`` (the head dimension,
    free to differ from it) to ``hidden_size / num_attention_heads``.  RoPE
    rotates the first ``rotary_percent`` of each head's channels, as halves
    (rotate-half) or as neighbouring pairs (``rotary_interleaved``);
    ``rope_scaling`` stretches its frequencies for long context ("linear",
    Llama 3's "llama3", "yarn"; :mod:`megalite.models.rotary` says what each
    ``rope_*``/``yarn_*`` field means; ``yarn_mscale``/``yarn_mscale_all_dim`` are DeepSeek's and
    Megatron's ``mscale``/``mscale_all_dim``).  ``add_qkv_bias`` gives the QKV
    projection a bias when the other linear layers have none (Qwen2);
    ``qk_layernorm`` normalizes each query and key head before the rotation
    (Qwen3).  Full recompute uses
    ``recompute_method`` ("uniform" or "block", default uniform) over
    ``recompute_num_layers`` layers (default 1).  ``moe_layer_freq`` is an int ``k``
    (layers ``0, k, 2k, ...`` are MoE) or a per-layer list of 0/1.  ``seed``
    fixes the initial weights under every parallel layout.  ``window_size``
    (Megatron's ``--window-size`` left size) limits attention to a sliding
    window: each token sees itself and the ``window_size`` tokens before it
    (Hugging Face's ``sliding_window`` is ``window_size + 1``); None: full causal.
    """

    vocab_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    max_position_embeddings: int = 1024
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rope_scaling: str | None = None
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float | None = None
    yarn_truncate: bool = True
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    normalization: str = "LayerNorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"
    add_bias_linear: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    moe: MoEConfig | None = None
    moe_layer_freq: int | list[int] = 1
    window_size: int | None = None
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    seed: int = 1234

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            if self.activation == "swiglu":
                self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.num_attention_heads and self.hidden_size % self.num_attention_heads == 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (MLA: its decoupled rotary part)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` uses the MoE MLP."""
        if self.moe is None:
            return False
        if isinstance(self.moe_layer_freq, int):
            return layer_number % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer_number])

    def validate(self, tp_size: int = 1) -> None:
        """Raise ValueError naming the numbers if this config cannot run with ``tp_size``."""
        h, heads, groups, ffn = self.hidden_size, self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size
        if self.kv_channels is None and isinstance(h, int) and isinstance(heads, int) and heads > 0 and h % heads:
            raise ValueError(f"hidden_size={h} is not divisible by num_attention_heads={heads}; set kv_channels "
                             "(the head dimension) explicitly")
        for name in ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "num_query_groups", "kv_channels", "max_position_embeddings", "make_vocab_size_divisible_by",
                     "rope_original_max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {tp_size!r}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.multi_latent_attention:
            check_mla_config(self)
        if heads % groups:
            raise ValueError(f"num_attention_heads={heads} is not divisible by num_query_groups={groups}")
        if heads % tp_size:
            raise ValueError(f"num_attention_heads={heads} is not divisible by the tensor-parallel size {tp_size}")
        if groups % tp_size:
            raise ValueError(f"num_query_groups={groups} is not divisible by the tensor-parallel size {tp_size}")
        if ffn % tp_size:
            raise ValueError(f"ffn_hidden_size={ffn} is not divisible by the tensor-parallel size {tp_size}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"GPTConfig.rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope" and (self.rotary_dim % 2 or self.rotary_dim == 0):
            raise ValueError(f"rope needs an even, positive number of rotated channels, got kv_channels "
                             f"{self.kv_channels} * rotary_percent {self.rotary_percent} = {self.rotary_dim}")
        self._validate_rope_scaling()
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ValueError(f"GPTConfig.recompute_method={self.recompute_method!r} needs recompute_granularity "
                             f"'full', got {self.recompute_granularity!r}")
        if self.recompute_num_layers is not None and (self.recompute_granularity != "full"
                                                      or self.recompute_num_layers < 1):
            raise ValueError(f"GPTConfig.recompute_num_layers={self.recompute_num_layers} needs a positive value "
                             f"and recompute_granularity 'full', got {self.recompute_granularity!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.norm_eps <= 0:
            raise ValueError(f"GPTConfig.norm_eps must be positive, got {self.norm_eps}")
        if self.init_method_std <= 0:
            raise ValueError(f"GPTConfig.init_method_std must be positive, got {self.init_method_std}")
        window = self.window_size
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
            raise ValueError(f"GPTConfig.window_size must be a non-negative integer or None, got {window!r}")
        self._validate_moe_layers()

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling is not None and self.position_embedding_type != "rope":
            raise ValueError(f"GPTConfig.rope_scaling={self.rope_scaling!r} needs position_embedding_type 'rope'")
        if self.rope_scaling is not None and not self.rope_scaling_factor >= 1.0:
            raise ValueError(f"GPTConfig.rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(f"GPTConfig.rope_low_freq_factor={self.rope_low_freq_factor} and rope_high_freq_factor="
                             f"{self.rope_high_freq_factor} must satisfy 0 < low < high")
        if self.rope_scaling == "yarn" and not 0 < self.yarn_beta_slow <= self.yarn_beta_fast:
            raise ValueError(f"GPTConfig.yarn_beta_slow={self.yarn_beta_slow} and yarn_beta_fast={self.yarn_beta_fast}"
                             " must satisfy 0 < slow <= fast")
        if self.yarn_attention_factor is not None and not self.yarn_attention_factor > 0:
            raise ValueError(f"GPTConfig.yarn_attention_factor must be positive, got {self.yarn_attention_factor}")

    def _validate_moe_layers(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            if freq < 1:
                raise ValueError(f"GPTConfig.moe_layer_freq must be >= 1, got {freq}")
        elif len(freq) != self.num_layers or any(f not in (0, 1) for f in freq):
            raise ValueError(f"GPTConfig.moe_layer_freq as a list needs num_layers={self.num_layers} entries of "
                             f"0/1, got {list(freq)}")


def gpt_flops_per_token(config: GPTConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6N plus attention.

    N counts the matmul weights a token passes through (QKV, projection, MLP or
    its top-k experts, router and shared expert, output layer over the real vocabulary); the
    attention term is ``12 * layers * heads * d * seq_length`` (QK^T and AV,
    without a causal discount, as in PaLM's MFU).
    """
    h, d = config.hidden_size, config.kv_channels
    heads, groups = config.num_attention_heads, config.num_query_groups
    attention = 2 * h * (heads + 2 * groups) * d + 2 * heads * d * h + 4 * seq_length * heads * d
    if config.multi_latent_attention:
        attention = mla_flops_per_token(config, seq_length)
    forward = 2.0 * h * config.vocab_size
    for layer in range(config.num_layers):
        forward += attention
        if config.is_moe_layer(layer):
            moe = config.moe
            matrices = 3 if moe.activation == "swiglu" else 2
            forward += moe.topk * 2 * h * moe.ffn_hidden_size * matrices + 2 * h * moe.num_experts
            if moe.shared_expert_intermediate_size is not None:
                forward += 2 * h * moe.shared_expert_intermediate_size * matrices + 2 * h * moe.shared_expert_gate
        else:
            forward += 2 * h * config.ffn_hidden_size * (3 if config.activation == "swiglu" else 2)
    return 3.0 * forward


class GPTModel(nn.Module):
    """One pipeline chunk of a GPT model (the whole model with the defaults).

    ``forward(input_ids, labels, position_ids, kv_cache, attention_mask,
    return_hidden)`` takes ``[b, s]`` ids.  A chunk without ``pre_process``
    reads its input from :meth:`set_input_tensor`; a chunk without
    ``post_process`` returns the hidden states ``[s, b, h]`` (``[s/tp, b, h]``
    under sequence parallelism).  The last chunk returns the per-token loss
    ``[b, s]`` (fp32) with ``labels``, the final-norm hidden states
    ``[b, s, h]`` with ``return_hidden=True`` (e.g. for a value head), else the
    logits ``[b, s, v_pad/tp]`` (exactly ``[b, s, vocab_size]`` at tp=1;
    padding columns masked at tp>1).

    Padded batches: ``attention_mask [b, offset + s]`` (1 = real token,
    0 = padding; ``offset`` tokens already in ``kv_cache`` come first) is
    combined with the causal mask, and positions then default to each row's
    count of real tokens before it, so a left-padded row computes what the
    unpadded row would.  Without it attention is plain causal (packed data,
    the fast ``is_causal`` path).  ``position_ids [b, s]`` may differ per row
    for learned and rotary positions; every chunk of a pipeline needs the same
    ``attention_mask``/``position_ids``.

    Packed samples: ``document_ids [b, S]`` (the whole sequence's document
    index per token) stops attention at document boundaries.

    Context parallelism (``cp_group`` of ``cp`` ranks, ``cp_comm_type``):
    ``input_ids``, ``labels`` and ``position_ids`` hold this rank's tokens
    ``[b, S/cp]`` (chunks ``r`` and ``2cp-1-r`` of ``2cp``, see
    :func:`megalite.context_parallel.chunk_indices`), positions default to
    those tokens' global indices, and the loss comes back for them.  Padding
    masks and the KV cache (generation) need cp = 1.
    """

    def __init__(self, config: GPTConfig, *, pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, sequence_parallel: bool = False, tp_group=None,
                 ep_group=None, expert_tp_group=None, cp_group=None, cp_comm_type: str = "p2p"):
        super().__init__()
        self.tp_group = topology.resolve_group(tp_group, "tp")
        self.cp_group = topology.resolve_group(cp_group, "cp")
        self.cp_size = topology.group_size(self.cp_group)
        self.cp_rank = topology.group_rank(self.cp_group)
        check_comm_type(cp_comm_type)
        ep_group = topology.resolve_group(ep_group, "ep")
        expert_tp_group = topology.resolve_group(expert_tp_group, "expert_tp")
        self.tp_size = topology.group_size(self.tp_group)
        self.tp_rank = topology.group_rank(self.tp_group)
        config.validate(self.tp_size)
        start, end = (0, config.num_layers) if layer_range is None else layer_range
        if not 0 <= start <= end <= config.num_layers:
            raise ValueError(f"layer_range=({start}, {end}) must satisfy 0 <= start <= end <= "
                             f"num_layers={config.num_layers}")
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = (start, end)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, self.tp_size)
        self.input_tensor = None
        tied = not config.untie_embeddings_and_output_weights

        self.embedding = None
        if pre_process:
            with init_stream(config.seed, EMBEDDING_STREAM):
                self.embedding = GPTEmbedding(config, self.padded_vocab_size, tp_group=self.tp_group,
                                              sequence_parallel=self.sequence_parallel)
            if tied and not post_process:
                self.embedding.word_embeddings.weight.shared_embedding = True
        self.rotary = None
        if config.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(config)
        self.decoder = TransformerBlock(config, self.layer_range, post_process=post_process, tp_group=self.tp_group,
                                        ep_group=ep_group, expert_tp_group=expert_tp_group, cp_group=self.cp_group,
                                        cp_comm_type=cp_comm_type, sequence_parallel=self.sequence_parallel)
        # The output projection uses ``output_layer.weight`` (or the word
        # embedding when tied on one stage); at tp=1 only its real vocabulary
        # rows, so no logits are computed for padding ids.
        self.output_layer = None
        if post_process and not (tied and pre_process):
            # Untied: its own stream.  Tied across stages: the embedding's stream,
            # whose first draw is the word embedding, so both copies start equal.
            with init_stream(config.seed, EMBEDDING_STREAM if tied else OUTPUT_LAYER_STREAM):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, self.padded_vocab_size, bias=False, sequence_parallel=self.sequence_parallel,
                    tp_group=self.tp_group, init_method=vocab_init(config.init_method_std, config.vocab_size))
            if tied:
                self.output_layer.weight.shared_embedding = True

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The hidden states ``[s, b, h]`` this chunk receives from the previous pipeline stage."""
        self.input_tensor = tensor

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, kv_cache: AttentionCache | None = None,
                attention_mask: torch.Tensor | None = None, return_hidden: bool = False,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        offset = 0 if kv_cache is None else kv_cache.offset
        if self.pre_process:
            if input_ids is None or input_ids.dim() != 2:
                shape = None if input_ids is None else tuple(input_ids.shape)
                raise ValueError(f"GPTModel.forward needs input_ids of shape [b, s], got {shape}")
            b, seq = input_ids.shape
        else:
            if self.input_tensor is None:
                raise ValueError("GPTModel without pre_process needs set_input_tensor() before forward")
            b = self.input_tensor.shape[1]
            seq = self.input_tensor.shape[0] * (self.tp_size if self.sequence_parallel else 1)
        if labels is not None and return_hidden:
            raise ValueError("GPTModel.forward takes labels or return_hidden=True, not both")
        if self.cp_size > 1 and (kv_cache is not None or attention_mask is not None):
            raise ValueError(f"padding masks and the KV cache (generation) are not supported with context "
                             f"parallelism (cp={self.cp_size}); run them at cp=1")
        if document_ids is not None and (kv_cache is not None or attention_mask is not None):
            raise ValueError("document_ids (packed sequences) cannot be combined with attention_mask or a KV cache")
        if document_ids is not None and tuple(document_ids.shape) != (b, seq * self.cp_size):
            raise ValueError(f"document_ids must be [b, S] = [{b}, {seq * self.cp_size}] (the whole sequence), got "
                             f"{tuple(document_ids.shape)}")
        if self.cp_size > 1 and position_ids is None:
            check_context_parallel(seq * self.cp_size, self.cp_size)
            device = input_ids.device if self.pre_process else self.input_tensor.device
            position_ids = chunk_indices(seq * self.cp_size, self.cp_size, self.cp_rank, device=device).expand(b, seq)
        explicit_positions = position_ids is not None
        if explicit_positions and tuple(position_ids.shape) != (b, seq):
            raise ValueError(f"position_ids must be [b, s] = [{b}, {seq}], got {tuple(position_ids.shape)}")
        mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (b, offset + seq):
                raise ValueError(f"attention_mask must be [b, offset + s] = [{b}, {offset + seq}] ({offset} cached "
                                 f"tokens), got {tuple(attention_mask.shape)}")
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)[:, -seq:]
            mask = padding_causal_mask(attention_mask, seq, offset)
        if self.pre_process:
            if self.embedding.position_embeddings is not None:
                # a padding mask numbers the real tokens only: its positions, not the padded width, must fit
                self._check_positions(offset + seq, position_ids if explicit_positions or mask is not None else None)
            if position_ids is None:
                position_ids = torch.arange(offset, offset + seq, device=input_ids.device).expand(b, seq)
            hidden = self.embedding(input_ids, position_ids)
        else:
            hidden = self.input_tensor
        hidden = self.decoder(hidden, self._rotary(seq, offset, position_ids, hidden.device), kv_cache, mask,
                              document_ids)
        if kv_cache is not None:
            kv_cache.advance(seq)
        if not self.post_process:
            return hidden
        if return_hidden:
            if self.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(hidden, self.tp_group, tensor_parallel_output_grad=False)
            return hidden.transpose(0, 1)
        return self._head(hidden, labels)

    def _check_positions(self, total: int, position_ids: torch.Tensor | None) -> None:
        """Learned positions must index the table: ``0 .. total-1`` by default, else ``position_ids``'s range (given,
        or numbered from the padding mask)."""
        limit = self.config.max_position_embeddings
        if position_ids is None:
            if total > limit:
                raise ValueError(f"positions up to {total} exceed max_position_embeddings={limit}")
            return
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= limit:
            raise ValueError(f"position_ids range over [{low}, {high}], outside [0, {limit - 1}] "
                             f"(max_position_embeddings={limit})")

    def _rotary(self, seq: int, offset: int, position_ids: torch.Tensor | None, device):
        """cos/sin tables ``[s, d]`` for the default positions, else ``[s, b, d]`` per row."""
        if self.rotary is None:
            return None
        if position_ids is None:
            return self.rotary(torch.arange(offset, offset + seq, device=device))
        return self.rotary(position_ids.t())

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on final-norm hidden states: ``[s(/tp), b, h]`` -> logits ``[s, b, v_local]``.

        Public so an inference engine can project only the positions it samples from.
        """
        layer = self.embedding.word_embeddings if self.output_layer is None else self.output_layer
        weight = layer.weight
        if self.tp_size == 1:
            weight = weight[:self.config.vocab_size]
        logits = column_parallel_linear(hidden, weight, tp_group=self.tp_group,
                                        sequence_parallel=self.sequence_parallel)
        if self.tp_size > 1:
            logits = self._mask_padding(logits)
        return logits

    def _head(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Output layer and loss: ``[s(/tp), b, h]`` -> loss ``[b, s]`` or logits ``[b, s, v_local]``."""
        logits = self.output_logits(hidden)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), tp_group=self.tp_group)
        return loss.t().contiguous()

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of this rank's padding vocabulary ids to PADDING_LOGIT."""
        local = logits.shape[-1]
        first_padding = self.config.vocab_size - self.tp_rank * local
        if first_padding >= local:
            return logits
        padding = torch.arange(local, device=logits.device) >= first_padding
        return logits.masked_fill(padding, PADDING_LOGIT)
