"""The GPT architecture: :class:`GPTConfig` (every field that fixes a model's weights or function, with its
checks) and :func:`gpt_flops_per_token` (the model FLOPs the trainer's MFU and the planner count).

The parallel layout and training options live elsewhere (flags, topology); Megatron-LM's flag for each field is
in ``megalite/training/flags.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.models.mla import check_mla_config, mla_flops_per_token
from megalite.models.mtp import check_mtp_config

if TYPE_CHECKING:
    from megalite.moe import MoEConfig

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
    ``batch_invariant`` runs the forward with ``megalite.batch_invariant``'s ops: a token's logits have the same
    bits in any batch, padding or prefill/decode split (the rollout engine's log-probs equal the trainer's); the
    same function, slower.  Dense models with full causal attention only.
    ``mtp_num_layers`` adds DeepSeek-V3's multi-token prediction depths, whose mean loss times
    ``mtp_loss_scaling_factor`` joins the training loss (:mod:`megalite.models.mtp`).
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
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    seed: int = 1234
    batch_invariant: bool = False

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
        """Whether global layer ``layer_number`` uses the MoE MLP.

        The multi-token prediction layers (numbers ``num_layers`` on) are of the last decoder layer's kind,
        as Megatron-Core builds them from the last layer's spec.
        """
        if self.moe is None:
            return False
        layer_number = min(layer_number, self.num_layers - 1)
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
        check_mtp_config(self)
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
        if self.batch_invariant and (self.moe is not None or self.multi_latent_attention or window is not None
                                     or self.attention_dropout):
            raise ValueError("GPTConfig.batch_invariant covers dense models with full causal attention: not with moe, "
                             "multi_latent_attention, window_size or attention_dropout")

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
    its top-k experts, router and shared expert, output layer over the real vocabulary; each
    multi-token prediction depth's projection, layer and output layer); the
    attention term is ``12 * layers * heads * d * seq_length`` (QK^T and AV,
    without a causal discount, as in PaLM's MFU).
    """
    h, d = config.hidden_size, config.kv_channels
    heads, groups = config.num_attention_heads, config.num_query_groups
    attention = 2 * h * (heads + 2 * groups) * d + 2 * heads * d * h + 4 * seq_length * heads * d
    if config.multi_latent_attention:
        attention = mla_flops_per_token(config, seq_length)
    depths = config.mtp_num_layers or 0
    forward = 2.0 * h * config.vocab_size * (1 + depths) + depths * 2 * (2 * h) * h
    for layer in range(config.num_layers + depths):
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
