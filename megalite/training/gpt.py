"""GPT providers for :func:`megalite.training.pretrain`: model, datasets, forward step and default data."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.synthetic import build_default_data
from megalite.models import GPTConfig, GPTModel, gpt_flops_per_token
from megalite.training.arguments import gpt_config
from megalite.training.training import LOSS_METRIC


def gpt_config_from_args(args) -> GPTConfig:
    """The model architecture the flags describe."""
    return gpt_config(args)


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
