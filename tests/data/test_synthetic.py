import os
import random

import pytest

from megalite.data import synthetic
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.synthetic import arithmetic_answer, arithmetic_problem, build_default_data, generate_corpus
from megalite.data.tokenizer import build_tokenizer


def test_arithmetic_problems_are_right():
    rng = random.Random(0)
    ops = set()
    for _ in range(500):
        prompt, answer = arithmetic_problem(rng)
        left, op, right = next((prompt[:-1].partition(o) for o in "+-*" if o in prompt))
        ops.add(op)
        a, b = int(left), int(right)
        assert prompt.endswith("=") and int(answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert int(answer) >= 0
        assert arithmetic_answer(prompt) == answer
    assert ops == {"+", "-", "*"}
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        arithmetic_answer("seven plus two=")


def test_corpus_is_deterministic_and_mixed():
    docs = generate_corpus(200, seed=5)
    assert docs == generate_corpus(200, seed=5) and docs != generate_corpus(200, seed=6)
    sheets = [d for d in docs if "=" in d and " has " not in d]
    assert 50 < len(sheets) < 150
    for problem in sheets[0].split():
        assert arithmetic_answer(problem.split("=")[0] + "=") == problem.split("=")[1]


def test_default_data_builds_once(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    prefix, model = build_default_data(cache, seed=3, num_docs=1500, vocab_size=200)
    tok = build_tokenizer(model)
    ds = IndexedDataset(prefix)
    assert len(ds) == 1500 and max(int(ds[i].max()) for i in range(len(ds))) < tok.vocab_size <= 200
    docs = generate_corpus(1500, seed=3)
    assert tok.detokenize(ds[7]) == docs[7] and int(ds[7][-1]) == tok.eod
    for piece in (tok._sp.id_to_piece(i) for i in tok.tokenize("1234+567=1801")):
        assert not any(c.isdigit() for c in piece) or piece.strip("▁").isdigit() and len(piece.strip("▁")) == 1
    assert os.listdir(cache) == [os.path.basename(os.path.dirname(prefix))]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("default data rebuilt although cached")

    monkeypatch.setattr(synthetic, "generate_corpus", no_rebuild)
    assert build_default_data(cache, seed=3, num_docs=1500, vocab_size=200) == (prefix, model)
