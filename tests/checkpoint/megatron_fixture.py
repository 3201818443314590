"""A Megatron-LM torch_dist save directory written by Megatron-Core itself, on CPU ranks (gloo).

The model is Megatron-Core's GPTModel with the local layer spec (no Transformer Engine) and QK layer norm
(``--qk-layernorm``: its stacked ``q_layernorm``/``k_layernorm`` weights travel both ways); the state dict
is what Megatron-LM's ``generate_state_dict`` builds for ``--ckpt-format torch_dist`` (``args``,
``checkpoint_version`` 3.0, ``iteration``, the model's ``sharded_state_dict()``), saved with
``dist_checkpointing.save`` into ``iter_XXXXXXX/`` and published by ``latest_checkpointed_iteration.txt``.
Megatron-Core's few CUDA-only calls are patched in the rank processes only.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os

import torch
import torch.distributed as dist

# The architecture, in Megatron-LM's argument names (what its args Namespace holds).
ARGS = dict(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
            ffn_hidden_size=64, kv_channels=8, max_position_embeddings=16, seq_length=16,
            position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm",
            norm_epsilon=1e-5, swiglu=True, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0,
            attention_dropout=0.0, init_method_std=0.02, untie_embeddings_and_output_weights=True,
            make_vocab_size_divisible_by=8, vocab_size=90, padded_vocab_size=96, qk_layernorm=True,
            apply_layernorm_1p=False, num_experts=None, params_dtype=torch.float32, ckpt_format="torch_dist",
            global_batch_size=4, consumed_train_samples=12)
ITERATION = 3


def patch_cuda() -> None:
    """Megatron-Core's checkpoint writer syncs the GPU, places a flag tensor on it, and forks writer processes
    (which a daemonic test rank may not), and attention forks the CUDA RNG (dropout is 0 here): made CPU-safe
    in this process only."""
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    multiprocessing.current_process()._config["daemon"] = False


def build_model(tp: int, pp: int, seed: int = 1, tied: bool = False, vpp: int | None = None, layer_spec=None,
                mtp: int | None = None, **stages):
    """Megatron-Core's GPT of :data:`ARGS` on this rank of a tp x pp grid (fp32, CPU, local layer spec, or
    ``layer_spec(local spec)``); with ``tied`` its output layer shares the word embeddings; with ``vpp`` this
    rank's list of model chunks; with ``mtp`` that many multi-token prediction depths (on the stages
    Megatron-Core places them); ``stages``: TransformerConfig's uneven-stage fields
    (``num_layers_in_first_pipeline_stage``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    patch_cuda()
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    torch.manual_seed(seed)
    a = ARGS
    config = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"], ffn_hidden_size=a["ffn_hidden_size"], kv_channels=a["kv_channels"],
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=a["init_method_std"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=a["norm_epsilon"],
        add_bias_linear=False, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, persist_layer_norm=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, qk_layernorm=a["qk_layernorm"],
        virtual_pipeline_model_parallel_size=vpp, mtp_num_layers=mtp, **stages)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=a["qk_layernorm"])
    spec = spec if layer_spec is None else layer_spec(spec)
    chunks = []
    for vp_stage in range(vpp or 1):
        virtual = dict(ignore_virtual=vpp is None, vp_stage=vp_stage if vpp else None)
        model = GPTModel(config, spec, vocab_size=a["padded_vocab_size"],
                         max_sequence_length=a["max_position_embeddings"],
                         pre_process=parallel_state.is_pipeline_first_stage(**virtual),
                         post_process=parallel_state.is_pipeline_last_stage(**virtual),
                         share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                         vp_stage=virtual["vp_stage"],
                         mtp_block_spec=mtp and get_gpt_mtp_block_spec(config, spec, False,
                                                                       vp_stage=virtual["vp_stage"]))
        # Non-zero norm weights so a misplaced norm shows in the logits.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "layer_norm" in name:
                    param.uniform_(0.5, 1.5)
        chunks.append(model)
    return chunks if vpp else chunks[0]


SCHEDULE = dict(max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=16, lr_decay_style="cosine",
                start_wd=0.01, end_wd=0.01, wd_incr_steps=16, wd_incr_style="constant")


def megatron_scheduler(iterations: int):
    """Megatron-Core's OptimizerParamScheduler after ``iterations`` steps of the global batch, as Megatron-LM's
    loop steps it (lengths in samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, **SCHEDULE)
    for _ in range(iterations):
        scheduler.step(increment=ARGS["global_batch_size"])
    return scheduler


def _save(save_dir: str, tp: int, pp: int, ids: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    model = build_model(tp, pp)
    args = argparse.Namespace(**ARGS, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              world_size=dist.get_world_size(), data_parallel_size=dist.get_world_size() // (tp * pp))
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model.sharded_state_dict(),
             "opt_param_scheduler": megatron_scheduler(ITERATION).state_dict()}
    save_state(state, save_dir, ITERATION)
    parallel_state.destroy_model_parallel()
    return megatron_logits(save_dir, ids)


def save_state(state: dict, save_dir: str, iteration: int) -> None:
    """Save Megatron-LM's state dict as ``--ckpt-format torch_dist`` does: ``dist_checkpointing.save`` into
    ``iter_XXXXXXX/``, published by ``latest_checkpointed_iteration.txt`` (collective over every rank).

    The first save of a rank process starts the ``multiprocessing`` Manager process that Megatron-Core's writer
    keeps for its results queue; the later saves share it (a new one would import torch again to unpickle the write
    results: seconds each), and it stops with the rank (its exit handlers, then ``run_distributed``)."""
    from megatron.core import dist_checkpointing

    directory = os.path.join(save_dir, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, directory)
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def convert(*argv) -> int:
    """``tools/convert_checkpoint.py`` run with ``argv`` in this process; its exit status."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(
        os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.main(list(argv))


def megatron_logits(save_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's logits ``[b, s, padded vocab]`` of the checkpoint, loaded by its own
    ``dist_checkpointing.load`` into a tp=1 pp=1 model on every rank."""
    from megatron.core import dist_checkpointing

    model = build_model(1, 1, seed=7)
    directory = os.path.join(save_dir, f"iter_{ITERATION:07d}")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"])
    model.eval()
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model(ids, positions, causal)


def write_checkpoint(save_dir: str, ids: torch.Tensor, tp: int = 2, pp: int = 2) -> torch.Tensor:
    """Write the Megatron-LM save directory ``save_dir`` from tp x pp ranks (4 by default); return Megatron-Core's
    logits of ``ids`` (its own load of that directory into a tp=1 pp=1 model)."""
    from megalite.testing import run_distributed

    return run_distributed(_save, tp * pp, save_dir, tp, pp, ids, timeout=240)[0]
