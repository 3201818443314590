"""Preprocessed SFT data (tokens and loss mask as two Megatron indexed datasets) gives the samples the jsonl
gives, the jsonl's rendering is cached, and a bad prefix fails with one clear error."""

import hashlib
import json
import os

import numpy as np
import pytest

from megalite.context_parallel import prepare_batch
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.data.sft import ChatRenderer
from megalite.data.sft_indexed import MASK_SUFFIX, TEXT_SUFFIX, cache_description, load_documents, read_documents
from tests.data.sft_fixtures import CONVERSATION, chat_tokenizer
from tests.inference.chat_fixtures import trl_template

SEQ = 128


def _preprocess(*argv):
    from tools.preprocess_data import main

    return main(list(argv))


def _data(tmp_path):
    """Eight conversations (multi-turn, tool, prompt/completion, one longer than a sample) and a Qwen tokenizer."""
    system = {"role": "system", "content": "be brief."}
    records = [{"messages": CONVERSATION}, {"prompt": "hi", "completion": "hello."},
               {"messages": [system, {"role": "user", "content": "one?"}, {"role": "assistant", "content": "1."}]},
               {"messages": CONVERSATION[:3]}, {"prompt": [system, {"role": "user", "content": "two?"}],
                                                "completion": "2."},
               {"messages": [{"role": "user", "content": "a " * 40}, {"role": "assistant", "content": "long."}]},
               {"messages": CONVERSATION[3:]}, {"prompt": "ok?", "completion": "ok."}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = chat_tokenizer(tmp_path, "qwen2_5", trl_template("qwen2_5_training"))
    return str(path), tokenizer.path


def _args(data, tokenizer, *extra):
    from megalite.training.flags import parse_args
    from megalite.training.sft import add_sft_flags, prepare_sft_data

    args = parse_args(["--sft-data", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
                       "--split", "60,40,0", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
                       "--global-batch-size", "1", "--train-iters", "1", *extra], add_sft_flags)
    prepare_sft_data(args)
    return args


def _samples(args):
    """Every packed sample of the train and valid splits with its positions and label mask, as plain lists."""
    from megalite.training.sft import sft_datasets_provider

    out = []
    for dataset in sft_datasets_provider(args, [1, 1, 0])[:2]:
        for sample in (dataset[i] for i in range(len(dataset.samples))):
            batch = prepare_batch(sample["tokens"][None], assistant_mask=sample["assistant_mask"][None],
                                  documents=sample["document_ids"][None])
            out.append({**{k: v.tolist() for k, v in sample.items()},
                        "position_ids": batch["position_ids"].tolist(), "loss_mask": batch["loss_mask"].tolist()})
    return out


def test_preprocessed_prefix_and_cache_give_the_jsonl_samples(tmp_path, monkeypatch):
    data, tokenizer = _data(tmp_path)
    want = _samples(_args(data, tokenizer))
    assert len(want) >= 3 and any(max(s["document_ids"]) >= 2 for s in want)  # several packed conversations

    prefix = str(tmp_path / "pre" / "chats")
    assert _preprocess("--chat", "--input", data, "--output-prefix", prefix, "--tokenizer-type",
                       "HuggingFaceTokenizer", "--tokenizer-model", tokenizer) == 0
    rendered = load_documents(data, ChatRenderer(_tok(tokenizer)))
    assert read_documents(prefix) == rendered  # one document per conversation, whole (not truncated)
    assert len(rendered) == 8 and len(rendered[5][0]) > SEQ + 1
    assert _samples(_args(prefix, tokenizer)) == want

    calls = []
    render = ChatRenderer.render
    monkeypatch.setattr(ChatRenderer, "render", lambda self, m: calls.append(1) or render(self, m))
    cache = str(tmp_path / "cache")
    assert _samples(_args(data, tokenizer, "--data-cache-path", cache)) == want
    assert len(calls) == 8
    monkeypatch.setattr(ChatRenderer, "render", lambda self, m: pytest.fail("rendered despite the cache"))
    assert _samples(_args(data, tokenizer, "--data-cache-path", cache)) == want
    # Other content is another cache entry: rendered again.
    with open(data, "a") as handle:
        handle.write(json.dumps({"prompt": "new?", "completion": "yes."}) + "\n")
    monkeypatch.setattr(ChatRenderer, "render", lambda self, m: calls.append(1) or render(self, m))
    grown = _samples(_args(data, tokenizer, "--data-cache-path", cache))
    assert len(calls) == 8 + 9
    # A damaged entry (a truncated mask file) is rendered again and replaced.
    key = hashlib.md5(cache_description(data, ChatRenderer(_tok(tokenizer))).encode()).hexdigest()
    os.truncate(os.path.join(cache, f"{key}-SFT{MASK_SUFFIX}.bin"), 1)
    assert _samples(_args(data, tokenizer, "--data-cache-path", cache)) == grown
    assert _samples(_args(data, tokenizer, "--data-cache-path", cache)) == grown
    assert len(calls) == 8 + 9 + 9


def _tok(path):
    from megalite.data.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(path)


@pytest.mark.slow  # importing Megatron-Core takes seconds
def test_megatron_reads_the_preprocessed_files(tmp_path):
    """Both files are plain Megatron indexed datasets with the same document lengths (Megatron-Core reads them)."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    data, tokenizer = _data(tmp_path)
    prefix = str(tmp_path / "chats")
    _preprocess("--chat", "--input", data, "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", tokenizer)
    mine = read_documents(prefix)
    text, mask = indexed.IndexedDataset(prefix + TEXT_SUFFIX), indexed.IndexedDataset(prefix + MASK_SUFFIX)
    assert mask.index.dtype == np.uint8 and len(text) == len(mask) == len(mine)
    assert [(text[i].tolist(), mask[i].tolist()) for i in range(len(mine))] == mine


def test_bad_prefix_and_flags(tmp_path):
    data, tokenizer = _data(tmp_path)
    prefix = str(tmp_path / "chats")
    with pytest.raises(ValueError, match=f"--sft-data {prefix}: neither a jsonl file nor a preprocessed prefix"):
        _args(prefix, tokenizer)
    _preprocess("--chat", "--input", data, "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", tokenizer)
    documents = load_documents(data, ChatRenderer(_tok(tokenizer)))
    lengths, top = [len(ids) for ids, _ in documents], max(max(ids) for ids, _ in documents)
    assert read_documents(prefix, vocab_size=top + 1) == documents
    with pytest.raises(ValueError, match=f"token id {top} is outside the tokenizer's vocabulary of {top} "):
        read_documents(prefix, vocab_size=top)
    for suffix in (".bin", ".idx"):
        os.rename(prefix + MASK_SUFFIX + suffix, str(tmp_path / ("kept" + suffix)))
    with pytest.raises(ValueError, match=r"the loss mask .*chats_loss_mask_document.idx is missing"):
        _args(prefix, tokenizer)
    with IndexedDatasetBuilder(prefix + MASK_SUFFIX, np.uint8) as builder:
        builder.add_document([0, 1, 1])
    with pytest.raises(ValueError, match="1 loss-mask documents for 8 token documents"):
        _args(prefix, tokenizer)
    with IndexedDatasetBuilder(prefix + MASK_SUFFIX, np.uint8) as builder:
        for i, n in enumerate(lengths):
            builder.add_document([1] * (n + (i == 3)))
    with pytest.raises(ValueError, match=f"document 3 has {lengths[3] + 1} loss-mask values for {lengths[3]} tokens"):
        _args(prefix, tokenizer)
    with IndexedDatasetBuilder(prefix + MASK_SUFFIX, np.uint8) as builder:
        for n in lengths:
            builder.add_document([2] * n)
    with pytest.raises(ValueError, match="loss-mask values must be 0 or 1, found 2"):
        _args(prefix, tokenizer)
    with pytest.raises(ValueError, match="--chat renders whole conversations in one process; drop --append-eod"):
        _preprocess("--chat", "--input", data, "--output-prefix", prefix, "--append-eod", "--tokenizer-type",
                    "HuggingFaceTokenizer", "--tokenizer-model", tokenizer)
    with pytest.raises(ValueError, match="--chat-template needs --chat"):
        _preprocess("--input", data, "--output-prefix", prefix, "--chat-template", "t.jinja")
