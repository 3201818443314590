"""Megatron-LM legacy checkpoints made by Megatron-Core itself (gloo on CPU), with their logits.

Each rank builds its Megatron-Core GPT chunk (local layer spec, CPU initialization) and Megatron-Core's
optimizer, and writes ``model.state_dict_for_save_checkpoint()`` and ``optimizer.state_dict()`` in
Megatron-LM's legacy on-disk layout (``latest_checkpointed_iteration.txt``,
``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding ``args``, ``iteration``, ``model``,
``optimizer``, ``rng_state``); then the forward pass runs (stage 0 sends its hidden states to stage 1 by
point-to-point) and the last stage returns the logits gathered over TP.  The "llama" model (SwiGLU,
grouped-query attention, RoPE, RMSNorm, untied embeddings) at tp=2 pp=2 and the "gpt3" one (GELU, biases,
learned positions, LayerNorm, tied embeddings) and "qwen3" one (QK layer norm, a QKV-only bias, interleaved
RoPE with Llama-3 scaling) at tp=2 pp=1 all have a vocabulary that Megatron pads
(50 -> 64 at make-vocab-size-divisible-by 8 x tp 2), so every layout rule of the legacy format is exercised.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import types
import zlib
from unittest import mock

import numpy as np
import torch

VOCAB, PADDED_VOCAB, DIVISIBLE_BY = 50, 64, 8
SEQ, ITERATION, CONSUMED = 12, 7, 56
ARCH = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, kv_channels=8,
            max_position_embeddings=SEQ)
STYLES = {
    "llama": dict(num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  add_bias_linear=False, tied=False),
    "gpt3": dict(num_query_groups=4, position_embedding_type="learned_absolute", normalization="LayerNorm",
                 swiglu=False, add_bias_linear=True, tied=True),
    "qwen3": dict(num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  add_bias_linear=False, tied=False, add_qkv_bias=True, qk_layernorm=True, rotary_interleaved=True,
                  use_rope_scaling=True, rope_scaling_factor=4.0, rotary_base=1000000),
}
"""The two model families of Megatron-LM's example scripts, Llama (examples/llama) and GPT-3 (examples/gpt3), and
one with every attention option megalite maps: QK layer norm, a QKV-only bias, interleaved RoPE with Llama-3
scaling (at base 1e6 two of the four head frequencies have wavelengths the scaling changes)."""
OPTIONS = dict(add_qkv_bias=False, qk_layernorm=False, rotary_interleaved=False, use_rope_scaling=False,
               rope_scaling_factor=8.0, rotary_base=10000)
"""Megatron-LM's defaults of the options only the "qwen3" style sets."""


def megatron_args(tp: int, pp: int, style: str = "llama") -> argparse.Namespace:
    """The subset of Megatron-LM's parsed ``args`` (its attribute names) that a legacy checkpoint stores."""
    model = {**OPTIONS, **STYLES[style]}
    return argparse.Namespace(
        **ARCH, group_query_attention=model["num_query_groups"] != ARCH["num_attention_heads"],
        num_query_groups=model["num_query_groups"], position_embedding_type=model["position_embedding_type"],
        rotary_base=model["rotary_base"], rotary_percent=1.0, rotary_interleaved=model["rotary_interleaved"],
        use_rope_scaling=model["use_rope_scaling"], rope_scaling_factor=model["rope_scaling_factor"],
        normalization=model["normalization"], norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=model["swiglu"],
        openai_gelu=False, squared_relu=False, add_bias_linear=model["add_bias_linear"], add_qkv_bias=model["add_qkv_bias"],
        qk_layernorm=model["qk_layernorm"], multi_latent_attention=False, untie_embeddings_and_output_weights=not model["tied"],
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
        make_vocab_size_divisible_by=DIVISIBLE_BY, vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1, num_experts=None, transformer_impl="local", seq_length=SEQ,
        iteration=ITERATION, consumed_train_samples=CONSUMED, ckpt_format="torch", fp16=False, bf16=False,
        params_dtype=torch.float32, use_distributed_optimizer=False)


