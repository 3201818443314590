"""One peak-FLOP table: the trainer's MFU and the planner read the same ``megalite.hardware`` profiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megalite.hardware import load_hardware, profile_for_device, profile_names
from megalite.training.trainer import Trainer


@pytest.mark.parametrize("device, profile", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA B200", "b200"),
])
def test_a_cuda_device_name_picks_its_profile(device, profile):
    assert profile_for_device(device) == load_hardware(profile)


def test_an_unnamed_device_has_no_profile():
    assert profile_for_device("NVIDIA GeForce GTX 1080") is None
    assert {"h100", "h200", "a100-80gb", "b200", "cpu"} <= set(profile_names())


def test_trainer_mfu_divides_by_the_profiles_peak():
    args = SimpleNamespace(seq_length=128, log_throughput=True, bf16=True, fp16=False)
    b200 = load_hardware("b200")
    trainer = SimpleNamespace(args=args, flops_per_token=1e9, topo=SimpleNamespace(world_size=4), hardware=b200)
    values = Trainer.throughput(trainer, seconds_per_iter=0.5, samples_per_iter=64)
    per_device_flops = 1e9 * 64 * 128 / 0.5 / 4
    assert values["tflops"] == pytest.approx(per_device_flops / 1e12, rel=1e-12)
    assert values["mfu"] == pytest.approx(per_device_flops / 2250e12, rel=1e-12)
    trainer.hardware = None
    assert "mfu" not in Trainer.throughput(trainer, seconds_per_iter=0.5, samples_per_iter=64)
