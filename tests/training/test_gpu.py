"""megalite's NCCL paths at world size 1, on one GPU (skipped without one).

One launch each: DDP gradient buckets and ZeRO-1 (the distributed optimizer) at dp=1 on NCCL train the
same losses as the CPU run; a checkpoint saved from GPU tensors and loaded back resumes to the same
losses as the uninterrupted GPU run."""

import pytest
import torch

from tests.training.helpers import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

FLAGS = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")


def _losses(records):
    return [r["loss"] for r in records if "loss" in r]


def test_one_gpu_nccl_trains_like_the_cpu_and_resumes(tiny_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _, cpu = train(tiny_data, tmp_path / "cpu", 1, *FLAGS, iters=6)
    _, gpu = train(tiny_data, tmp_path / "gpu", 1, *FLAGS, iters=6, backend="nccl")
    assert len(_losses(gpu)) == 6
    assert _losses(gpu) == pytest.approx(_losses(cpu), rel=1e-4)  # fp32 on both; the kernels differ

    stopped, _ = train(tiny_data, tmp_path / "first", 1, *FLAGS, "--save", ckpt, "--exit-interval", "3", iters=6,
                       backend="nccl")
    assert stopped == 3
    _, resumed = train(tiny_data, tmp_path / "second", 1, *FLAGS, "--load", ckpt, iters=6, backend="nccl")
    assert [r["iteration"] for r in resumed if "loss" in r] == [4, 5, 6]
    assert _losses(resumed) == pytest.approx(_losses(gpu)[3:], rel=1e-5)