def _build(tp: int, pp: int, style: str):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tp, pp)
    torch.manual_seed(1234)  # the same master weights on every rank; each keeps its TP block (CPU initialization)
    model = {**OPTIONS, **STYLES[style]}
    config = TransformerConfig(
        num_layers=ARCH["num_layers"], hidden_size=ARCH["hidden_size"], ffn_hidden_size=ARCH["ffn_hidden_size"],
        num_attention_heads=ARCH["num_attention_heads"], num_query_groups=model["num_query_groups"],
        kv_channels=ARCH["kv_channels"], normalization=model["normalization"], layernorm_epsilon=1e-5,
        gated_linear_unit=model["swiglu"],
        activation_func=torch.nn.functional.silu if model["swiglu"] else torch.nn.functional.gelu,
        add_bias_linear=model["add_bias_linear"], add_qkv_bias=model["add_qkv_bias"],
        qk_layernorm=model["qk_layernorm"], rotary_interleaved=model["rotary_interleaved"], hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.2, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False)
    spec = get_gpt_layer_local_spec(normalization=model["normalization"], qk_layernorm=model["qk_layernorm"])
    gpt = GPTModel(config, spec, vocab_size=PADDED_VOCAB,
                   max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=model["tied"],
                   position_embedding_type=model["position_embedding_type"], rotary_base=model["rotary_base"],
                   rope_scaling=model["use_rope_scaling"], rope_scaling_factor=model["rope_scaling_factor"])
    # Norm weights start at ones and biases at zeros: give every replicated tensor values of its own, equal on the
    # TP ranks, and every bias values of its own (a split one per TP rank).
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            split = getattr(param, "tensor_model_parallel", False)
            if not split or name.endswith(".bias"):
                seed = zlib.crc32(name.encode()) + 1000 * parallel_state.get_pipeline_model_parallel_rank()
                seed += 100 * parallel_state.get_tensor_model_parallel_rank() if split else 0
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    return gpt.eval()


def _adam(model):
    """Megatron-Core's (non-distributed) optimizer after one Adam step on seeded gradients, its moments then set to
    ``exp_avg = 2 w + 1`` and ``exp_avg_sq = w * w`` of each parameter ``w``, so a test can tell whose they are."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)  # stands in for Megatron's DDP
    real_tensor = torch.tensor

    def cpu_tensor(*args, **kwargs):  # Megatron-Core's optimizer wrappers put their loss scale on "cuda"
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real_tensor(*args, **kwargs)

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), mock.patch.object(torch, "tensor", cpu_tensor):
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1,
                                                           use_distributed_optimizer=False), [model])
    for name, param in model.named_parameters():
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.optimizer.step()
        for param, state in inner.optimizer.state.items():
            state["exp_avg"].copy_(2 * param.detach() + 1)
            state["exp_avg_sq"].copy_(param.detach() ** 2)
    return optimizer


def write_rank(save_dir: str, model, optimizer, args, tp_rank: int, pp_rank: int, pp: int,
               iteration: int = ITERATION, scheduler=None, ep_rank: int | None = None) -> None:
    """This rank's ``model_optim_rng.pt`` as Megatron-LM's training/checkpointing.py lays it out (with the
    ``OptimizerParamScheduler``'s state when ``scheduler`` is given); ``model``: the model, or a list of its
    interleaved chunks (``model0``, ``model1``, ...); ``ep_rank``: the expert-parallel rank at ep > 1 (a third
    suffix of the rank directory)."""
    rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + \
        (f"_{ep_rank:03d}" if ep_rank is not None else "")
    directory = os.path.join(save_dir, f"iter_{iteration:07d}", rank_dir)
    os.makedirs(directory, exist_ok=True)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "optimizer": optimizer.state_dict(), "rng_state": [rng], "num_floating_point_operations_so_far": 0}
    if isinstance(model, list):
        state.update({f"model{i}": chunk.state_dict_for_save_checkpoint() for i, chunk in enumerate(model)})
    else:
        state["model"] = model.state_dict_for_save_checkpoint()
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    torch.save(state, os.path.join(directory, "model_optim_rng.pt"))


def save_and_forward(save_dir: str, ids: torch.Tensor, tp: int = 2, pp: int = 2, style: str = "llama"):
    """On each rank of a tp x pp gloo world: write the legacy checkpoint of a ``style`` model; return the logits
    (last stage, TP gathered, ``[b, s, PADDED_VOCAB]``) or None."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    model = _build(tp, pp, style)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    write_rank(save_dir, model, _adam(model), megatron_args(tp, pp, style), tp_rank, pp_rank, pp)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    batch, seq = ids.shape
    # CUDA-only calls of Megatron-Core's forward, on the CPU: RoPE moves its frequencies to
    # torch.cuda.current_device(), and attention forks the CUDA RNG tracker (for dropout, which is 0 here).
    cpu_device = contextlib.ExitStack()
    cpu_device.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
    cpu_device.enter_context(mock.patch.object(tensor_parallel, "get_cuda_rng_tracker",
                                               lambda: types.SimpleNamespace(fork=contextlib.nullcontext)))
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    causal = torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()  # as Megatron-LM's dataloader makes it
    hidden_shape = (seq, batch, ARCH["hidden_size"])
    with torch.no_grad(), cpu_device:
        if not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(hidden_shape)
            dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, positions, causal)
        if not parallel_state.is_pipeline_last_stage():
            dist.send(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            result = None
        else:
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            result = torch.cat(parts, dim=-1)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    return result
