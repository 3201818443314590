"""Turn a corpus into Megatron indexed datasets, tokenizing in worker processes.

Shared by tools/preprocess_data.py and the built-in default corpus.  The input
is jsonl (one document per line; each of ``json_keys`` becomes its own dataset
``{prefix}_{key}_document``, as in Megatron's preprocess_data) or plain text
(one document per line, or per blank-line-separated block).  Documents keep
the input's order whatever the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Iterator

from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megalite.data.tokenizer import build_tokenizer

INPUT_FORMATS = ("jsonl", "lines", "blocks")
"""jsonl: a JSON object per line; lines: each non-empty line is a document; blocks: blank lines separate documents."""

_worker = None


def _fields(path: str, line_no: int, line: str, keys) -> list[str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
    for key in keys:
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(f"{path}:{line_no}: expected an object with a string field {key!r}")
    return [record[key] for key in keys]


def _records(path: str, input_format: str) -> Iterator[tuple[int, str | None, int]]:
    """(first line number, raw text or None for blank lines, bytes read) of each document, in order."""
    with open(path, encoding="utf-8") as f:
        block, start, size = [], 0, 0
        for line_no, line in enumerate(f, 1):
            size += len(line.encode())
            if input_format != "blocks":
                text = line if input_format == "jsonl" else line.rstrip("\n")
                yield line_no, text if line.strip() else None, size
                size = 0
            elif line.strip():
                block.append(line.rstrip("\n"))
                start = start or line_no
            else:
                yield start, "\n".join(block) if block else None, size
                block, start, size = [], 0, 0
        if block or size:
            yield start, "\n".join(block) if block else None, size


def read_texts(path: str, key: str = "text", input_format: str | None = None) -> Iterator[str]:
    """The documents of ``path``: field ``key`` of each .jsonl/.json line, else each non-empty line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} does not exist")
    input_format = input_format or ("jsonl" if path.endswith((".jsonl", ".json")) else "lines")
    for line_no, text, _ in _records(path, input_format):
        if text is not None:
            yield _fields(path, line_no, text, [key])[0] if input_format == "jsonl" else text


def _init_worker(tokenizer_spec: dict, path: str, keys, input_format: str, append_eod: bool):
    global _worker
    _worker = (build_tokenizer(**tokenizer_spec), path, keys, input_format, append_eod)


def _encode(record):
    line_no, text, size = record
    if text is None:
        return None, size
    tokenizer, path, keys, input_format, append_eod = _worker
    texts = _fields(path, line_no, text, keys) if input_format == "jsonl" else [text]
    docs = []
    for one in texts:
        ids = tokenizer.tokenize(one)
        if append_eod:
            ids.append(tokenizer.eod)
        docs.append(ids)
    return docs, size


def output_prefixes(output_prefix: str, keys) -> list[str]:
    """Megatron's dataset names: ``{output_prefix}_{key}_document`` per json key."""
    return [f"{output_prefix}_{key}_document" for key in keys]


def preprocess(input_path: str, output_prefix: str, tokenizer_spec: dict | None = None, *, json_keys=("text",),
               input_format: str = "jsonl", workers: int = 1, append_eod: bool = False,
               progress: bool = True) -> dict:
    """Tokenize ``input_path`` into one indexed dataset per json key; returns a summary.

    ``tokenizer_spec`` holds :func:`build_tokenizer`'s keyword arguments.
    Progress is a tqdm bar over the input's bytes.  Malformed lines raise
    ValueError naming the file and line; nothing is written then.  The summary
    has ``documents``, ``tokens``, ``seconds`` and ``prefixes``.
    """
    if workers < 1:
        raise ValueError(f"--workers must be positive, got {workers}")
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {', '.join(INPUT_FORMATS)}, got {input_format!r}")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file {input_path!r} does not exist")
    keys = list(json_keys) if input_format == "jsonl" else ["text"]
    spec = dict(tokenizer_spec or {})
    tokenizer = build_tokenizer(**spec)
    prefixes = output_prefixes(output_prefix, keys)
    from tqdm import tqdm

    start = time.perf_counter()
    docs = tokens = 0
    builders = [IndexedDatasetBuilder(p, best_dtype(tokenizer.vocab_size)) for p in prefixes]
    init = (spec, input_path, keys, input_format, append_eod)
    pool = multiprocessing.Pool(workers, _init_worker, init) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(*init)
        results = map(_encode, _records(input_path, input_format)) if pool is None else \
            pool.imap(_encode, _records(input_path, input_format), chunksize=32)
        with tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True, disable=not progress,
                  desc="tokenizing") as bar:
            for encoded, size in results:
                bar.update(size)
                if encoded is None:
                    continue
                for builder, ids in zip(builders, encoded):
                    builder.add_document(ids)
                    tokens += len(ids)
                docs += 1
    except BaseException:
        for builder in builders:
            builder.discard()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for builder in builders:
        builder.finalize()
    return {"documents": docs, "tokens": tokens, "seconds": time.perf_counter() - start, "prefixes": prefixes}
