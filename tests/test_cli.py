"""Every command goes through megalite.cli.run_cli: bad input is one ``error:`` line on stderr and exit 2."""

import os

import pytest

from megalite.checkpoint import save_global_checkpoint
from megalite.models import GPTConfig, GPTModel
from tests.forked_commands import PRELOAD, run_commands

pytestmark = pytest.mark.slow  # each case runs a command in a process of its own

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BASE_FLAGS = ["--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "8", "--max-position-embeddings", "8"]
"""The tiny base model the LoRA case loads (written by the ``runs`` fixture)."""


def _save_base(directory):
    """A checkpoint of the BASE_FLAGS model, for ``--finetune --load``."""
    config = GPTConfig(vocab_size=128, num_layers=1, hidden_size=32, num_attention_heads=4, max_position_embeddings=8)
    save_global_checkpoint(directory, config, GPTModel(config).state_dict())


def _cases(tmp):
    """(name, argv after the interpreter, a fragment of the error line)."""
    example = lambda name: os.path.join(ROOT, "examples", f"{name}.py")  # noqa: E731
    tool = lambda name: os.path.join(ROOT, "tools", f"{name}.py")  # noqa: E731
    return [
        ("pretrain_gpt", [example("pretrain_gpt"), "--micro-batch-size", "3", "--global-batch-size", "8"],
         "global batch size 8 is not divisible by micro batch size 3"),
        ("rlhf_ppo", [example("rlhf_ppo"), "--tensor-model-parallel-size", "3"],
         "1 trainer ranks (world size 1 - --rollout-world-size 0) are not divisible"),
        ("pretrain_gpt-lora-zero1", [example("pretrain_gpt"), "--finetune", "--load", os.path.join(tmp, "base"),
                                     "--lora-rank", "4", "--use-distributed-optimizer", *BASE_FLAGS],
         "--lora-rank does not work with --use-distributed-optimizer"),
        ("rlhf_ppo-lora-rank", [example("rlhf_ppo"), "--tensor-model-parallel-size", "1", "--lora-rank", "65"],
         "LoRA rank 65 is larger than layer decoder.layers.0.self_attention.linear_qkv ([192, 64])"),
        ("train_reward_model", [example("train_reward_model")], "the following arguments are required: --save"),
        ("training_service", [example("training_service"), "--backend", "cloud"],
         "argument --backend: invalid choice: 'cloud'"),
        ("serve", ["-m", "megalite.inference.serve"], "the following arguments are required: --load"),
        ("checkpoint", ["-m", "megalite.checkpoint", "inspect", os.path.join(tmp, "nowhere")], "nowhere"),
        ("topology", ["-m", "megalite.topology", "--world-size", "6", "--tensor-model-parallel-size", "4"],
         "world size 6 is not divisible by tp*pp*cp = 4*1*1 = 4"),
        ("topology-short-flag", ["-m", "megalite.topology", "--world-size", "6", "--tp", "4"],
         "unrecognized arguments: --tp 4"),
        ("convert_checkpoint", [tool("convert_checkpoint"), "--from", "hf", "--to", "hf", "--input", tmp, "--output",
                                os.path.join(tmp, "out")], "--from and --to are both 'hf'; nothing to convert"),
        ("make_preference_data", [tool("make_preference_data"), "--output", os.path.join(tmp, "p.jsonl"), "--pairs",
                                  "0"], "--pairs must be positive, got 0"),
        ("plot_pipeline", [tool("plot_pipeline"), tmp], "no timeline files found"),
        ("preprocess_data", [tool("preprocess_data"), "--input", "x", "--output-prefix", "y", "--tokenizer-type",
                             "WordPiece"], "argument --tokenizer-type: invalid choice: 'WordPiece'"),
        ("supervise", [tool("supervise"), "--", "torchrun", "train.py"], "the command needs --load"),
        ("train_tokenizer", [tool("train_tokenizer"), "--input", os.path.join(tmp, "none.txt"), "--output-prefix",
                             os.path.join(tmp, "t"), "--vocab-size", "50"], "none.txt"),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every bad command at once, each in its own process forked after torch was imported once
    (tests/forked_commands.py); map name -> (fragment, exit status, stderr)."""
    tmp = str(tmp_path_factory.mktemp("cli"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("WORLD_SIZE", None)
    _save_base(os.path.join(tmp, "base"))
    cases = _cases(tmp)
    done = run_commands([(argv, tmp, {}) for _, argv, _ in cases], env, PRELOAD + ("megalite.rlhf",), timeout=300)
    return {name: (fragment, proc.returncode, proc.stderr) for (name, _, fragment), proc in zip(cases, done)}


@pytest.mark.parametrize("name", [case[0] for case in _cases("tmp")])
def test_bad_input_is_one_error_line_and_exit_2(runs, name):
    fragment, code, err = runs[name]
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert "Traceback" not in err
