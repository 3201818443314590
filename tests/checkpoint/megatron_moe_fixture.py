"""Megatron-Core's MoE GPT trained and saved on 2 CPU ranks (gloo), then resumed by megalite in the same processes.

Megatron-Core's GPT with the local layer spec, a routed MoE MLP (4 SwiGLU experts, top-2, dropless, a shared
expert) in layer 0 and a dense MLP in layer 1 (``moe_layer_freq=[1, 0]``), at ep=2 with Megatron-Core's DDP and
(non-distributed) Adam, saved after SAVED_AT iterations and trained CONTINUED more (:mod:`megatron_optim_fixture`'s
run): once with SequentialMLP experts, once with GroupedMLP ones (``--moe-grouped-gemm``, their grouped GEMM on the
CPU: :mod:`megatron_grouped_fixture`).  :mod:`test_megatron_moe` checks megalite's reading of the saves;
:mod:`test_megatron_distopt_layouts` builds the same GPT for its distributed-optimizer runs.
"""

from __future__ import annotations

import argparse
import os

import torch

from tests.checkpoint import megatron_fixture, megatron_grouped_fixture as grouped_fixture
from tests.checkpoint import megatron_optim_fixture as run
from tests.checkpoint.megatron_moe_etp_fixture import save_expert_tp

ARGS = dict(megatron_fixture.ARGS, num_layers=2, num_query_groups=4, group_query_attention=False,
            qk_layernorm=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
            moe_shared_expert_intermediate_size=40, moe_layer_freq=[1, 0], moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False)
GROUPED = "_grouped"
"""The suffix of the directory of the GroupedMLP run's save (``--moe-grouped-gemm``)."""
SINGLETON = "_singleton"
"""The suffix of the directory of the same save with Megatron-Core's ``singleton_local_shards`` (per-expert tensors,
SwiGLU fc1 halves ``weight_w``/``weight_v``)."""
IDS = torch.arange(2 * 12).reshape(2, 12).mul(7).remainder(90)


def build(ep: int, seed: int, grouped: bool = False, tp: int = 1, etp: int | None = None, layer_spec=None,
          gate: bool = False):
    """Megatron-Core's MoE GPT of :data:`ARGS` on this rank of a tp x ep grid (fp32, CPU, local layer spec;
    ``grouped``: GroupedMLP experts, their grouped GEMM on the CPU (:mod:`megatron_grouped_fixture`); ``etp``: the
    expert tensor-parallel size, by default tp; ``layer_spec``: a function of the decoder block's spec giving the one
    to build; ``gate``: the shared expert gated, ``--moe-shared-expert-gate``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.transformer.moe import moe_utils

    megatron_fixture.patch_cuda()
    moe_utils.te_general_gemm = None  # its failed Transformer-Engine import leaves the name undefined
    grouped_fixture.patch_grouped_gemm()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp or tp)
    torch.manual_seed(seed)
    a = ARGS
    config = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        ffn_hidden_size=a["ffn_hidden_size"], kv_channels=a["kv_channels"], hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=a["init_method_std"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=a["norm_epsilon"],
        add_bias_linear=False, use_cpu_initialization=True, expert_model_parallel_size=ep,
        tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp or tp,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        num_moe_experts=a["num_experts"], moe_router_topk=a["moe_router_topk"],
        moe_ffn_hidden_size=a["moe_ffn_hidden_size"], moe_layer_freq=a["moe_layer_freq"],
        moe_shared_expert_intermediate_size=a["moe_shared_expert_intermediate_size"],
        moe_token_dispatcher_type=a["moe_token_dispatcher_type"], moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped,
        moe_shared_expert_gate=gate, moe_use_legacy_grouped_gemm=grouped)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    spec = spec if layer_spec is None else layer_spec(spec)
    model = GPTModel(config, spec, vocab_size=a["padded_vocab_size"], max_sequence_length=a["max_position_embeddings"],
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    with torch.no_grad():  # non-zero norm weights and a router that separates experts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "router" in name:
                param.normal_(0.0, 0.5)
    grouped_fixture.allow_fp32(model)
    return model


def sharded_shapes(model) -> dict:
    """``{sharded key: global shape}`` of the tensors ``model`` saves."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    return {t.key: tuple(t.global_shape) for t in nested_values(state) if isinstance(t, ShardedTensor)}


def train(model, ep: int, save_dir: str, grouped: bool = False):
    """Megatron-LM's run of ``model`` on an ep grid (tp=1, dp=2: each rank one micro-batch of an iteration) with
    Megatron-Core's DDP, (non-distributed) Adam and scheduler, saved into ``save_dir`` after SAVED_AT iterations
    (and in the legacy format into ``save_dir + LEGACY``; SequentialMLP's also with ``singleton_local_shards``;
    ``grouped``: GroupedMLP's, its args saying ``--moe-grouped-gemm``) and continued to TOTAL. Returns this rank's
    saved Adam moments (:func:`adam_moments`) and Megatron's losses of every iteration."""
    import torch.distributed as dist

    ddp, optimizer, scheduler = run.wrap(model)
    batches = run.micro_batches()
    per_iteration = len(batches) // run.TOTAL
    losses = []
    for i in range(run.TOTAL):
        if i == run.SAVED_AT:
            moments = adam_moments(model, optimizer)
            args = argparse.Namespace(**{**ARGS, "vocab_size": None, "global_batch_size": run.GLOBAL_BATCH,
                                         "consumed_train_samples": i * run.GLOBAL_BATCH, "moe_grouped_gemm": grouped},
                                      tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                      expert_model_parallel_size=ep, world_size=dist.get_world_size(),
                                      data_parallel_size=dist.get_world_size(), transformer_impl="local")
            saves = ((save_dir, None),) if grouped else \
                ((save_dir, None), (save_dir + SINGLETON, {"singleton_local_shards": True}))
            for directory, metadata in saves:
                state = {"args": args, "checkpoint_version": 3.0, "iteration": i,
                         "model": model.sharded_state_dict(metadata=metadata)}
                state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
                state["opt_param_scheduler"] = scheduler.state_dict()
                megatron_fixture.save_state(state, directory, i)
            run._save_legacy(save_dir + run.LEGACY, i, ddp, optimizer, scheduler, **{
                **{k: v for k, v in ARGS.items() if megatron_fixture.ARGS.get(k) != v},
                "expert_model_parallel_size": ep, "moe_grouped_gemm": grouped})
        batch = batches[i * per_iteration:(i + 1) * per_iteration]
        losses.append(run._train_step(ddp, optimizer, scheduler, batch[dist.get_rank()::2]))
    return moments, losses


