"""Checks of the data files and tokenizer named by the flags, done before any collective."""

from __future__ import annotations

from megalite.data.gpt_dataset import parse_data_path
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizer import build_tokenizer


def check_data(args) -> None:
    """Open every ``--data-path`` dataset and check the vocabulary covers its token ids.

    Sets ``args.vocab_size`` to the tokenizer's vocabulary (the byte tokenizer
    when there is no ``--tokenizer-model``) unless ``--vocab-size`` was given.
    Missing or corrupt files and a too-small vocabulary raise ValueError.
    Every rank runs this identically, so all fail together and none hangs.
    """
    _, prefixes = parse_data_path(args.data_path)
    try:
        tokenizer = build_tokenizer(args.tokenizer_model)
        datasets = [IndexedDataset(prefix) for prefix in prefixes]
    except (FileNotFoundError, OSError) as err:
        raise ValueError(str(err)) from None
    except RuntimeError as err:
        raise ValueError(f"cannot load tokenizer {args.tokenizer_model!r}: {err}") from None
    if args.vocab_size is None:
        args.vocab_size = tokenizer.vocab_size
    elif args.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                         f"of {tokenizer.vocab_size}")
    for dataset in datasets:
        if dataset.max_token_id >= args.vocab_size:
            raise ValueError(f"dataset {dataset.prefix} holds token id {dataset.max_token_id}, but the vocabulary "
                             f"has only {args.vocab_size} ids (tokenizer {args.tokenizer_model or 'byte'})")
