"""Checks of the data files and tokenizer named by the flags, done before any collective."""

from __future__ import annotations

from megalite.data.gpt_dataset import parse_data_path
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizer import build_tokenizer


def check_data(args) -> None:
    """Open every ``--data-path`` dataset and check the vocabulary covers its token ids.

    The vocabulary is the tokenizer model's; without one it is ``--vocab-size``
    if given, else the byte tokenizer's.  Sets ``args.vocab_size`` to it.
    Missing or corrupt files and a too-small vocabulary raise ValueError.
    Every rank runs this identically, so all fail together and none hangs.
    """
    _, prefixes = parse_data_path(args.data_path)
    source = (f"tokenizer {args.tokenizer_model}" if args.tokenizer_model
              else "--vocab-size" if args.vocab_size is not None else "the byte tokenizer")
    try:
        datasets = [IndexedDataset(prefix) for prefix in prefixes]
        if args.tokenizer_model is not None or args.vocab_size is None:
            tokenizer_vocab = build_tokenizer(args.tokenizer_model).vocab_size
            if args.vocab_size is not None and args.vocab_size < tokenizer_vocab:
                raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                                 f"of {tokenizer_vocab}")
            args.vocab_size = max(args.vocab_size or 0, tokenizer_vocab)
    except OSError as err:
        raise ValueError(str(err)) from None
    except RuntimeError as err:
        raise ValueError(f"cannot load tokenizer {args.tokenizer_model!r}: {err}") from None
    for dataset in datasets:
        if dataset.max_token_id >= args.vocab_size:
            raise ValueError(f"dataset {dataset.prefix} holds token id {dataset.max_token_id}, but the vocabulary "
                             f"has only {args.vocab_size} ids (from {source})")


def eod_token_id(args) -> int:
    """The end-of-document id of the tokenizer (the byte tokenizer without ``--tokenizer-model``)."""
    eod = build_tokenizer(args.tokenizer_model).eod
    if args.vocab_size is not None and eod >= args.vocab_size:
        raise ValueError(f"the end-of-document id {eod} of {args.tokenizer_model or 'the byte tokenizer'} is outside "
                         f"the vocabulary of {args.vocab_size} ids (needed by --reset-position-ids, "
                         f"--reset-attention-mask and --eod-mask-loss)")
    return eod
