"""Checkpoint files: round trip, and a crash at any point of a save keeps the last good checkpoint."""

import os

import pytest
import torch

from megalite.training.checkpointing import iteration_dir, load_checkpoint, read_latest, save_checkpoint


class _Broken(torch.nn.Linear):
    """A module whose state cannot be collected, like a crash in the middle of a save."""

    def state_dict(self, *args, **kwargs):
        raise RuntimeError("crash while saving")


def _model(value):
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def test_round_trip_restores_model_rng_and_position(tmp_path):
    save_checkpoint(str(tmp_path), 3, [_model(1.0)], None, None, consumed_samples=48, layout={"tp": 1})
    expected = torch.rand(3)
    restored = _model(0.0)
    assert load_checkpoint(str(tmp_path), [restored], None, None, layout={"tp": 1})[:2] == (3, 48)
    assert torch.equal(restored.weight, torch.ones(2, 2))
    assert torch.equal(torch.rand(3), expected)


def test_crash_while_writing_keeps_last_good_checkpoint(tmp_path):
    save_checkpoint(str(tmp_path), 2, [_model(2.0)], None, None, consumed_samples=16)
    with pytest.raises(RuntimeError, match="crash while saving"):
        save_checkpoint(str(tmp_path), 4, [_Broken(2, 2)], None, None, consumed_samples=32)
    assert read_latest(str(tmp_path)) == 2
    assert not os.path.exists(iteration_dir(str(tmp_path), 4))
    restored = _model(0.0)
    assert load_checkpoint(str(tmp_path), [restored], None, None)[:2] == (2, 16)
    assert torch.equal(restored.weight, torch.full((2, 2), 2.0))


def test_crash_while_publishing_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(str(tmp_path), 2, [_model(2.0)], None, None, consumed_samples=16)

    def fail(*args):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk went away"):
        save_checkpoint(str(tmp_path), 4, [_model(4.0)], None, None, consumed_samples=32)
    monkeypatch.undo()
    assert read_latest(str(tmp_path)) == 2
    assert load_checkpoint(str(tmp_path), [_model(0.0)], None, None)[:2] == (2, 16)


def test_saving_the_same_iteration_again_replaces_it(tmp_path):
    save_checkpoint(str(tmp_path), 2, [_model(2.0)], None, None, consumed_samples=16)
    save_checkpoint(str(tmp_path), 2, [_model(5.0)], None, None, consumed_samples=16)
    restored = _model(0.0)
    load_checkpoint(str(tmp_path), [restored], None, None)
    assert torch.equal(restored.weight, torch.full((2, 2), 5.0))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest"]


def test_missing_and_corrupt_pointer(tmp_path):
    assert load_checkpoint(str(tmp_path / "nothing"), [_model(0.0)], None, None)[:2] == (0, 0)
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(ValueError, match="is corrupt: 'garbage' is not an iteration number"):
        load_checkpoint(str(tmp_path), [_model(0.0)], None, None)
