"""A small synthetic corpus the project generates itself, and its cached default build.

Documents are either worksheets of arithmetic problems with their answers
("12+7=19") or short templated stories whose numbers must add up.  A small
model visibly learns both: the templates quickly, the arithmetic slowly and
digit by digit.  The RLHF code reuses :func:`arithmetic_problem` and
:func:`arithmetic_answer` as a task with a checkable answer.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "megalite", "default_data")
_FORMAT_VERSION = 2
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

_NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "June"]
_ITEMS = ["apple", "book", "coin", "shell", "stamp", "marble", "card", "pencil"]
_COLORS = ["red", "blue", "green", "yellow", "black", "white"]
_ANIMALS = ["cat", "dog", "fox", "owl", "horse", "mouse"]
_PLACES = ["table", "tree", "bridge", "bed", "hill", "window"]


def arithmetic_problem(rng: random.Random) -> tuple[str, str]:
    """A random problem and its answer, e.g. ("12+7=", "19").

    Sums and differences of numbers below 100 (differences never negative) and
    products of numbers up to 12.  ``rng`` is a ``random.Random``.
    """
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if op == "-" and a < b:
            a, b = b, a
    return f"{a}{op}{b}=", str(_OPS[op](a, b))


def arithmetic_answer(prompt: str) -> str:
    """The answer to a prompt made by :func:`arithmetic_problem`, e.g. "12+7=" -> "19"."""
    body = prompt.strip().rstrip("=")
    for op, fn in _OPS.items():
        left, sep, right = body.partition(op)
        if sep and left.isdigit() and right.isdigit():
            return str(fn(int(left), int(right)))
    raise ValueError(f"{prompt!r} is not an arithmetic prompt like '12+7='")


def _worksheet(rng: random.Random) -> str:
    return " ".join("".join(arithmetic_problem(rng)) for _ in range(rng.randint(4, 8)))


def _story(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    color, animal, place = rng.choice(_COLORS), rng.choice(_ANIMALS), rng.choice(_PLACES)
    sentences = [
        f"{name} has {a} {item}s. {name} finds {b} more. Now {name} has {a + b} {item}s.",
        f"The {color} {animal} sleeps under the {place}.",
        f"{name} sees the {color} {animal} near the {place}.",
        f"Count with {name}: {', '.join(str(a + k) for k in range(5))}.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[:rng.randint(2, 4)])


def generate_corpus(num_docs: int, seed: int) -> list[str]:
    """``num_docs`` documents, about half arithmetic worksheets and half stories."""
    rng = random.Random(seed)
    return [_worksheet(rng) if rng.random() < 0.5 else _story(rng) for _ in range(num_docs)]


def build_default_data(cache_dir: str | None = None, seed: int = 1234, num_docs: int = 20000,
                       vocab_size: int = 320) -> tuple[str, str]:
    """Build (once) the default corpus; return (data_prefix, tokenizer_model_path).

    Writes ``corpus.jsonl``, a sentencepiece tokenizer trained on it with
    digits split, and the tokenized indexed dataset with end-of-document ids,
    into a directory of ``cache_dir`` named by the build's parameters.  The
    build happens in a temporary directory that is renamed into place when
    complete, so concurrent or interrupted builds never leave a partial cache.
    """
    from megalite.data.preprocess import preprocess
    from megalite.data.tokenizer import train_sentencepiece

    cache_dir = cache_dir or DEFAULT_CACHE_DIR
    final = os.path.join(cache_dir, f"v{_FORMAT_VERSION}-seed{seed}-docs{num_docs}-vocab{vocab_size}")
    prefix = os.path.join(final, "corpus_text_document")
    model = os.path.join(final, "tokenizer.model")
    if os.path.isdir(final):
        return prefix, model
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=cache_dir)
    try:
        texts = generate_corpus(num_docs, seed)
        corpus = os.path.join(tmp, "corpus.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
        train_sentencepiece(texts, os.path.join(tmp, "tokenizer"), vocab_size)
        preprocess(corpus, os.path.join(tmp, "corpus"), {"tokenizer_model": os.path.join(tmp, "tokenizer.model")},
                   append_eod=True, progress=False)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return prefix, model
