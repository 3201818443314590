"""--wandb-project logs to Weights & Biases the scalars TensorBoard gets, at the same steps.

The ``wandb`` package is an optional extra that the shared test environment does not install, so these tests
put a stand-in module in ``sys.modules`` that records ``init``/``log``/``finish`` calls (the calls Megatron-LM
makes: ``wandb.init(dir, name, project, config=vars(args))``, ``log(dict, step)``, ``finish()``).
"""

import importlib.machinery
import sys
import types

import pytest

from megalite.testing import run_distributed
from megalite.training.arguments import validate_args
from megalite.training.flags import parse_args
from tests.training.helpers import tiny_argv


def _recording_wandb():
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.calls = []
    module.init = lambda **kwargs: module.calls.append(("init", kwargs))
    module.log = lambda data, step=None: module.calls.append(("log", dict(data), step))
    module.finish = lambda: module.calls.append(("finish",))
    return module


def _pretrain_with_recording_wandb(argv):
    from megalite.training import gpt, pretrain

    sys.modules["wandb"] = _recording_wandb()
    pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, argv=argv)
    return sys.modules["wandb"].calls


def test_wandb_gets_the_tensorboard_scalars(tiny_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = tiny_argv(tiny_data, tmp_path, "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
                     "--tensorboard-dir", str(tmp_path / "tb"), "--save", str(tmp_path / "ckpt"),
                     "--wandb-project", "proj", "--wandb-exp-name", "run1")
    [calls] = run_distributed(_pretrain_with_recording_wandb, 1, argv, timeout=120)

    assert [c[0] for c in calls] == ["init", "log", "log", "log", "finish"]
    init = calls[0][1]
    assert (init["project"], init["name"], init["dir"]) == ("proj", "run1", str(tmp_path / "ckpt" / "wandb"))
    assert init["config"]["hidden_size"] == 32 and init["config"]["wandb_project"] == "proj"
    assert (tmp_path / "ckpt" / "wandb").is_dir()
    logged = {step: data for _, data, step in calls[1:-1]}
    assert sorted(logged) == [1, 2, 3] and "valid/loss" in logged[2] and "train/loss" in logged[1]

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tensorboard = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            tensorboard.setdefault(event.step, {})[tag] = event.value
    assert sorted(tensorboard) == sorted(logged)
    for step, data in logged.items():
        assert sorted(data) == sorted(tensorboard[step]), step
        assert [tensorboard[step][k] for k in sorted(data)] == pytest.approx([data[k] for k in sorted(data)],
                                                                             rel=1e-6), step


@pytest.mark.parametrize("extra,installed,message", [
    (["--wandb-project", "p"], True, "--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM"),
    (["--wandb-project", "p", "--wandb-exp-name", "r"], False,
     "--wandb-project needs the wandb package, which is not installed: pip install wandb"),
])
def test_bad_wandb_flags_name_the_problem(monkeypatch, extra, installed, message):
    monkeypatch.setitem(sys.modules, "wandb", _recording_wandb() if installed else None)
    with pytest.raises(ValueError) as info:
        validate_args(parse_args(extra), world_size=1)
    assert str(info.value) == message
