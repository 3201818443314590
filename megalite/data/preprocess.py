"""Turn a jsonl corpus into an indexed dataset, tokenizing in worker processes.

Shared by tools/preprocess_data.py and the built-in default corpus.  Documents
keep the input's order whatever the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megalite.data.tokenizer import build_tokenizer

_worker_tokenizer = None


def _document_text(path: str, line_no: int, line: str, key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise ValueError(f"{path}:{line_no}: expected an object with a string field {key!r}")
    return record[key]


def read_texts(path: str, key: str = "text") -> Iterator[str]:
    """The documents of ``path``: field ``key`` of each .jsonl line, or each line of any other file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} does not exist")
    jsonl = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield _document_text(path, line_no, line, key) if jsonl else line.rstrip("\n")


def _init_worker(tokenizer_model, tokenizer_kind):
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(tokenizer_model, tokenizer_kind)


def _encode(job):
    path, line_no, line, key, append_eod = job
    ids = _worker_tokenizer.tokenize(_document_text(path, line_no, line, key))
    if append_eod:
        ids.append(_worker_tokenizer.eod)
    return ids, len(line)


def _jobs(path, key, append_eod):
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                yield path, line_no, line, key, append_eod


class _Progress:
    """A carriage-return counter on stderr, refreshed at most twice a second."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = self.last = time.monotonic()

    def update(self, docs: int, nbytes: int, final: bool = False):
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 0.5):
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        sys.stderr.write(f"\r{docs} documents, {nbytes / 2 ** 20:.1f} MiB, {docs / elapsed:.0f} docs/s"
                         + ("\n" if final else ""))
        sys.stderr.flush()


def preprocess_jsonl(input_path: str, output_prefix: str, tokenizer_model: str | None = None,
                     tokenizer_kind: str = "auto", workers: int = 1, append_eod: bool = True,
                     key: str = "text", progress: bool = True) -> str:
    """Tokenize field ``key`` of every line of ``input_path`` into ``output_prefix.bin/.idx``.

    Returns ``output_prefix``.  ``append_eod`` ends every document with the
    tokenizer's end-of-document id.  Malformed lines raise ValueError naming the
    file and line; nothing is written then.
    """
    if workers < 1:
        raise ValueError(f"workers must be positive, got {workers}")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file {input_path!r} does not exist")
    tokenizer = build_tokenizer(tokenizer_model, tokenizer_kind)
    meter = _Progress(progress)
    docs = nbytes = 0
    with IndexedDatasetBuilder(output_prefix, best_dtype(tokenizer.vocab_size)) as builder:
        jobs = _jobs(input_path, key, append_eod)
        if workers == 1:
            _init_worker(tokenizer_model, tokenizer_kind)
            results = map(_encode, jobs)
            pool = None
        else:
            pool = multiprocessing.Pool(workers, _init_worker, (tokenizer_model, tokenizer_kind))
            results = pool.imap(_encode, jobs, chunksize=64)
        try:
            for ids, size in results:
                builder.add_document(ids)
                docs, nbytes = docs + 1, nbytes + size
                meter.update(docs, nbytes)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    meter.update(docs, nbytes, final=True)
    return output_prefix
