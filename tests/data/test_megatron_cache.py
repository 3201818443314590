"""Megatron-Core reads the index cache megalite writes and megalite reads Megatron-Core's; --mock-data gives
MockGPTDataset's samples.

The peer is Megatron-Core itself (a test-only dependency): its ``BlendedMegatronDatasetBuilder`` builds the
same request on the shared fixture, or on its mock documents, with its own NullTokenizer.
"""

import os
from types import SimpleNamespace

import numpy as np
import pytest

from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.megatron_cache import hf_tokenizer_identifiers, null_tokenizer_identifiers
from megalite.data.mock import build_mock_datasets
from tests.data.megatron_fixture import FIXTURE_PREFIX
from tests.data.test_megatron_order import _assert_same_indices, _megatron_windows, _Tokenizer

pytest.importorskip("megatron.core")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402

SEED, SPLIT, VOCAB = 1234, "90,8,2", 64


HF_TOKENIZER = os.path.join(os.path.dirname(FIXTURE_PREFIX), "hf_tokenizer")


def _null_tokenizer():
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    return build_tokenizer(SimpleNamespace(tokenizer_type="NullTokenizer", vocab_size=VOCAB, tokenizer_metadata=None))


def _hf_tokenizer():
    """Megatron-LM's HuggingFaceTokenizer for the fixture's tokenizer, its other flags at Megatron-LM's defaults."""
    pytest.importorskip("transformers")
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    return build_tokenizer(SimpleNamespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=HF_TOKENIZER, vocab_file=None, merge_file=None,
        tokenizer_special_tokens=None, tokenizer_hf_use_fast=False, trust_remote_code=False,
        tokenizer_hf_include_special_tokens=False, tokenizer_metadata=None, vocab_size=None))


TOKENIZERS = {"null": (_null_tokenizer, lambda: null_tokenizer_identifiers(VOCAB)),
              "huggingface": (_hf_tokenizer, lambda: hf_tokenizer_identifiers(HF_TOKENIZER))}


def _megatron(sizes, seq, tokenizer, cache=None, prefix=FIXTURE_PREFIX, cls=MegatronGPTDataset):
    blend = None if prefix is None else ([prefix], None)
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=seq, blend=blend, split=SPLIT, tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              path_to_cache=cache)
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def _files(directory):
    return {name: os.stat(os.path.join(directory, name)).st_mtime_ns for name in os.listdir(directory)}


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_megatron_loads_the_cache_megalite_writes(tmp_path, kind):
    cache, sizes = str(tmp_path / "cache"), [300, 20, 10]
    megatron_tokenizer, identifiers = TOKENIZERS[kind]
    tokenizer = megatron_tokenizer()
    ours = build_train_valid_test_datasets([FIXTURE_PREFIX], SPLIT, 16, SEED, sizes, cache_dir=cache,
                                           tokenizer=identifiers())
    written = _files(cache)
    assert len(written) == 3 * 5  # per split: Megatron's four files and megalite's record
    theirs = _megatron(sizes, 16, tokenizer, cache)
    assert _files(cache) == written  # nothing built or written again
    for mine, megatron in zip(ours, theirs):
        assert megatron.unique_description == mine.description
        assert isinstance(megatron.shuffle_index, np.memmap)  # loaded from the cache, as Megatron logs it
        assert len(mine) == len(megatron)
        _assert_same_indices(mine, megatron)


def test_megalite_loads_the_cache_megatron_writes(tmp_path):
    cache, sizes = str(tmp_path / "cache"), [900, 50, 30]
    theirs = _megatron(sizes, 16, _Tokenizer(), cache)  # a tokenizer megalite cannot name: found by the rest
    written = _files(cache)
    ours = build_train_valid_test_datasets([FIXTURE_PREFIX], SPLIT, 16, SEED, sizes, cache_dir=cache)
    assert _files(cache) == written
    for mine, megatron, split in zip(ours, theirs, ("train", "valid", "test")):
        assert isinstance(mine.shuffle_idx, np.memmap)
        name = mine.shuffle_idx.filename
        assert os.path.dirname(name) == cache and f"-GPTDataset-{split}-" in name
        _assert_same_indices(mine, megatron)
        count = min(len(mine), 200)
        assert [mine[i]["tokens"].tolist() for i in range(count)] == _megatron_windows(megatron, count)
    other = build_train_valid_test_datasets([FIXTURE_PREFIX], SPLIT, 16, SEED + 1, sizes, cache_dir=cache)
    assert not isinstance(other[0].shuffle_idx, np.memmap)  # another seed is another dataset: built afresh
    assert len(_files(cache)) == len(written) + 3 * 5


def test_mock_data_equals_megatron_mock_dataset(tmp_path):
    """--mock-data with NullTokenizer: every index and the first samples of each split equal MockGPTDataset's
    (Megatron splits the mock documents evenly, whatever --split says)."""
    tokenizer, seq, sizes = _null_tokenizer(), 2048, [200, 40, 20]
    theirs = _megatron(sizes, seq, tokenizer, prefix=None, cls=MockGPTDataset)
    ours = build_mock_datasets(seq, SEED, sizes, vocab_size=tokenizer.vocab_size, eod=tokenizer.eod)
    for mine, megatron, size in zip(ours, theirs, sizes):
        assert isinstance(megatron, MockGPTDataset) and len(mine) == len(megatron)
        _assert_same_indices(mine, megatron)
        assert [mine[i]["tokens"].tolist() for i in range(size)] == _megatron_windows(megatron, size)


