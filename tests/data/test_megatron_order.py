"""Sample i of every split and blend is the token window Megatron-Core's datasets give for the same request.

Megatron-Core (a test-only dependency) builds its ``GPTDataset``/``BlendedDataset`` through
``BlendedMegatronDatasetBuilder`` on the same data, split, sequence length, seed and sample counts as
:func:`build_train_valid_test_datasets`; every requested sample's ``seq_length + 1`` tokens must be equal.
"""

import numpy as np
import pytest

from megalite.data.gpt_dataset import build_train_valid_test_datasets, split_documents
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from tests.data.megatron_fixture import FIXTURE_PREFIX

pytest.importorskip("megatron.core")
from megatron.core.datasets.blended_dataset import BlendedDataset as MegatronBlendedDataset  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig  # noqa: E402

SEED, SEQ, SPLIT = 1234, 16, "90,8,2"


class _Tokenizer:
    """The few tokenizer fields GPTDatasetConfig reads; token windows do not depend on them."""

    vocab_size = 1 << 15
    eod = 0
    pad = -1
    unique_identifiers = {"class": "megalite-test-stub"}


def _megatron_windows(dataset, count: int) -> list[list[int]]:
    """The first ``count`` samples' raw token windows (``seq_length + 1`` ids) of a Megatron dataset."""
    assert len(dataset) >= count
    windows = []
    for i in range(count):
        if isinstance(dataset, MegatronBlendedDataset):
            part = dataset.datasets[int(dataset.dataset_index[i])]
            j = int(dataset.dataset_sample_index[i])
        else:
            part, j = dataset, i
        assert isinstance(part, MegatronGPTDataset)
        windows.append(part._query_document_sample_shuffle_indices(j)[0].tolist())
    return windows


def _assert_same_order(data_path: list[str], sizes: list[int], tmp_path):
    weights = [float(w) for w in data_path[0::2]] if len(data_path) > 1 else None
    prefixes = data_path[1::2] if len(data_path) > 1 else data_path
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=(prefixes, weights), split=SPLIT,
                              tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=None)
    theirs = BlendedMegatronDatasetBuilder(MegatronGPTDataset, sizes, lambda: True, config).build()
    ours = build_train_valid_test_datasets(data_path, SPLIT, SEQ, SEED, sizes, cache_dir=str(tmp_path / "cache"))
    for name, mine, megatron, size in zip(("train", "valid", "test"), ours, theirs, sizes):
        assert len(mine) == len(megatron) >= size, name
        _assert_same_indices(mine, megatron)
        expected = _megatron_windows(megatron, size)
        got = [mine[i]["tokens"].tolist() for i in range(size)]
        same = sum(a == b for a, b in zip(got, expected))
        assert same == size, f"{name}: {same}/{size} samples equal Megatron-Core's"
    return ours


def _assert_same_indices(mine, megatron):
    """Every GPT dataset's document, sample and shuffle index, and a blend's dataset and dataset-sample index,
    equal Megatron-Core's: values, dtypes and shapes."""
    if isinstance(megatron, MegatronBlendedDataset):
        for ours, theirs in ((mine.dataset_index, megatron.dataset_index),
                             (mine.dataset_sample_index, megatron.dataset_sample_index)):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert np.array_equal(ours, theirs)
        for ours, theirs in zip(mine.datasets, megatron.datasets):
            _assert_same_indices(ours, theirs)
        return
    for ours, theirs in ((mine.doc_idx, megatron.document_index), (mine.sample_idx, megatron.sample_index),
                         (mine.shuffle_idx, megatron.shuffle_index)):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert np.array_equal(ours, theirs)


def _other_dataset(prefix, seed: int, low: int, high: int) -> str:
    """A second Megatron-format dataset whose ids lie in [low, high), so a sample's source shows in its tokens."""
    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for _ in range(150):
            builder.add_document(rng.randint(low, high, size=rng.randint(1, 120)))
    return str(prefix)


def test_one_epoch(tmp_path):
    _assert_same_order([FIXTURE_PREFIX], [100, 10, 5], tmp_path)


@pytest.mark.parametrize("sizes,apart", [([2000, 200, 100], True), ([2100, 70, 45], False)],
                         ids=["final-epoch-apart", "epochs-together"])
def test_several_epochs(tmp_path, sizes, apart):
    # An epoch holds 726 train, 37 valid and 24 test samples.  The first request uses under 80% of every
    # split's final epoch (Megatron shuffles it apart), the second over 80% (shuffled with the others).
    ours = _assert_same_order([FIXTURE_PREFIX], sizes, tmp_path)
    for dataset in ours:
        documents = split_documents(len(dataset.indexed), SPLIT)[["train", "valid", "test"].index(
            dataset.name.rsplit("_", 1)[1])]
        assert dataset.num_epochs > 1
        final = np.sort(np.asarray(dataset.doc_idx[-len(documents):]))
        assert (final.tolist() == documents.tolist()) == apart, dataset.name


def test_one_weighted_prefix_is_a_blend(tmp_path):
    # "1.0 prefix" is a one-dataset blend: its dataset is asked for ceil(2030 * 1.005) = 2041 train samples,
    # 588 of the final epoch's 726 (shuffled with the others), where a bare prefix's 2030 leave 577 (apart).
    _assert_same_order(["1.0", FIXTURE_PREFIX], [2030, 30, 20], tmp_path)


def test_two_way_blend(tmp_path):
    other = _other_dataset(tmp_path / "other", seed=1, low=30000, high=32000)
    _assert_same_order(["0.3", FIXTURE_PREFIX, "0.7", other], [1500, 120, 60], tmp_path)


def test_three_way_blend(tmp_path):
    b = _other_dataset(tmp_path / "b", seed=2, low=30000, high=31000)
    c = _other_dataset(tmp_path / "c", seed=3, low=31000, high=32000)
    _assert_same_order(["2", FIXTURE_PREFIX, "5", b, "3", c], [1200, 100, 50], tmp_path)
