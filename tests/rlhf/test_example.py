"""The RL trainer (megalite.rlhf.trainer, what examples/rlhf_ppo.py runs) runs end to end (tiny and short) on TP2: PPO
with a scoring server for the reward and top-k teacher (distillation loss and log-prob rewards) and one-step
staleness, and GRPO with DAPO's pieces and the KL loss; one metrics record and TensorBoard scalar per iteration, and
the logged staleness never exceeds --max-staleness. Its bad-input errors come before any collective."""

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalite.rlhf.rollout_batch import Rollout
from megalite.rlhf.rollouts import lookahead
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.rlhf.trainer_log import iteration_line, sample_lines
from megalite.testing import run_distributed

TINY = ["--tensor-model-parallel-size", "2", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "3",
        "--train-iters", "3", "--micro-batch-size", "4", "--pretrain-global-batch-size", "8", "--ppo-epochs", "1"]


def _run(argv):
    return RLTrainer(parse_args(argv)).train()


def text_reward(prompt: str, response: str) -> float:
    """A reward that varies within the groups of an untrained policy (for the equality checks)."""
    return float(sum(map(ord, response)) % 7)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_ppo_example_with_scoring_server_and_staleness(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = TINY + ["--global-batch-size", "8", "--use-scoring-server", "--max-staleness", "1",
                   "--scoring-server-rank", "1", "--teacher-topk", "4", "--distill-coef", "0.1",
                   "--teacher-reward-coef", "0.01", "--metrics-file", str(metrics),
                   "--tensorboard-dir", str(tmp_path / "tb")]
    assert run_distributed(_run, 2, argv, timeout=180) == [0, 0]
    records = _records(metrics)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert [r["staleness"] for r in records] == [0.0, 1.0, 1.0]
    for record in records:
        assert {"reward", "kl", "policy_loss", "value_loss"} <= set(record) and 0.0 <= record["reward"] <= 1.0
        assert record["distill_kl"] > 0 and record["teacher_log_prob"] < 0 and record["scorer_staleness"] == 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/reward")]
    assert logged == [(r["iteration"], pytest.approx(r["reward"])) for r in records]


@pytest.mark.slow
def test_grpo_example_with_dapo_and_kl_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = TINY + ["--global-batch-size", "4", "--n-samples-per-prompt", "2", "--advantage-estimator", "grpo",
                   "--use-kl-loss", "--dynamic-sampling", "--clip-ratio-high", "0.28", "--overlong-buffer-len", "1",
                   "--loss-agg-mode", "seq-mean-token-sum", "--metrics-file", str(metrics), "--tensorboard-dir", "",
                   "--eval-interval", "2", "--sample-interval", "1"]
    assert run_distributed(_run, 2, argv, timeout=180) == [0, 0]
    records = [r for r in _records(metrics) if "valid_reward" not in r]
    assert [r["staleness"] for r in records] == [0.0, 0.0, 0.0]
    for record in records:
        assert "kl_loss" in record and "value_loss" not in record and 0.0 <= record["kept_group_fraction"] <= 1.0
        assert record["reward_std"] >= 0 and record["entropy"] > 0 and record["samples_per_s"] > 0
    valid = [r for r in _records(metrics) if "valid_reward" in r]  # greedy on the fixed prompts
    assert [r["iteration"] for r in valid] == [0, 2]  # before RL (the warmed-up actor), then every 2 iterations
    assert all(0.0 <= r["valid_reward"] <= 1.0 and r["valid_response_length"] > 0 for r in valid)


@pytest.mark.slow
def test_disaggregated_equals_colocated_and_runs_async(tmp_path):
    """One trainer rank and one rollout rank (weights synced after each update) give exactly the colocated
    run's metrics over two on-policy iterations; a tp2 rollout replica with --max-staleness 2 runs."""
    base = TINY + ["--tensor-model-parallel-size", "1", "--global-batch-size", "2", "--n-samples-per-prompt", "2",
                   "--advantage-estimator", "grpo", "--train-iters", "2", "--tensorboard-dir", "",
                   "--reward-fn", "tests.rlhf.test_example:text_reward", "--ppo-epochs", "2"]
    paths = [tmp_path / "colocated.jsonl", tmp_path / "disaggregated.jsonl", tmp_path / "async.jsonl"]
    # gloo keeps the one-rank run on the CPU like the two-rank one (on a GPU machine it would take the GPU)
    assert run_distributed(_run, 1, base + ["--metrics-file", str(paths[0])], timeout=180, backend="gloo") == [0]
    assert run_distributed(_run, 2, base + ["--rollout-world-size", "1", "--metrics-file", str(paths[1])],
                           timeout=180) == [0, 0]
    colocated, disaggregated = _records(paths[0]), _records(paths[1])
    assert all(r["policy_loss"] != 0.0 and r["reward"] > 0 for r in colocated)  # the second epoch moved the policy
    assert disaggregated[0]["sync_bytes_sent"] > 0 and "sync_bytes_sent" not in disaggregated[1]
    for a, b in zip(colocated, disaggregated):
        assert {k: v for k, v in a.items() if not k.startswith(("time_", "samples_per_s"))} == \
            {k: v for k, v in b.items() if not k.startswith(("time_", "sync_", "samples_per_s"))}  # wall clock
    argv = base + ["--train-iters", "5", "--rollout-world-size", "2", "--rollout-tensor-parallel-size", "2",
                   "--max-staleness", "2", "--metrics-file", str(paths[2])]
    # the rollout ranks' sync after update 1 comes with iteration 3's sends still pending: waiting on those there
    # (before the trainers' next sync lets them receive it) deadlocked
    assert run_distributed(_run, 3, argv, timeout=180) == [0, 0, 0]
    assert [r["staleness"] for r in _records(paths[2])] == [0.0, 1.0, 2.0, 2.0, 2.0]


def test_the_console_line_is_short_and_names_what_users_watch():
    metrics = {"reward": 0.5, "reward_std": 0.25, "kl": 0.00123, "entropy": 1.5, "response_length": 2.5,
               "policy_loss": -0.0123, "value_loss": 4.5, "samples_per_s": 321.0, "time_train_s": 0.1,
               "mem_training_device_bytes": 123456.0, "clip_fraction": 0.0}
    line = iteration_line(3, 100, metrics)
    assert line == ("rl 3/100 | reward 0.500 ±0.250 | kl 0.0012 | entropy 1.500 | len 2.5 | pg -0.0123 | vf 4.5000 | "
                    "321.0 samples/s")
    assert iteration_line(3, 100, {"reward": 1.0}) == "rl 3/100 | reward 1.000"
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    rollout = Rollout(ids, torch.ones_like(ids), mask, -mask, 2, prompts=["1+", "1+"], responses=["2", "3"],
                      rewards=torch.tensor([1.0, 0.0]), iteration=3)
    assert sample_lines(rollout, 1) == ["  sample 3: '1+' -> '2' (reward 1.000)"]


def test_lookahead_zero_is_the_synchronous_order_and_s_bounds_staleness():
    for depth in (0, 1, 2):
        events, version = [], 0

        def produce():
            for i in range(5):
                events.append(("generate", i, version))
                yield i, version

        for item, made_by in lookahead(produce(), depth):
            events.append(("train", item, version))
            assert version - made_by <= depth
            version += 1
        if depth == 0:
            assert events == [e for i in range(5) for e in (("generate", i, i), ("train", i, i))]
        assert max(t[2] - g[2] for g in events if g[0] == "generate" for t in events
                   if t[0] == "train" and t[1] == g[1]) == depth


@pytest.mark.parametrize("extra, message", [
    (["--advantage-estimator", "ppo2"], "advantage estimator must be one of"),
    (["--advantage-estimator", "grpo"], "'grpo' needs at least 2 samples per prompt, got 1"),
    (["--advantage-estimator", "rloo"], "'rloo' needs at least 2 samples per prompt, got 1"),
    (["--reward-fn", "no_such_module_xyz:score"], "cannot import reward module 'no_such_module_xyz'"),
    (["--global-batch-size", "3"], "--global-batch-size 3 is not divisible by the data-parallel size 2"),
    (["--tensor-model-parallel-size", "3"], "4 trainer ranks .* not divisible by tensor-model-parallel-size 3"),
    (["--rollout-world-size", "4"], "--rollout-world-size 4 leaves no trainer ranks in the world of 4"),
    (["--tensor-model-parallel-size", "1", "--rollout-world-size", "3", "--rollout-tensor-parallel-size", "2"],
     "--rollout-world-size 3 is not a multiple of --rollout-tensor-parallel-size 2"),
    (["--teacher-topk", "4", "--distill-coef", "0.1"], "need --use-scoring-server"),
    (["--use-scoring-server", "--teacher-topk", "0", "--distill-coef", "0.1"], "--teacher-topk 0 needs"),
    (["--use-scoring-server", "--scoring-server-rank", "4"], "--scoring-server-rank 4 is outside the world of 4"),
    (["--eval-interval", "0"], "--eval-interval must be a positive number of iterations, got 0"),
    (["--eval-interval", "2", "--use-scoring-server"], "--eval-interval scores with a --reward-fn on every rank"),
])
def test_example_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        validate(parse_args(TINY + ["--global-batch-size", "8"] + extra), 4)
