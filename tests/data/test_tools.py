import json
import os
import subprocess
import sys

import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.synthetic import generate_corpus
from megalite.data.tokenizer import ByteTokenizer, SentencePieceTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def corpus(tmp_path):
    texts = generate_corpus(300, seed=2) + ["", "naïve café ✓"]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return str(path), texts


def test_train_tokenizer_then_preprocess_with_workers(tmp_path, corpus):
    path, texts = corpus
    done = _tool("train_tokenizer.py", "--input", path, "--model-prefix", str(tmp_path / "tok"),
                 "--vocab-size", "150")
    assert done.returncode == 0, done.stderr
    tok = SentencePieceTokenizer(str(tmp_path / "tok.model"))
    prefix = str(tmp_path / "out" / "corpus")
    done = _tool("preprocess_data.py", "--input", path, "--output-prefix", prefix,
                 "--tokenizer-model", str(tmp_path / "tok.model"), "--workers", "2", "--append-eod")
    assert done.returncode == 0, done.stderr
    assert f"{len(texts)} documents" in done.stderr
    ds = IndexedDataset(prefix)
    assert len(ds) == len(texts)
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
    ds.check_vocab(tok.vocab_size)


def test_preprocess_byte_tokenizer_without_eod(tmp_path, corpus):
    path, texts = corpus
    prefix = str(tmp_path / "bytes")
    done = _tool("preprocess_data.py", "--input", path, "--output-prefix", prefix, "--tokenizer", "byte")
    assert done.returncode == 0, done.stderr
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [ByteTokenizer().tokenize(t) for t in texts]


def test_preprocess_reports_bad_lines_and_missing_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    done = _tool("preprocess_data.py", "--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                 "--tokenizer", "byte", "--workers", "2")
    assert done.returncode == 2 and "bad.jsonl:2: expected an object with a string field 'text'" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]
    done = _tool("train_tokenizer.py", "--input", str(tmp_path / "none.txt"), "--model-prefix",
                 str(tmp_path / "t"), "--vocab-size", "50")
    assert done.returncode == 2 and "none.txt" in done.stderr
