"""GPT providers for :func:`megalite.training.pretrain`: model, datasets, forward step and default data."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.synthetic import build_default_data
from megalite.models import GPTConfig, GPTModel, gpt_flops_per_token
from megalite.moe import MoEConfig
from megalite.training.training import LOSS_METRIC


def gpt_config_from_args(args) -> GPTConfig:
    """The model architecture the Megatron flags describe."""
    moe = None
    if args.num_experts:
        moe = MoEConfig(num_experts=args.num_experts, ffn_hidden_size=args.moe_ffn_hidden_size,
                        topk=args.moe_router_topk, activation="swiglu" if args.swiglu else "gelu",
                        aux_loss_coeff=args.moe_aux_loss_coeff, z_loss_coeff=args.moe_z_loss_coeff,
                        capacity_factor=args.moe_expert_capacity_factor,
                        token_drop_policy=args.moe_token_drop_policy, dispatcher=args.moe_token_dispatcher_type,
                        grouped_gemm=args.moe_grouped_gemm, init_method_std=args.init_method_std)
    return GPTConfig(vocab_size=args.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                     num_query_groups=args.num_query_groups, max_position_embeddings=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type, normalization=args.normalization,
                     norm_eps=args.norm_epsilon, activation="swiglu" if args.swiglu else "gelu",
                     add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
                     attention_dropout=args.attention_dropout,
                     untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                     init_method_std=args.init_method_std, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     recompute_granularity=args.recompute_granularity, moe=moe, moe_layer_freq=args.moe_layer_freq,
                     seed=args.seed)


def model_provider(args, *, pre_process: bool, post_process: bool, layer_range: tuple[int, int]) -> GPTModel:
    """One GPT chunk on the current topology's groups."""
    return GPTModel(gpt_config_from_args(args), pre_process=pre_process, post_process=post_process,
                    layer_range=layer_range, sequence_parallel=args.sequence_parallel)


def train_valid_test_datasets_provider(args, num_samples):
    """GPT datasets over ``--data-path``, split by documents according to ``--split``."""
    return build_train_valid_test_datasets(args.data_path, args.split, args.seq_length, args.seed, num_samples,
                                           args.data_cache_path)


def loss_func(per_token_loss: torch.Tensor):
    """Mean language-model loss of one micro-batch."""
    loss = per_token_loss.float().mean()
    return loss, {LOSS_METRIC: loss.detach()}


def forward_step(data_iterator, model):
    """Next micro-batch through ``model``: inputs are tokens[:-1], labels tokens[1:]."""
    tokens = next(data_iterator)["tokens"]
    device = next(model.parameters()).device
    tokens = tokens.to(device, non_blocking=True)
    return model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), loss_func


def flops_per_token(args) -> float:
    return gpt_flops_per_token(gpt_config_from_args(args), args.seq_length)


def prepare_default_data(args) -> None:
    """Point the flags at the cached synthetic corpus and tokenizer; rank 0 builds them, the rest wait."""
    if dist.get_rank() == 0:
        build_default_data(args.data_cache_path)
    dist.barrier()
    args.data_path, args.tokenizer_model = build_default_data(args.data_cache_path)
    args.data_path = [args.data_path]