def run_and_resume(save_dir: str, ep: int, ids: torch.Tensor):
    """:func:`train` of the SequentialMLP model into ``save_dir`` and of a GroupedMLP one into ``save_dir +
    GROUPED``; then megalite resumes each save (:func:`megatron_optim_fixture.resume`) at ep=1 (and the SequentialMLP
    one at ep=2: the GroupedMLP save's state is read into ep=2 by the same rule, checked by its moments) in these
    rank processes.  Returns, for each run (SequentialMLP's, GroupedMLP's), Megatron-Core's logits of ``ids`` after
    its own load of the save into an ep=1 model, this rank's saved Adam moments (:func:`adam_moments`), Megatron's
    losses of every iteration, the resumed runs' metrics files and rank 0's output of them; whether GroupedMLP
    experts save the same tensors as the SequentialMLP ones; and Megatron-Core's logits of ``ids`` of the
    expert-tensor-parallel save (:func:`megatron_moe_etp_fixture.save_expert_tp`, made between the two)."""
    from megatron.core import parallel_state

    model, grouped_model = build(ep, seed=1), build(ep, seed=1, grouped=True)
    grouped_same = sharded_shapes(grouped_model) == sharded_shapes(model)
    run.patch_cuda()
    results = [train(model, ep, save_dir)]
    results.append(train(grouped_model, ep, save_dir + GROUPED, grouped=True))
    parallel_state.destroy_model_parallel()
    directories = (save_dir, save_dir + GROUPED)
    logits = [megatron_logits(directory, ids, grouped) for directory, grouped in zip(directories, (False, True))]
    parallel_state.destroy_model_parallel()
    expert_tp_logits = save_expert_tp(save_dir, ids)
    root = os.path.dirname(save_dir)
    out = []
    for (moments, losses), directory, grouped, logits in zip(results, directories, (False, True), logits):
        name = os.path.basename(directory)
        runs = [(directory, os.path.join(root, f"{name}_ep1.jsonl"), ())]
        if not grouped:
            runs.append((directory, os.path.join(root, f"{name}_ep2.jsonl"), ("--expert-model-parallel-size", "2")))
        outputs = run.resume(runs)
        out.append((logits, moments, losses, [metrics for _, metrics, _ in runs], [text for text, *_ in outputs]))
    return out, grouped_same, expert_tp_logits


def adam_moments(model, optimizer):
    """This rank's Adam moments in megalite's names (at ep > 1 Megatron-Core chains a second optimizer for the
    experts): layer 0's router's first moment and the first moment of its local experts' fc1 and second of their
    fc2, stacked in expert order (GroupedMLP's ``weight1`` ``[hidden, experts x 2 ffn]`` and ``weight2`` ``[experts
    x ffn, hidden]`` as its forward views them, ``[experts, hidden, 2 ffn]`` and ``[experts, ffn, hidden]``, each
    expert's matrix transposed)."""
    state = {p: s for chained in optimizer.chained_optimizers for p, s in chained.optimizer.state.items()}
    params = dict(model.named_parameters())
    layer = "decoder.layers.0.mlp."
    moments = {f"optimizer.exp_avg.{layer}router.weight": state[params[layer + "router.weight"]]["exp_avg"].clone()}
    if layer + "experts.weight1" in params:
        hidden = ARGS["hidden_size"]
        one, two = (state[params[f"{layer}experts.weight{k}"]] for k in (1, 2))
        count = one["exp_avg"].numel() // (hidden * 2 * ARGS["moe_ffn_hidden_size"])
        moments[f"optimizer.exp_avg.{layer}experts.fc1_weight"] = \
            one["exp_avg"].view(count, hidden, -1).transpose(1, 2).clone()
        moments[f"optimizer.exp_avg_sq.{layer}experts.fc2_weight"] = \
            two["exp_avg_sq"].view(count, -1, hidden).transpose(1, 2).clone()
        return moments
    experts = sorted(n for n in params if n.startswith(layer + "experts.local_experts.") and "fc1" in n)
    moments[f"optimizer.exp_avg.{layer}experts.fc1_weight"] = torch.stack([state[params[n]]["exp_avg"]
                                                                           for n in experts])
    moments[f"optimizer.exp_avg_sq.{layer}experts.fc2_weight"] = torch.stack(
        [state[params[n.replace("fc1", "fc2")]]["exp_avg_sq"] for n in experts])
    return moments


def megatron_logits(save_dir: str, ids: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """Megatron-Core's logits of ``ids`` after its own ``dist_checkpointing.load`` of ``save_dir`` into an ep=1
    model (``grouped``: of GroupedMLP experts)."""
    from megatron.core import dist_checkpointing

    model = build(1, seed=7, grouped=grouped)
    directory = os.path.join(save_dir, f"iter_{run.SAVED_AT:07d}")
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)["model"])
    model.eval()
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model(ids, positions, causal)
