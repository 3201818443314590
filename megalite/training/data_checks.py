"""Checks of the data files and tokenizer named by the flags, done before any collective."""

from __future__ import annotations

from megalite.data.gpt_dataset import parse_data_path
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizer import tokenizer_from_args


def check_data(args) -> None:
    """Open every ``--data-path`` dataset (none under ``--mock-data``) and settle the vocabulary size.

    The vocabulary is the tokenizer's (``--tokenizer-type``/``--tokenizer-model``);
    without one it is ``--vocab-size`` if given, else the byte tokenizer's.  Sets
    ``args.vocab_size`` to it, and ``args.eod_id`` to the tokenizer's end-of-document
    id (None when no tokenizer is consulted), taken before the vocabulary settles
    since NullTokenizer's eod depends on it.  Missing or corrupt files and a ``--vocab-size``
    below the tokenizer's raise ValueError.  Indexed files carry no vocabulary,
    so token ids are checked batch by batch during training.  Every rank runs this
    identically, so all fail together and none hangs.
    """
    _, prefixes = parse_data_path(args.data_path) if args.data_path is not None else ([], [])
    args.eod_id = None
    try:
        for prefix in prefixes:
            IndexedDataset(prefix)
        if args.tokenizer_type is not None or args.tokenizer_model is not None or args.vocab_size is None:
            tokenizer = tokenizer_from_args(args)
            tokenizer_vocab, args.eod_id = tokenizer.vocab_size, tokenizer.eod
            if args.tokenizer_type != "NullTokenizer" and args.vocab_size is not None \
                    and args.vocab_size < tokenizer_vocab:
                raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                                 f"of {tokenizer_vocab}")
            args.vocab_size = max(args.vocab_size or 0, tokenizer_vocab)
    except OSError as err:
        raise ValueError(str(err)) from None
    except RuntimeError as err:
        raise ValueError(f"cannot load tokenizer {args.tokenizer_model!r}: {err}") from None


def eod_token_id(args) -> int:
    """The end-of-document id of the tokenizer the flags name (the one ``check_data`` found, if it ran)."""
    eod = args.eod_id if getattr(args, "eod_id", None) is not None else tokenizer_from_args(args).eod
    if args.vocab_size is not None and eod >= args.vocab_size:
        raise ValueError(f"the end-of-document id {eod} of the tokenizer is outside the vocabulary of "
                         f"{args.vocab_size} ids (needed by --reset-position-ids, --reset-attention-mask and "
                         f"--eod-mask-loss)")
    return eod
