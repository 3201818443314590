"""GPT providers for :func:`megalite.training.pretrain`: model, datasets, forward step and default data."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.megatron_cache import hf_tokenizer_identifiers, null_tokenizer_identifiers
from megalite.data.mock import build_mock_datasets
from megalite.data.synthetic import build_default_data
from megalite.models import GPTConfig, GPTModel, gpt_flops_per_token
from megalite.models.mtp import mtp_losses
from megalite.training.flags import context_parallel_config, gpt_config
from megalite.training.data_checks import eod_token_id
from megalite.training.trainer import LOSS_METRIC


def gpt_config_from_args(args) -> GPTConfig:
    """The model architecture the flags describe."""
    return gpt_config(args)


def model_provider(args, *, pre_process: bool, post_process: bool, layer_range: tuple[int, int]) -> GPTModel:
    """One GPT chunk on the current topology's groups."""
    return GPTModel(gpt_config_from_args(args), pre_process=pre_process, post_process=post_process,
                    layer_range=layer_range, sequence_parallel=args.sequence_parallel,
                    cp_comm_type=context_parallel_config(args).comm_type)


def megatron_tokenizer_identifiers(args) -> dict | None:
    """Megatron-Core's identifiers of the flags' tokenizer where megalite knows them (NullTokenizer,
    HuggingFaceTokenizer), so that Megatron-LM finds the index cache megalite writes; None otherwise (megalite
    still reads Megatron's caches, whatever their tokenizer, since it does not change the indices)."""
    if args.tokenizer_type == "NullTokenizer":
        return null_tokenizer_identifiers(eod_token_id(args))
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return hf_tokenizer_identifiers(args.tokenizer_model, args.vocab_file, args.merge_file)
    return None


def train_valid_test_datasets_provider(args, num_samples):
    """GPT datasets over ``--data-path`` (or ``--mock-data``), split by documents according to ``--split``."""
    tokenizer = megatron_tokenizer_identifiers(args)
    if args.mock_data:
        named = args.tokenizer_type is not None or args.tokenizer_model is not None
        eod = eod_token_id(args) if named else args.vocab_size - 1
        return build_mock_datasets(args.seq_length, args.seed, num_samples, args.vocab_size, eod,
                                   args.data_cache_path, tokenizer=tokenizer)
    return build_train_valid_test_datasets(args.data_path, args.split, args.seq_length, args.seed, num_samples,
                                           args.data_cache_path, vocab_size=args.vocab_size, tokenizer=tokenizer)


def loss_func(per_token_loss: torch.Tensor):
    """Mean language-model loss of one micro-batch."""
    loss = per_token_loss.float().mean()
    return loss, {LOSS_METRIC: loss.detach()}


def masked_loss_func(loss_mask: torch.Tensor, normalizer: torch.Tensor, per_token_loss: torch.Tensor):
    """Loss over the unmasked tokens of this rank divided by ``normalizer`` (see ``prepare_batch``).

    Under context parallelism the mean of this over the CP ranks (which DDP's
    dp x cp averaging takes) is the micro-batch's mean loss.
    """
    loss = (per_token_loss.float() * loss_mask).sum() / normalizer
    return loss, {LOSS_METRIC: loss.detach()}


def forward_step(data_iterator, model):
    """Next micro-batch through ``model``.

    A plain batch ``{"tokens": [b, s+1]}`` gives inputs tokens[:-1] and labels
    tokens[1:]; a prepared one (context parallelism, packed sequences; see
    :func:`megalite.context_parallel.prepare_batch`) already holds this rank's
    inputs, labels, positions, documents and loss mask.
    """
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    tokens = batch["tokens"]
    if "labels" not in batch:
        output = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        return output, _with_mtp_losses(loss_func, model)
    output = model(tokens, batch["labels"], position_ids=batch.get("position_ids"),
                   document_ids=batch.get("document_ids"), loss_mask=batch["loss_mask"])
    return output, _with_mtp_losses(partial(masked_loss_func, batch["loss_mask"], batch["loss_normalizer"]), model)


def _with_mtp_losses(func, model):
    """``func``, whose report also holds the forward's multi-token prediction losses when the model has MTP."""
    losses = mtp_losses(model)
    if not losses:
        return func

    def report(per_token_loss):
        loss, metrics = func(per_token_loss)
        return loss, {**metrics, **losses}

    return report


def flops_per_token(args) -> float:
    return gpt_flops_per_token(gpt_config_from_args(args), args.seq_length)


def prepare_default_data(args) -> None:
    """Point the flags at the cached synthetic corpus and tokenizer; rank 0 builds them, the rest wait."""
    if dist.get_rank() == 0:
        build_default_data(args.data_cache_path)
    dist.barrier()
    args.data_path, args.tokenizer_model = build_default_data(args.data_cache_path)
    args.data_path = [args.data_path]
