"""A checkpoint whose JSON state was edited and its manifest updated to match passes the hash checks, so its
fields are checked too: each bad field is one ValueError naming the file and the field, on every load path
(not a raw TypeError, and not silently accepted)."""

import json
import os
import shutil

import pytest
import torch

from megalite.checkpoint import load_model, read_checkpoint_info
from megalite.training.checkpointing import checkpoint_info, load_checkpoint, save_checkpoint
from megalite.training.lr_schedule import LRScheduleConfig, LRScheduler, schedule_settings
from tests.checkpoint.test_bad_input import small_gpt, rehash


def _scheduler(model):
    settings = schedule_settings(LRScheduleConfig(lr_decay_style="cosine", lr_warmup_iters=1, lr_decay_iters=10),
                                 lr=1.0, min_lr=0.1, weight_decay=0.0, global_batch_size=1, train_iters=10)
    return LRScheduler(torch.optim.SGD(model.parameters(), lr=1.0), settings)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("edited") / "base")
    model = small_gpt()
    save_checkpoint(save, 1, [model], None, _scheduler(model), consumed_samples=8)
    return save


def edit_state(saved, tmp_path, name, field, value):
    save = str(tmp_path / "run")
    shutil.copytree(saved, save)
    directory = os.path.join(save, "iter_0000001")
    path = os.path.join(directory, name)
    with open(path) as f:
        state = json.load(f)
    state[field] = value
    with open(path, "w") as f:
        json.dump(state, f)
    rehash(directory, name)
    return save, path


def _load_all(save):
    model = small_gpt(seed=3)
    return load_checkpoint(save, [model], None, _scheduler(model))


@pytest.mark.parametrize("field, value, problem", [
    ("iteration", "1", "is '1', not a count"),
    ("iteration", -3, "is -3, not a count"),
    ("world_size", 0, "is 0, not a positive count"),
    ("config", 5, "is 5, not an object or null"),
    ("config", {"hidden_size": 16}, "is not a GPTConfig this megalite can build: "),
    ("layout", [], "is [], not an object of sizes and switches"),
    ("layout", {"tp": [2]}, "is {'tp': [2]}, not an object of sizes and switches"),
    ("optimizer", {"num_steps": "3"}, "is {'num_steps': '3'}, not null or an object with num_steps"),
    ("consumed_samples", "8", "is '8', not a count"),
    ("scheduler", 5, "is 5, not an object or null"),
    ("args", 3, "is 3, not an object or null"),
])
def test_a_bad_field_of_megalite_json_is_one_error_naming_it(saved, tmp_path, field, value, problem):
    save, path = edit_state(saved, tmp_path, "megalite.json", field, value)
    expected = f"checkpoint state {path}: field '{field}' {problem}"
    for load in (load_model, read_checkpoint_info, checkpoint_info, _load_all):
        with pytest.raises(ValueError) as err:
            load(save)
        assert str(err.value).startswith(expected), str(err.value)


def test_a_config_that_builds_no_model_names_the_field(saved, tmp_path):
    with open(os.path.join(saved, "iter_0000001", "megalite.json")) as f:
        config = json.load(f)["config"]
    save, path = edit_state(saved, tmp_path, "megalite.json", "config", {**config, "hidden_size": "16"})
    with pytest.raises(ValueError, match=f"^checkpoint state {path}: field 'config' does not build a model: .*"
                                         "hidden_size"):
        load_model(save)


@pytest.mark.parametrize("name, field, value, problem", [
    ("megalite.json", "scheduler", {"num_steps": "x"}, "is not this run's scheduler state: ValueError"),
    ("megalite.json", "scheduler", {}, "is not this run's scheduler state: ValueError"),
    ("rank_00000.json", "rng", 5, "is not a set of RNG states: TypeError"),
    ("rank_00000.json", "rng", {"python": 1}, "is not a set of RNG states: TypeError"),
])
def test_bad_trainer_state_is_one_error_naming_file_and_field(saved, tmp_path, name, field, value, problem):
    save, path = edit_state(saved, tmp_path, name, field, value)
    with pytest.raises(ValueError) as err:
        _load_all(save)
    assert str(err.value).startswith(f"checkpoint state {path}: field '{field}' {problem}"), str(err.value)
