"""The NaN/inf guard: a diverging run stops before the update and never saves non-finite weights;
--skip-nan-iterations skips, then stops; --loss-spike-factor warns with the iteration and samples."""

import math
import re

import pytest
import torch

from megalite.checkpoint import load_model
from megalite.testing import run_distributed
from megalite.training.checkpointing import read_latest
from megalite.training.nan_guard import NanGuard, NanGuardConfig
from tests.training.helpers import read_metrics, tiny_argv


class LossTimes:
    """A GPT forward step whose loss is multiplied by ``factors[iteration]`` in the given iterations."""

    def __init__(self, factors, argv):
        self.factors = factors
        self.per_iteration = int(argv[argv.index("--global-batch-size") + 1]) // (
            int(argv[argv.index("--micro-batch-size") + 1]) * 2)
        self.calls = 0

    def __call__(self, data_iterator, model):
        from megalite.training import gpt

        factor = self.factors.get(self.calls // self.per_iteration + 1, 1.0)
        self.calls += 1
        output, loss_func = gpt.forward_step(data_iterator, model)

        def scaled(out):
            loss, metrics = loss_func(out)
            return loss * factor, {k: v * factor for k, v in metrics.items()}

        return output, scaled


def _pretrain(argv, forward_step):
    from megalite.training import gpt, pretrain

    return pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, forward_step, argv=argv)


def _run_expecting_failure(argv, forward_step=None):
    from megalite.training import gpt

    with pytest.raises(AssertionError) as info:
        run_distributed(_pretrain, 2, argv, forward_step or gpt.forward_step, timeout=180)
    return str(info.value)


def _assert_finite(save_dir):
    model = load_model(save_dir)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_lr_1e6_stops_with_one_error_and_latest_stays_finite(tiny_data, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_data, tmp_path, "--train-iters", "6", "--lr", "1e6", "--lr-warmup-iters", "0",
                     "--save", str(save), "--save-interval", "1")
    text = _run_expecting_failure(argv)
    found = re.findall(r"NonFiniteError: iteration (\d+): the loss is nan and gradients hold nan/inf on ranks "
                       r"\[0, 1\]; stopping before the update", text)
    assert len(found) == 2 and found[0] == found[1], text
    failed_at = int(found[0])
    assert [r["iteration"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, failed_at))
    assert read_latest(str(save)) == failed_at - 1
    _assert_finite(str(save))


def test_skip_nan_iterations_skips_the_update_then_stops(tiny_data, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_data, tmp_path, "--train-iters", "10", "--skip-nan-iterations", "1",
                     "--save", str(save), "--save-interval", "1")
    nan = float("nan")
    text = _run_expecting_failure(argv, LossTimes({4: nan, 7: nan, 8: nan}, argv))
    assert ("iteration 8: the loss is nan and gradients hold nan/inf on ranks [0, 1]; 2 consecutive non-finite "
            "iterations exceed --skip-nan-iterations 1") in text, text
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, 8))
    assert [r["skipped"] for r in records] == [0, 0, 0, 1, 0, 0, 1]
    assert math.isnan(records[3]["loss"]) and math.isfinite(records[4]["loss"])
    # A skipped update does not advance the LR schedule: iteration 5 uses iteration 4's rate.
    assert records[4]["lr"] == records[3]["lr"] != records[2]["lr"]
    assert read_latest(str(save)) == 7
    _assert_finite(str(save))


def test_loss_spike_warning_names_iteration_and_samples(capsys):
    guard = NanGuard(NanGuardConfig(loss_spike_factor=3.0, loss_spike_window=4))
    for iteration, loss in enumerate([2.0, 2.1, 1.9, 2.0, 1.8, 9.0, 2.0], start=1):
        guard.observe_loss(iteration, loss, (iteration - 1) * 8, iteration * 8)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["warning: loss spike at iteration 6: loss 9.0000 is 4.6x the median 1.9500 of the previous 4 "
                     "iterations (--loss-spike-factor 3.0); this batch is global samples [40, 48)"]


def test_bad_guard_flags():
    with pytest.raises(ValueError, match="--skip-nan-iterations must be >= 0, got -1"):
        NanGuardConfig(skip_nan_iterations=-1).validate()
    with pytest.raises(ValueError, match="--loss-spike-factor must be greater than 1, got 0.5"):
        NanGuardConfig(loss_spike_factor=0.5).validate()


def test_all_finite_is_exact():
    """The sum shortcut: nan, +inf, -inf and +inf/-inf together are found; finite values whose sum overflows are
    not taken for inf."""
    from megalite.training.nan_guard import all_finite

    big = torch.full((8,), 3e38)
    assert all_finite(torch.randn(100)) and all_finite(big) and not bool(torch.isfinite(big.sum()))
    for bad in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]):
        x = torch.randn(100)
        x[:len(bad)] = torch.tensor(bad)
        assert not all_finite(x), bad
