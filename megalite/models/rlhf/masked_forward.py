"""A GPT chunk's forward pass over padded batches, composed from the model's own submodules.

``GPTModel.forward`` attends causally over every position, which is right for
packed pretraining data but lets real tokens attend to padding.  RLHF batches
are left-padded prompts followed by responses, so this forward adds a key
padding mask (``attention_mask [b, t]``, 1 = real token, covering cached and
new tokens) and per-row positions that start at each row's first real token.
With RoPE the positions stay shared: rotary scores depend only on relative
positions, so masking alone makes a padded row equal to the unpadded one.
Weights, parameter names and every layer's arithmetic are the model's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite import kernels
from megalite.models.gpt import GPTModel
from megalite.models.kv_cache import KVCache
from megalite.tensor_parallel import gather_from_sequence_parallel_region, get_rng_tracker


def unwrap(model) -> GPTModel:
    """The GPTModel inside a DDP (or similar ``.module``) wrapper."""
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise ValueError(f"expected a GPTModel (optionally wrapped), got {type(model).__name__}")
    return model


def position_ids_from_mask(attention_mask: torch.Tensor, seq: int) -> torch.Tensor:
    """Positions ``[b, seq]`` of the last ``seq`` tokens: real tokens count from 0, padding gets 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)[:, -seq:]


def _attention_mask(attention_mask: torch.Tensor, seq: int, offset: int) -> torch.Tensor:
    """Boolean ``[b, 1, seq, offset + seq]``: causal and not padding; each query always sees itself."""
    total = offset + seq
    causal = torch.ones(seq, total, dtype=torch.bool, device=attention_mask.device).tril(diagonal=offset)
    allowed = causal.unsqueeze(0) & attention_mask.bool()[:, None, :total]
    itself = torch.zeros(seq, total, dtype=torch.bool, device=attention_mask.device)
    itself[torch.arange(seq), offset + torch.arange(seq)] = True
    return (allowed | itself).unsqueeze(1)


def _self_attention(attn, x, rotary, kv_cache: KVCache | None, mask: torch.Tensor):
    """``SelfAttention.forward`` with an explicit attention mask."""
    qkv = attn.linear_qkv(x)
    s, b = qkv.shape[:2]
    qkv = qkv.view(s, b, attn.num_groups_local, attn.heads_per_group + 2, attn.head_dim)
    q = qkv[:, :, :, :attn.heads_per_group].reshape(s, b, -1, attn.head_dim)
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    if rotary is not None:
        q, k = kernels.apply_rotary(q, k, *rotary)
    if kv_cache is not None:
        k, v = kv_cache.append(attn.layer_number, k, v)
    heads = q.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    dropout = attn.attention_dropout if attn.training else 0.0
    gqa = k.shape[1] != heads
    if dropout > 0.0:
        with get_rng_tracker().fork():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    context = out.permute(2, 0, 1, 3).reshape(s, b, heads * attn.head_dim)
    return attn.linear_proj(context)


def _layer(layer, x, rotary, kv_cache, mask):
    """``TransformerLayer.forward`` with an explicit attention mask."""
    out, bias = _self_attention(layer.self_attention, layer.input_layernorm(x), rotary, kv_cache, mask)
    x = layer._bias_dropout_add(out, bias, x)
    normed = layer.pre_mlp_layernorm(x)
    out, bias = (layer.mlp(normed), None) if layer.is_moe else layer.mlp(normed)
    return layer._bias_dropout_add(out, bias, x)


def masked_forward(model, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                   kv_cache: KVCache | None = None, return_hidden: bool = False) -> torch.Tensor:
    """Run one GPT chunk on a padded batch.

    ``input_ids [b, s]`` (first chunk; later chunks read ``set_input_tensor``),
    ``attention_mask [b, offset + s]`` with ``offset`` the tokens already in
    ``kv_cache``.  Returns the hidden states ``[s, b, h]`` of a chunk without
    ``post_process``; on the last chunk the logits ``[b, s, v_pad/tp]`` (as
    ``GPTModel.forward``), or with ``return_hidden`` the final-norm hidden
    states ``[s, b, h]`` (gathered over the sequence under sequence parallelism).
    """
    model = unwrap(model)
    offset = 0 if kv_cache is None else kv_cache.offset
    if model.pre_process:
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError(f"masked_forward needs input_ids [b, s], got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        b, seq = input_ids.shape
    else:
        if model.input_tensor is None:
            raise ValueError("a GPT chunk without pre_process needs set_input_tensor() before forward")
        seq = model.input_tensor.shape[0] * (model.tp_size if model.sequence_parallel else 1)
        b = model.input_tensor.shape[1]
    if tuple(attention_mask.shape) != (b, offset + seq):
        raise ValueError(f"attention_mask must be [b, offset + s] = [{b}, {offset + seq}] ({offset} cached tokens), "
                         f"got {tuple(attention_mask.shape)}")
    if model.config.max_position_embeddings < offset + seq:
        raise ValueError(f"positions up to {offset + seq} exceed max_position_embeddings="
                         f"{model.config.max_position_embeddings}")
    if model.pre_process:
        hidden = model.embedding(input_ids, position_ids_from_mask(attention_mask, seq))
    else:
        hidden = model.input_tensor
    rotary = None
    if model.rotary is not None:
        rotary = model.rotary(torch.arange(offset, offset + seq, device=hidden.device))
    mask = _attention_mask(attention_mask, seq, offset)
    for layer in model.decoder.layers.values():
        hidden = _layer(layer, hidden, rotary, kv_cache, mask)
    if kv_cache is not None:
        kv_cache.advance(seq)
    if not model.post_process:
        return hidden
    hidden = model.decoder.final_layernorm(hidden)
    if return_hidden:
        if model.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, model.tp_group, tensor_parallel_output_grad=False)
        return hidden
    return model._head(hidden, None)
