"""SFT providers for :func:`megalite.training.pretrain`: chat jsonl in, the same GPT model, trainer and schedule.

``--sft-data FILE.jsonl`` (see :mod:`megalite.data.sft` for the format, truncation and packing), or the prefix
``tools/preprocess_data.py --chat`` wrote (:mod:`megalite.data.sft_indexed`), is split by conversations with
``--split`` into train/valid/test, so ``--eval-interval`` reports the loss on held-out conversations.  With
``--data-cache-path DIR`` a jsonl file's rendering is cached there and reused by the next run.  The tokenizer
is ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``; its chat template, or ``--chat-template
FILE``, must mark assistant output with ``{% generation %}`` (a preprocessed prefix is already rendered, so
only its vocabulary is checked).  A base model comes in with ``--load DIR --finetune`` as in pretraining.
"""

from __future__ import annotations

from megalite.data.gpt_dataset import split_documents
from megalite.data.sft import ChatRenderer, SFTDataset, read_jsonl
from megalite.data.sft_indexed import load_documents, open_documents, source_kind
from megalite.data.tokenizer import HuggingFaceTokenizer
from megalite.flags import Flag, FlagTable
from megalite.training.data_checks import check_data

SFT_FLAGS = FlagTable((
    Flag("--sft-data", "SFT data", required=True,
         help="jsonl of conversations ('messages') or 'prompt'/'completion' pairs, or the prefix "
              "tools/preprocess_data.py --chat wrote"),
    Flag("--chat-template", "SFT data", help="a .jinja chat template with {% generation %} markers "
                                            "(default: the tokenizer's)"),
))


def add_sft_flags(parser):
    """``extra_args_provider`` of an SFT run."""
    SFT_FLAGS.add_to(parser)
    return parser


def _check_tokenizer_type(args) -> None:
    if args.tokenizer_type != "HuggingFaceTokenizer":
        raise ValueError("SFT renders chat templates: use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR")


def renderer_from_args(args) -> ChatRenderer:
    """The chat renderer of ``--tokenizer-model`` and ``--chat-template``."""
    _check_tokenizer_type(args)
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as handle:
                template = handle.read()
        except OSError as err:
            raise ValueError(f"--chat-template: {err}") from None
    return ChatRenderer(HuggingFaceTokenizer(args.tokenizer_model), template)


def check_chat_tokenizer(args) -> None:
    """Settle the vocabulary from the tokenizer and check its chat template."""
    _check_tokenizer_type(args)
    check_data(args)
    renderer_from_args(args)


def prepare_sft_data(args) -> None:
    """``prepare_data_func``: settle the vocabulary from the tokenizer and check the data and template
    (every rank, identically, so a bad file fails all of them together)."""
    if source_kind(args.sft_data) == "prefix":
        _check_tokenizer_type(args)
        check_data(args)
        open_documents(args.sft_data, args.vocab_size)
        return
    check_chat_tokenizer(args)
    try:
        read_jsonl(args.sft_data)
    except OSError as err:
        raise ValueError(f"--sft-data: {err}") from None


def sft_datasets_provider(args, num_samples):
    """Packed train/valid/test SFT datasets over the conversations of ``--sft-data`` split by ``--split``."""
    renderer = None if source_kind(args.sft_data) == "prefix" else renderer_from_args(args)
    pad = (renderer.tokenizer if renderer else HuggingFaceTokenizer(args.tokenizer_model)).pad
    documents = load_documents(args.sft_data, renderer, args.data_cache_path, args.vocab_size)
    datasets = []
    for name, indices, wanted in zip(("train", "valid", "test"), split_documents(len(documents), args.split),
                                     num_samples):
        if not wanted or not len(indices):
            datasets.append(None)
            continue
        dataset = SFTDataset([documents[i] for i in indices], args.seq_length, pad, int(wanted))
        if dataset.dropped:
            print(f"sft {name}: {dataset.dropped} conversations have no assistant token within --seq-length "
                  f"{args.seq_length} and are left out", flush=True)
        datasets.append(dataset)
    return tuple(datasets)
