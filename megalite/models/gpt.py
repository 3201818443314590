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
    mtp.layers.{k}.{enorm,hnorm,final_layernorm}.weight, mtp.layers.{k}.eh_proj.weight [h/tp, 2h],
    mtp.layers.{k}.transformer_layer.*             multi-token prediction depth k (see mtp.py)
    mtp.embedding.word_embeddings.weight           the word embedding's copy on a separate last stage with MTP

``{i}`` is the global layer index.  The vocabulary is padded to a multiple of
``make_vocab_size_divisible_by * tp``; padding rows are zero and padding
logits are masked, so neither changes the function.
"""

from __future__ import annotations


import torch
from torch import nn

from megalite import batch_invariant, topology
from megalite.context_parallel import check_comm_type, check_context_parallel, chunk_indices
from megalite.models.attention import AttentionCache, padding_causal_mask
from megalite.models.config import GPTConfig
from megalite.models.embedding import GPTEmbedding
from megalite.models.init import EMBEDDING_STREAM, OUTPUT_LAYER_STREAM, init_stream, vocab_init
from megalite.models.mtp import MultiTokenPrediction, check_mtp_layout
from megalite.models.rotary import RotaryEmbedding
from megalite.models.transformer_block import TransformerBlock
from megalite.tensor_parallel import (ColumnParallelLinear, column_parallel_linear,
                                      gather_from_sequence_parallel_region, pad_vocab_size,
                                      vocab_parallel_cross_entropy)

PADDING_LOGIT = -1.0e4
"""Logit given to padding vocabulary ids: exp() of it underflows to exactly 0, yet it stays finite."""

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

    Multi-token prediction (``config.mtp_num_layers``, on the last chunk): a
    training-mode forward with ``labels`` adds the MTP loss to the backward
    pass (:mod:`megalite.models.mtp`); ``loss_mask [b, s]`` (1 = a token in
    the loss) limits it as it limits the caller's loss.  The returned loss
    stays the main model's.

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
        mtp = bool(config.mtp_num_layers)
        if mtp and post_process:
            check_mtp_layout(config, pipelined=not pre_process)

        self.embedding = None
        if pre_process:
            self.embedding = self._build_embedding()
            if (tied or mtp) and not post_process:
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
        # Multi-token prediction on a separate last stage keeps a copy of the word embedding (Megatron's), which
        # is then also the tied output layer.
        mtp_embedding = self._build_embedding() if mtp and post_process and not pre_process else None
        if mtp_embedding is not None:
            mtp_embedding.word_embeddings.weight.shared_embedding = True
        self.output_layer = None
        if post_process and not (tied and (pre_process or mtp_embedding is not None)):
            # Untied: its own stream.  Tied across stages: the embedding's stream,
            # whose first draw is the word embedding, so both copies start equal.
            with init_stream(config.seed, EMBEDDING_STREAM if tied else OUTPUT_LAYER_STREAM):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, self.padded_vocab_size, bias=False, sequence_parallel=self.sequence_parallel,
                    tp_group=self.tp_group, init_method=vocab_init(config.init_method_std, config.vocab_size))
            if tied:
                self.output_layer.weight.shared_embedding = True
        self.mtp = None
        if mtp and post_process:
            self.mtp = MultiTokenPrediction(config, embedding=mtp_embedding, tp_group=self.tp_group, ep_group=ep_group,
                                            expert_tp_group=expert_tp_group, cp_group=self.cp_group,
                                            cp_comm_type=cp_comm_type, sequence_parallel=self.sequence_parallel)

    def _build_embedding(self) -> GPTEmbedding:
        """The word (and position) embedding, drawn in its own stream: every copy of it starts equal."""
        with init_stream(self.config.seed, EMBEDDING_STREAM):
            return GPTEmbedding(self.config, self.padded_vocab_size, tp_group=self.tp_group,
                                sequence_parallel=self.sequence_parallel)

    def _word_embeddings(self):
        """This chunk's word embedding: its own, or the multi-token prediction's copy on a separate last stage."""
        return (self.embedding if self.embedding is not None else self.mtp.embedding).word_embeddings

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The hidden states ``[s, b, h]`` this chunk receives from the previous pipeline stage."""
        self.input_tensor = tensor

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, kv_cache: AttentionCache | None = None,
                attention_mask: torch.Tensor | None = None, return_hidden: bool = False,
                document_ids: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        with batch_invariant.mode(self.config.batch_invariant):
            return self._forward(input_ids, labels, position_ids, kv_cache, attention_mask, return_hidden,
                                 document_ids, loss_mask)

    def _forward(self, input_ids, labels, position_ids, kv_cache, attention_mask, return_hidden, document_ids,
                 loss_mask):
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
        rotary = self._rotary(seq, offset, position_ids, hidden.device)
        hidden = self.decoder(hidden, rotary, kv_cache, mask, document_ids)
        if kv_cache is not None:
            kv_cache.advance(seq)
        if not self.post_process:
            return hidden
        if return_hidden:
            if self.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(hidden, self.tp_group, tensor_parallel_output_grad=False)
            return hidden.transpose(0, 1)
        if self.mtp is not None and labels is not None and self.training:
            hidden = self.mtp(hidden, input_ids, position_ids, labels,
                              embedding=self.embedding if self.embedding is not None else self.mtp.embedding,
                              output_logits=self.output_logits, loss_mask=loss_mask, rotary=rotary, mask=mask,
                              documents=document_ids)
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
        layer = self._word_embeddings() if self.output_layer is None else self.output_layer
        weight = layer.weight
        padding = weight.shape[0] - self.config.vocab_size
        if self.tp_size == 1 and padding:
            # split, not a slice: the gradient of the padding rows is then a small zero block beside the real
            # rows' (one cat), where a slice's backward zero-fills and copies the whole padded table
            weight = weight.split([self.config.vocab_size, padding])[0]
        with batch_invariant.mode(self.config.batch_invariant):
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
