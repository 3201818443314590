"""Rendered SFT conversations stored as Megatron indexed datasets, and the render cache of a jsonl file.

Layout: a prefix ``P`` holds two indexed datasets with the same documents, one per conversation in file
order, each the whole rendered conversation (truncation is :func:`megalite.data.sft.pack`'s, applied when
the samples are built, so one set of files serves every ``--seq-length``):

- ``P_text_document.{bin,idx}``: the token ids (uint16 or int32, Megatron's choice by vocabulary size);
- ``P_loss_mask_document.{bin,idx}``: uint8, 1 where the token is the assistant's.

These are the names Megatron's preprocess_data gives the datasets of json keys ``text`` and ``loss_mask``;
each file stays a plain Megatron indexed dataset (Megatron-Core's ``IndexedDataset`` reads either, and the
text one alone is a pretraining corpus), where one interleaved file would need a reader of its own.

:func:`load_documents` takes ``--sft-data`` as either a jsonl file or such a prefix.  A jsonl file is
rendered with the chat template, or, with a cache directory (``--data-cache-path``, as Megatron-Core caches
dataset indices there), read back from ``{cache}/{md5}-SFT_*_document`` when a previous run rendered the same
file content with the same tokenizer files, template and transformers version (the md5 is of that
description, kept beside as ``{md5}-SFT-description.json``, written last so a half-written entry is a miss).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype, index_file
from megalite.data.sft import ChatRenderer, read_jsonl

TEXT_SUFFIX, MASK_SUFFIX = "_text_document", "_loss_mask_document"


def write_documents(prefix: str, documents, vocab_size: int) -> dict:
    """Write ``(ids, mask)`` documents under ``prefix`` (a bad document leaves neither dataset); a summary."""
    count = tokens = assistant = 0
    with IndexedDatasetBuilder(prefix + TEXT_SUFFIX, best_dtype(vocab_size)) as text, \
            IndexedDatasetBuilder(prefix + MASK_SUFFIX, np.uint8) as mask:
        for ids, marks in documents:
            text.add_document(ids)
            mask.add_document(marks)
            count, tokens, assistant = count + 1, tokens + len(ids), assistant + sum(marks)
    return {"documents": count, "tokens": tokens, "assistant_tokens": assistant,
            "prefixes": [prefix + TEXT_SUFFIX, prefix + MASK_SUFFIX]}


def source_kind(sft_data: str) -> str:
    """``"jsonl"`` when ``sft_data`` is a file, ``"prefix"`` when it names preprocessed SFT files (its text
    dataset's index exists); neither is an error."""
    if os.path.isfile(sft_data):
        return "jsonl"
    if os.path.isfile(index_file(sft_data + TEXT_SUFFIX)):
        return "prefix"
    raise ValueError(f"--sft-data {sft_data}: neither a jsonl file nor a preprocessed prefix "
                     f"({index_file(sft_data + TEXT_SUFFIX)} does not exist)")


def open_documents(prefix: str, vocab_size: int | None = None) -> tuple[IndexedDataset, IndexedDataset]:
    """The token and loss-mask datasets under ``prefix``, checked: the mask dataset exists, has the same
    document lengths, holds only 0 and 1, and (with ``vocab_size``) every id is inside the vocabulary."""
    text_prefix, mask_prefix = prefix + TEXT_SUFFIX, prefix + MASK_SUFFIX
    text = IndexedDataset(text_prefix)
    if not os.path.isfile(index_file(mask_prefix)):
        raise ValueError(f"{prefix}: the loss mask {index_file(mask_prefix)} is missing (preprocess the chat jsonl "
                         f"with tools/preprocess_data.py --chat, which writes it beside the tokens)")
    mask = IndexedDataset(mask_prefix)
    if len(mask) != len(text):
        raise ValueError(f"{prefix}: {len(mask)} loss-mask documents for {len(text)} token documents")
    differ = np.flatnonzero(mask.sizes != text.sizes)
    if differ.size:
        i = int(differ[0])
        raise ValueError(f"{prefix}: document {i} has {mask.sizes[i]} loss-mask values for {text.sizes[i]} tokens")
    if not len(text):
        raise ValueError(f"{prefix} holds no conversations")
    if mask.num_tokens and int(mask.tokens.max()) > 1:
        raise ValueError(f"{mask_prefix}: loss-mask values must be 0 or 1, found {int(mask.tokens.max())}")
    if vocab_size is not None and text.num_tokens and int(text.tokens.max()) >= vocab_size:
        raise ValueError(f"{text_prefix}: token id {int(text.tokens.max())} is outside the tokenizer's "
                         f"vocabulary of {vocab_size} (preprocessed with another tokenizer?)")
    return text, mask


def read_documents(prefix: str, vocab_size: int | None = None) -> list[tuple[list[int], list[int]]]:
    """The ``(ids, mask)`` documents under ``prefix`` (checked by :func:`open_documents`)."""
    text, mask = open_documents(prefix, vocab_size)
    return [(text[i].tolist(), mask[i].tolist()) for i in range(len(text))]


def render_documents(path: str, renderer: ChatRenderer) -> list[tuple[list[int], list[int]]]:
    """Every conversation of the jsonl file ``path`` rendered: ``(ids, mask)`` in file order."""
    return [renderer.render(messages) for messages in read_jsonl(path)]


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_description(path: str, renderer: ChatRenderer) -> str:
    """What the rendering of ``path`` depends on: its content, the tokenizer's files, the template, transformers."""
    import transformers

    directory = renderer.tokenizer.path
    files = {name: _sha256_file(os.path.join(directory, name)) for name in sorted(os.listdir(directory))
             if os.path.isfile(os.path.join(directory, name))}
    return json.dumps({"class": "SFTDataset", "data_sha256": _sha256_file(path), "tokenizer_files": files,
                       "chat_template_sha256": hashlib.sha256(renderer.template.encode("utf-8")).hexdigest(),
                       "transformers": transformers.__version__}, indent=1)


def cached_documents(path: str, renderer: ChatRenderer, cache_dir: str) -> list[tuple[list[int], list[int]]]:
    """The rendered conversations of ``path``, read from ``cache_dir`` when cached there, else rendered and cached."""
    text = cache_description(path, renderer)
    prefix = os.path.join(cache_dir, f"{hashlib.md5(text.encode('utf-8')).hexdigest()}-SFT")
    marker = prefix + "-description.json"
    try:
        with open(marker, encoding="utf-8") as handle:
            if handle.read() == text:
                return read_documents(prefix)
    except (OSError, ValueError):
        pass  # no entry, or a damaged one: render again and replace it
    documents = render_documents(path, renderer)
    write_documents(prefix, documents, renderer.tokenizer.vocab_size)
    tmp = f"{marker}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, marker)
    return documents


def load_documents(sft_data: str, renderer: ChatRenderer | None, cache_dir: str | None = None,
                   vocab_size: int | None = None) -> list[tuple[list[int], list[int]]]:
    """``--sft-data``'s rendered conversations: a preprocessed prefix read back (``renderer`` unused, ids
    checked against ``vocab_size``), or a jsonl file rendered (through the cache when ``cache_dir`` is set)."""
    if source_kind(sft_data) == "prefix":
        return read_documents(sft_data, vocab_size)
    if cache_dir is None:
        return render_documents(sft_data, renderer)
    return cached_documents(sft_data, renderer, cache_dir)
