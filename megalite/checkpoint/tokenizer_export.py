"""What a Hugging Face export takes from the tokenizer of the run that saved a checkpoint.

The trainer stores its flags in the checkpoint; from ``--tokenizer-type``/``--tokenizer-model``
(or ``--vocab-file``/``--merge-file``) the export writes the tokenizer in the files Hugging Face
loads, and the bos/eos ids into config.json.  A Hugging Face tokenizer directory or GPT-2 BPE files
are copied; a sentencepiece model (megalite's own, as the Quickstart trains) is also written as a
``tokenizer.json`` built with the ``tokenizers`` library from the model's own settings, with its
unk/bos/eos/pad pieces as special tokens, so ``AutoTokenizer`` encodes and decodes as megalite does
(transformers builds the pipeline: :meth:`SpmConverter.build_tokenizer_from_spm_proto`).  A Hugging
Face directory's chat templates travel too (``chat_template.jinja``, ``additional_chat_templates/`` and
``tokenizer_config.json``'s entry), so the exported model chats the same.  A tokenizer that no longer
exists where the run found it is left out.
"""

from __future__ import annotations

import os
import shutil

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja")
"""The tokenizer files Hugging Face loads from a model directory; exports copy those present."""


def hf_tokenizer_files(directory: str) -> list[str]:
    """The Hugging Face tokenizer files present in ``directory`` (relative names), named chat templates in
    ``additional_chat_templates/`` included."""
    extra = os.path.join(directory, "additional_chat_templates")
    templates = sorted(n for n in os.listdir(extra) if n.endswith(".jinja")) if os.path.isdir(extra) else []
    names = [*HF_TOKENIZER_FILES, *(os.path.join("additional_chat_templates", n) for n in templates)]
    return [name for name in names if os.path.isfile(os.path.join(directory, name))]


def run_tokenizer(run_args: dict | None, model_vocab_size: int | None = None) -> tuple[list[tuple[str, str]], dict]:
    """``([(source path, file name in the export)], {"bos_token_id": .., "eos_token_id": ..})`` of a run.

    ValueError when the tokenizer has more ids than ``model_vocab_size`` (the model's embedding rows):
    such an export would produce ids the model cannot embed.
    """
    from megalite.data.tokenizer import tokenizer_from_saved_args

    if not run_args:
        return [], {}
    kind, model = run_args.get("tokenizer_type"), run_args.get("tokenizer_model")
    if kind is None and model is None:
        return [], {}
    files = []
    if kind == "HuggingFaceTokenizer" and model and os.path.isdir(model):
        files = [(os.path.join(model, n), n) for n in hf_tokenizer_files(model)]
    elif kind == "GPT2BPETokenizer":
        files = [(run_args.get("vocab_file"), "vocab.json"), (run_args.get("merge_file"), "merges.txt")]
    elif kind in (None, "SentencePieceTokenizer") and model:
        files = [(model, "tokenizer.model")]
    files = [(src, name) for src, name in files if src and os.path.isfile(src)]
    try:
        tokenizer = tokenizer_from_saved_args(run_args)
    except (OSError, ValueError):
        return files, {}
    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        raise ValueError(f"the run's tokenizer ({kind or 'SentencePieceTokenizer'} {model}) has {tokenizer.vocab_size}"
                         f" ids, more than the model's vocab_size {model_vocab_size}")
    ids = {"eos_token_id": tokenizer.eod}
    if tokenizer.bos is not None:
        ids["bos_token_id"] = tokenizer.bos
    return files, ids


def write_tokenizer(files: list[tuple[str, str]], output: str) -> None:
    """Copy ``files`` (from :func:`run_tokenizer` or a converted checkpoint) into the export ``output``;
    a lone sentencepiece ``tokenizer.model`` also becomes ``tokenizer.json`` + ``tokenizer_config.json``."""
    for source, name in files:
        os.makedirs(os.path.dirname(os.path.join(output, name)), exist_ok=True)
        shutil.copy(source, os.path.join(output, name))
    names = {name for _, name in files}
    if names == {"tokenizer.model"}:
        sentencepiece_to_hf(os.path.join(output, "tokenizer.model"), output)


def sentencepiece_to_hf(model_path: str, output: str) -> None:
    """Write a sentencepiece model as a Hugging Face fast tokenizer (``tokenizer.json`` and its config) in
    ``output``: the same pieces and ids, no bos added on encode (as megalite's SentencePieceTokenizer)."""
    try:
        import transformers
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
    except ImportError:
        return  # transformers (the [hf] extra) is absent: the export keeps tokenizer.model only
    proto = import_protobuf().ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    if proto.trainer_spec.model_type == 2:  # BPE: a piece -> id map, merges ranked by score
        vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    else:
        vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    if backend is None:
        raise ValueError(f"{model_path}: sentencepiece model type {proto.trainer_spec.model_type} has no Hugging "
                         "Face equivalent")
    spec = proto.trainer_spec
    specials = {"unk_token": spec.unk_id, "bos_token": spec.bos_id, "eos_token": spec.eos_id, "pad_token": spec.pad_id}
    names = {key: proto.pieces[i].piece for key, i in specials.items() if 0 <= i < len(proto.pieces)}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **names)
    tokenizer.save_pretrained(output)
