import json
import os
import subprocess
import sys

import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.synthetic import generate_corpus
from megalite.data.tokenizer import ByteTokenizer, SentencePieceTokenizer
from tests.data.megatron_fixture import FIXTURE_DIR

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def corpus(tmp_path):
    texts = generate_corpus(300, seed=2) + ["", "naïve café ✓"]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t, "title": f"doc {i}"}) + "\n" for i, t in enumerate(texts)))
    return str(path), texts


def test_preprocess_matches_megatron_byte_for_byte(tmp_path):
    """Megatron's interface on the fixture's jsonl and HF tokenizer gives the files Megatron-Core wrote."""
    done = _tool("preprocess_data.py", "--input", os.path.join(FIXTURE_DIR, "docs.jsonl"), "--json-keys", "text",
                 "--output-prefix", str(tmp_path / "docs"), "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", os.path.join(FIXTURE_DIR, "hf_tokenizer"), "--append-eod", "--workers", "2")
    assert done.returncode == 0, done.stderr
    for suffix in (".bin", ".idx"):
        with open(tmp_path / f"docs_text_document{suffix}", "rb") as mine, \
                open(os.path.join(FIXTURE_DIR, "docs_text_document" + suffix), "rb") as theirs:
            assert mine.read() == theirs.read(), suffix
    assert "tokenizing: 100%" in done.stderr and "28.5k/28.5k" in done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("207 documents, 12616 tokens in ") and "tokens/s); wrote " in summary
    assert f"{tmp_path / 'docs_text_document'}.bin/.idx" in summary


def test_train_tokenizer_then_preprocess_keys_and_text(tmp_path, corpus):
    """Two json keys give two datasets; plain text by line and by blank-line block."""
    path, texts = corpus
    done = _tool("train_tokenizer.py", "--input", path, "--output-prefix", str(tmp_path / "tok"),
                 "--vocab-size", "150")
    assert done.returncode == 0, done.stderr
    tok = SentencePieceTokenizer(str(tmp_path / "tok.model"))
    prefix = str(tmp_path / "out" / "corpus")
    done = _tool("preprocess_data.py", "--input", path, "--output-prefix", prefix, "--json-keys", "text", "title",
                 "--tokenizer-model", str(tmp_path / "tok.model"), "--append-eod")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{len(texts)} documents")
    text_ds, title_ds = IndexedDataset(prefix + "_text_document"), IndexedDataset(prefix + "_title_document")
    assert len(text_ds) == len(title_ds) == len(texts)
    for i, text in enumerate(texts):
        assert text_ds[i].tolist() == tok.tokenize(text) + [tok.eod]
        assert title_ds[i].tolist() == tok.tokenize(f"doc {i}") + [tok.eod]
    raw = tmp_path / "raw.txt"
    raw.write_text("first line\nsecond line\n\n\nthird\n")
    for mode, expected in (("lines", ["first line", "second line", "third"]),
                           ("blocks", ["first line\nsecond line", "third"])):
        done = _tool("preprocess_data.py", "--input", str(raw), "--input-format", mode, "--output-prefix",
                     str(tmp_path / mode), "--tokenizer-type", "ByteTokenizer")
        assert done.returncode == 0, done.stderr
        ds = IndexedDataset(str(tmp_path / f"{mode}_text_document"))
        assert [ds[i].tolist() for i in range(len(ds))] == [ByteTokenizer().tokenize(t) for t in expected]


def test_preprocess_reports_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    done = _tool("preprocess_data.py", "--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                 "--tokenizer-type", "ByteTokenizer", "--workers", "2")
    assert done.returncode == 2 and "bad.jsonl:2: expected an object with a string field 'text'" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]
    done = _tool("preprocess_data.py", "--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path))
    assert done.returncode == 2 and f"error: {tmp_path} holds no Hugging Face tokenizer" in done.stderr
    done = _tool("preprocess_data.py", "--input", str(bad), "--output-prefix", str(tmp_path / "x"),
                 "--tokenizer-type", "WordPiece")
    assert done.returncode == 2 and done.stderr.startswith("error: argument --tokenizer-type: invalid choice")
    assert len(done.stderr.strip().splitlines()) == 1
    done = _tool("train_tokenizer.py", "--input", str(tmp_path / "none.txt"), "--output-prefix",
                 str(tmp_path / "t"), "--vocab-size", "50")
    assert done.returncode == 2 and "none.txt" in done.stderr
