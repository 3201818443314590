import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.data.sampler import MicroBatchSampler, build_data_iterator
from megalite.testing import run_distributed


def _rank_batches(total, consumed, mb, gbs, dp):
    return [list(MicroBatchSampler(total, consumed, mb, gbs, r, dp)) for r in range(dp)]


def test_global_batch_independent_of_dp():
    total, gbs, mb = 50, 8, 2
    for dp in (1, 2, 4):
        per_rank = _rank_batches(total, 0, mb, gbs, dp)
        steps = gbs // (mb * dp)
        assert all(len(batches) == 6 * steps for batches in per_rank)
        for g in range(6):
            union = [i for r in range(dp) for b in per_rank[r][g * steps:(g + 1) * steps] for i in b]
            assert union == list(range(g * gbs, (g + 1) * gbs))
        assert len(MicroBatchSampler(total, 0, mb, gbs, 0, dp)) == 6 * steps


def test_resume_through_consumed_samples():
    full = _rank_batches(64, 0, 2, 8, 2)
    resumed = _rank_batches(64, 24, 2, 8, 2)
    steps = 8 // (2 * 2)
    for r in range(2):
        assert resumed[r] == full[r][3 * steps:]
    assert list(MicroBatchSampler(64, 64, 2, 8, 0, 2)) == []


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(global_batch_size=10, micro_batch_size=2, dp_size=4), r"10 is not divisible.*2 x dp size 4 = 8"),
    (dict(consumed_samples=5), "consumed_samples 5"),
    (dict(dp_rank=2, dp_size=2), r"dp_rank 2 is outside \[0, 2\)"),
    (dict(micro_batch_size=0), "micro_batch_size must be positive"),
])
def test_bad_sampler_arguments(kwargs, pattern):
    args = dict(total_samples=100, consumed_samples=0, micro_batch_size=2, global_batch_size=8,
                dp_rank=0, dp_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        MicroBatchSampler(**args)


def _dataset(prefix):
    rng = np.random.RandomState(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(20):
            builder.add_document(rng.randint(0, 300, size=rng.randint(1, 9)))
    return GPTDataset(IndexedDataset(prefix), np.arange(20), num_samples=32, seq_length=6, seed=0)


def test_iterator_collates_micro_batches(tmp_path):
    ds = _dataset(str(tmp_path / "ds"))
    sampler = MicroBatchSampler(32, 8, 2, 8, 1, 2)
    batches = list(build_data_iterator(ds, sampler))
    assert len(batches) == len(sampler) == 6
    for batch, indices in zip(batches, sampler):
        assert set(batch) == {"tokens"} and batch["tokens"].dtype == torch.int64
        assert batch["tokens"].tolist() == [ds[i]["tokens"].tolist() for i in indices]
    with pytest.raises(ValueError, match=f"covers {len(ds) + 8} samples but the dataset holds {len(ds)}"):
        build_data_iterator(ds, MicroBatchSampler(len(ds) + 8, 0, 2, 8, 0, 2))


def _gathered_global_batches(prefix):
    topo = topology.initialize()
    group = topology.resolve_group(None, "dp")
    dp_rank, dp_size = topology.group_rank(group), topology.group_size(group)
    ds = GPTDataset(IndexedDataset(prefix), np.arange(20), num_samples=32, seq_length=6, seed=0)
    sampler = MicroBatchSampler(32, 0, 2, 8, dp_rank, dp_size)
    out = []
    steps = sampler.num_micro_batches
    batches = list(build_data_iterator(ds, sampler))
    for g in range(len(batches) // steps):
        local = torch.cat([b["tokens"] for b in batches[g * steps:(g + 1) * steps]])
        parts = [torch.empty_like(local) for _ in range(dp_size)]
        dist.all_gather(parts, local, group=topo.dp.group)
        out.append(torch.cat(parts))
    return torch.stack(out).tolist()


def test_global_batches_match_single_rank_on_two_ranks(tmp_path):
    prefix = str(tmp_path / "ds")
    ds = _dataset(prefix)
    reference = torch.stack([torch.stack([ds[i]["tokens"] for i in range(g * 8, (g + 1) * 8)])
                             for g in range(4)])
    results = run_distributed(_gathered_global_batches, 2, prefix, timeout=120)
    for gathered in results:
        assert gathered == reference.tolist()