def test_megatron_default_cache_beside_the_data_is_read(tmp_path):
    """Without --data-cache-path Megatron-LM caches in {prefix}/cache/GPTDataset_indices; megalite reads it."""
    from tests.data.test_megatron_order import _other_dataset

    prefix = _other_dataset(tmp_path / "docs", seed=4, low=0, high=1000)
    sizes = [400, 30, 20]
    theirs = _megatron(sizes, 8, _Tokenizer(), cache=None, prefix=prefix)
    default = os.path.join(prefix, "cache", "GPTDataset_indices")
    written = _files(default)
    assert len(written) == 3 * 4
    ours = build_train_valid_test_datasets([prefix], SPLIT, 8, SEED, sizes)
    assert _files(default) == written
    for mine, megatron in zip(ours, theirs):
        assert isinstance(mine.shuffle_idx, np.memmap) and os.path.dirname(mine.shuffle_idx.filename) == default
        _assert_same_indices(mine, megatron)


@pytest.mark.parametrize("kind,argv", [("null", ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]),
                                       ("huggingface", ["--tokenizer-type", "HuggingFaceTokenizer",
                                                        "--tokenizer-model", HF_TOKENIZER])])
def test_the_trainer_names_its_tokenizer_as_megatron_does(kind, argv):
    from megalite.training.data_checks import check_data
    from megalite.training.flags import parse_args
    from megalite.training.gpt import megatron_tokenizer_identifiers

    args = parse_args(argv + ["--mock-data"])
    check_data(args)
    assert dict(megatron_tokenizer_identifiers(args)) == dict(TOKENIZERS[kind][0]().unique_identifiers)


def _blend_sources(tmp_path):
    from tests.data.test_megatron_order import _other_dataset

    return [FIXTURE_PREFIX, _other_dataset(tmp_path / "b", seed=2, low=30000, high=31000),
            _other_dataset(tmp_path / "c", seed=3, low=31000, high=32000)]


def _megatron_blend(prefixes, weights, sizes, tokenizer, cache, monkeypatch):
    """Megatron-Core's blend; its BlendedDataset asks for the rank before building a cache it misses, so
    this process (one without a process group) is rank 0 for that call."""
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=16, blend=(prefixes, weights), split=SPLIT,
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=cache)
    return BlendedMegatronDatasetBuilder(MegatronGPTDataset, sizes, lambda: True, config).build()


# 0.3, 0.5 and 0.2 of 301 round up to 91 + 151 + 61: Megatron's blend holds 303 samples, named by that size.
BLEND_WEIGHTS, BLEND_SIZES = [3.0, 5.0, 2.0], [301, 33, 17]


def test_megalite_loads_the_blend_cache_megatron_writes(tmp_path, monkeypatch):
    """Megatron-Core's BlendedDataset caches (dataset_index, dataset_sample_index) and its GPTDatasets' arrays;
    megalite memory-maps every one of them and builds nothing."""
    from megalite.data import gpt_dataset

    cache, prefixes = str(tmp_path / "cache"), _blend_sources(tmp_path)
    theirs = _megatron_blend(prefixes, BLEND_WEIGHTS, BLEND_SIZES, _Tokenizer(), cache, monkeypatch)
    written = _files(cache)
    assert sum("-BlendedDataset-" in name for name in written) == 3 * 3  # description and two arrays per split

    def no_build(*args, **kwargs):
        raise AssertionError("megalite rebuilt indices Megatron-Core had cached")

    monkeypatch.setattr(gpt_dataset, "_blend_choice", no_build)
    monkeypatch.setattr(gpt_dataset.GPTDataset, "_build_doc_idx", no_build)
    data_path = [part for w, p in zip(BLEND_WEIGHTS, prefixes) for part in (str(w), p)]
    ours = build_train_valid_test_datasets(data_path, SPLIT, 16, SEED, BLEND_SIZES, cache_dir=cache)
    assert _files(cache) == written
    for mine, megatron, split in zip(ours, theirs, ("train", "valid", "test")):
        assert isinstance(mine.dataset_index, np.memmap)
        assert f"-BlendedDataset-{split}-dataset_index.npy" in mine.dataset_index.filename
        _assert_same_indices(mine, megatron)
        assert [mine[i]["tokens"].tolist() for i in range(len(mine))] == _megatron_windows(megatron, len(mine))
    assert len(ours[0]) == 303


def test_megatron_loads_the_blend_cache_megalite_writes(tmp_path, monkeypatch):
    cache, prefixes = str(tmp_path / "cache"), _blend_sources(tmp_path)
    data_path = [part for w, p in zip(BLEND_WEIGHTS, prefixes) for part in (str(w), p)]
    ours = build_train_valid_test_datasets(data_path, SPLIT, 16, SEED, BLEND_SIZES, cache_dir=cache,
                                           tokenizer=null_tokenizer_identifiers(VOCAB))
    written = _files(cache)
    assert len(written) == 3 * (3 * 5 + 4)  # per split: three datasets' five files, the blend's four
    theirs = _megatron_blend(prefixes, BLEND_WEIGHTS, BLEND_SIZES, _null_tokenizer(), cache, monkeypatch)
    assert _files(cache) == written  # Megatron-Core built and wrote nothing
    for mine, megatron, split in zip(ours, theirs, ("train", "valid", "test")):
        assert megatron.unique_description == mine.description
        assert isinstance(megatron.dataset_index, np.memmap)
        _assert_same_indices(mine, megatron)
