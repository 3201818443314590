"""Every command's flags take their defaults from the config dataclasses their rows name."""

import importlib.util
import os
from dataclasses import MISSING

import pytest

from megalite.flags import SHARED_FLAGS, UNSET, ArgumentParser, Flag, FlagTable
from megalite.rlhf.flags import REWARD_MODEL_FLAGS, RL_FLAGS
from megalite.rlhf.trainer_config import parse_args as rl_parse_args
from megalite.training.flags import FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = {"shared": SHARED_FLAGS, "pretraining": FLAGS, "rl": RL_FLAGS, "reward model": REWARD_MODEL_FLAGS}


def _example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_row(table: FlagTable, flag: Flag, default) -> None:
    """``default`` (what a parser gives when ``flag`` is not typed) against its first field's dataclass default."""
    field_default = table.field_default(flag.fields[0])
    if flag.sets is not UNSET:
        assert default is False and field_default != flag.sets, flag.name
    elif flag.default is not UNSET:
        # a row may only give its own default where the dataclass has none, or where the command derives the
        # value (None, documented by a help text starting "None:")
        assert field_default is MISSING or (flag.default is None and flag.help.startswith("None:")), flag.name
        assert default == flag.default, flag.name
    else:
        assert default == field_default, flag.name


@pytest.mark.parametrize("name", TABLES)
def test_every_row_default_is_its_dataclass_default(name):
    table = TABLES[name]
    parser = ArgumentParser()
    table.add_to(parser)
    checked = 0
    for flag in table:
        if flag.fields:
            _check_row(table, flag, parser.get_default(flag.dest))
            checked += 1
    assert checked or name == "shared" or name == "reward model"


@pytest.mark.parametrize("example", ["rlhf_ppo", "train_reward_model"])
def test_example_parsers_take_rl_defaults_from_the_dataclasses(example):
    """The RL example once defaulted --kl-coef 0.01 (PPOConfig 0.05), --lam 1.0 (0.95), --rollout-is-cap 2.0
    (None) in its own argparse lines; now every RL option comes from RL_FLAGS and defaults to its config's."""
    parse = rl_parse_args if example == "rlhf_ppo" else _example(example).parse_args
    args = parse(["--save", "x"])
    for table in (RL_FLAGS, REWARD_MODEL_FLAGS):
        for flag in table:
            if hasattr(args, flag.dest) and flag.fields:
                _check_row(table, flag, getattr(args, flag.dest))
    if example == "rlhf_ppo":
        ppo = RL_FLAGS.config_values(args, "PPOConfig")
        assert {"dual_clip", "value_clip", "kl_clamp", "kl_coef", "rollout_is_cap"} <= set(ppo)


def test_a_row_must_name_a_real_field():
    from megalite.rlhf import PPOConfig

    with pytest.raises(ValueError, match="flag --kl: PPOConfig has no field kl"):
        FlagTable((Flag("--kl", "g", ("PPOConfig.kl",)),), (PPOConfig,))


def test_a_flag_is_defined_once():
    with pytest.raises(ValueError, match="flags defined twice: --load"):
        SHARED_FLAGS + FlagTable((Flag("--load", "g"),))
