"""Checkpoint and resume of the whole RL state (megalite.rlhf.trainer_checkpoint): an RL job (PPO with a critic and a
target critic, TP2 on two ranks: the 4-rank tp2 x dp2 run is too slow for this shared 2-core machine) is killed with
SIGKILL in iteration 3 after saving at iteration 2; ``--load`` resumes it and iterations 3-4 log the same rewards, KL,
losses and response lengths as an uninterrupted run.  The saved policy exports to Hugging Face with the converter
and gives the same logits in transformers.  Resuming with another algorithm, or saving an off-policy run, is a clear
error before any collective.

The modes beside it resume the same way (a run saved at iteration k and resumed in a new run equals the uninterrupted
run's next two iterations, :func:`_resume_equals_uninterrupted`): LoRA (the base saved once, the adapters and their
optimizer each save), the guidance flow (the guide, its optimizer and its reference beside the policy's) and partial
rollouts (the rows in flight and the finished ones waiting, with their per-token log-probs and versions; environment
episodes paused mid-action too; rewards served by the scoring server).  A run with rollout ranks saves their rows in
flight and the batches they generated ahead, and resumes from them; under LoRA too (the rollout ranks receive the
loaded base once, then the loaded adapters)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.training.lr_schedule import lr_at
from megalite.testing import run_distributed
from tests.rlhf.test_example import text_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--tensor-model-parallel-size", "2", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "1",
        "--train-iters", "4", "--micro-batch-size", "4", "--pretrain-global-batch-size", "8", "--global-batch-size",
        "4", "--ppo-epochs", "2", "--tensorboard-dir", "", "--reward-fn", "tests.rlhf.test_resume:stalling_reward",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-warmup-init", "1e-4", "--min-lr", "2e-4"]
ARGV = BASE + ["--target-critic-tau", "0.5"]
SAVED = ARGV + ["--save-interval", "2"]
COMPARED = ("reward", "kl", "policy_loss", "value_loss", "clip_fraction", "response_length", "actor_lr", "critic_lr")
_calls = 0


def stalling_reward(prompt: str, response: str) -> float:
    """``text_reward``; with ``$RL_STALL_DIR`` set, the first reward of iteration 3 (4 prompts a rank per iteration)
    writes this process's id there and waits to be killed."""
    global _calls
    _calls += 1
    stall = os.environ.get("RL_STALL_DIR")
    if stall and _calls == 9:
        with open(os.path.join(stall, f"{os.getpid()}.tmp"), "w"):
            pass
        os.rename(os.path.join(stall, f"{os.getpid()}.tmp"), os.path.join(stall, str(os.getpid())))
        time.sleep(600)
    return text_reward(prompt, response)


def _run(argv):
    return RLTrainer(parse_args(argv)).train()


def _records(path):
    return {r["iteration"]: r for r in map(json.loads, open(path).read().splitlines())}


def _kill_in_iteration_3(argv, directory):
    """The job under torchrun; each rank SIGKILLed once it stalls in iteration 3 (then torchrun exits)."""
    stall = os.path.join(directory, "stalled")
    os.makedirs(stall)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "RL_STALL_DIR": stall}
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(port), os.path.join(ROOT, "examples", "rlhf_ppo.py"), *argv], env=env,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while len(os.listdir(stall)) < 2 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [int(name) for name in os.listdir(stall) if name.isdigit()]
    assert len(ranks) == 2, f"the job never reached iteration 3 on both ranks (exit status {job.poll()})"
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    assert job.wait(timeout=120) != 0


@pytest.mark.slow
def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    argv = SAVED + ["--metrics-file", str(tmp_path / "whole.jsonl"), "--save", str(whole)]
    assert run_distributed(_run, 2, argv, timeout=240) == [0, 0]
    _kill_in_iteration_3(SAVED + ["--metrics-file", str(tmp_path / "killed.jsonl"), "--save", str(killed)],
                         str(tmp_path))
    assert sorted(_records(tmp_path / "killed.jsonl")) == [1, 2]
    argv = SAVED + ["--metrics-file", str(tmp_path / "resumed.jsonl"), "--save", str(killed), "--load", str(killed)]
    assert run_distributed(_run, 2, argv, timeout=240) == [0, 0]
    expected, resumed = _records(tmp_path / "whole.jsonl"), _records(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [3, 4]
    for iteration, record in resumed.items():
        assert {k: record[k] for k in COMPARED} == {k: expected[iteration][k] for k in COMPARED}, iteration
    assert any(r["policy_loss"] != 0.0 for r in resumed.values())
    args = parse_args(ARGV)
    validate(args, 2)
    for name, settings in (("actor_lr", args.actor_schedule), ("critic_lr", args.critic_schedule)):
        assert [expected[i][name] for i in range(1, 5)] == [lr_at(settings, (i - 1) * 4) for i in range(1, 5)]

    with pytest.raises(ValueError, match="was trained with --advantage-estimator gae; this run uses grpo"):
        RLTrainer(parse_args(BASE + ["--load", str(killed), "--advantage-estimator", "grpo",
                                     "--n-samples-per-prompt", "2"]), world_size=2)

    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint import load_model
    from megalite.checkpoint.hf import convert_megalite_to_hf

    convert_megalite_to_hf(str(whole / "actor"), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.tensor([[51, 45, 52, 63, 56]])
    with torch.no_grad():
        ours = load_model(str(whole / "actor"))(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs[..., :ours.shape[-1]], ours[..., :theirs.shape[-1]], rtol=0, atol=1e-5)


def test_lr_schedule_is_megatrons_per_rl_iteration():
    """The actor's and critic's LRs at each RL iteration equal Megatron-Core's OptimizerParamScheduler advanced by
    one global batch per iteration, the critic's at --critic-lr with --min-lr and --lr-warmup-init scaled alike."""
    scheduler_module = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    args = parse_args(BASE + ["--train-iters", "6", "--lr-warmup-iters", "2"])
    validate(args, 2)
    for settings, lr in ((args.actor_schedule, args.actor_lr), (args.critic_schedule, args.critic_lr)):
        scale = lr / args.actor_lr
        group = {"lr": 0.0, "weight_decay": 0.0}
        peer = scheduler_module.OptimizerParamScheduler(
            SimpleNamespace(param_groups=[group]), init_lr=1e-4 * scale, max_lr=lr, min_lr=2e-4 * scale,
            lr_warmup_steps=2 * 4, lr_decay_steps=6 * 4, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
            wd_incr_steps=6 * 4, wd_incr_style="constant")
        ours = []
        for iteration in range(6):
            ours.append(lr_at(settings, iteration * 4))
            assert ours[-1] == pytest.approx(group["lr"], rel=1e-12, abs=0), iteration
            peer.step(increment=4)
        assert len(set(ours)) == 6  # warmup, then a decay: every iteration's LR differs


def test_lr_schedule_bad_input():
    with pytest.raises(ValueError, match="--min-lr 0.001 must be between 0 and --actor-lr 0.0005"):
        validate(parse_args(BASE + ["--min-lr", "1e-3"]), 2)
    with pytest.raises(ValueError, match="lr warmup"):
        validate(parse_args(BASE + ["--lr-warmup-iters", "4"]), 2)


def _resume_equals_uninterrupted(argv, tmp_path, ranks: int, also=(), at: int = 2) -> dict:
    """Runs ``argv`` for ``at`` + 2 iterations; again for ``at`` saving at the end into ``SAVE``; then resumes
    ``SAVE`` up to ``at`` + 2 (saving into it again).  Asserts the resumed iterations' rewards, KL, losses and
    lengths equal the uninterrupted run's (and the metrics ``also`` names, where either run logs them), and that
    the policy moved in them; returns the resumed run's records."""
    def run(name, extra):
        argv_ = argv + extra + ["--metrics-file", str(tmp_path / f"{name}.jsonl")]
        assert run_distributed(_run, ranks, argv_, timeout=240) == [0] * ranks
        return _records(tmp_path / f"{name}.jsonl")

    save = str(tmp_path / "save")
    expected = run("whole", ["--train-iters", str(at + 2)])
    assert sorted(run("first", ["--train-iters", str(at), "--save", save])) == list(range(1, at + 1))
    # The first run's --train-iters (its LR schedule's length) differs from this one's, as in Megatron-LM.
    resumed = run("resumed", ["--train-iters", str(at + 2), "--save", save, "--load", save,
                              "--override-opt-param-scheduler"])
    assert sorted(resumed) == [at + 1, at + 2]
    compared = [k for k in COMPARED if k in expected[at + 1]] + list(also)
    assert "reward" in compared and "policy_loss" in compared
    for iteration, record in resumed.items():
        assert {k: record.get(k) for k in compared} == {k: expected[iteration].get(k) for k in compared}, iteration
    assert any(r["policy_loss"] != 0.0 for r in resumed.values())
    return resumed


LORA = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "2",
        "--micro-batch-size", "4", "--pretrain-global-batch-size", "8", "--ppo-epochs", "2", "--global-batch-size",
        "2", "--n-samples-per-prompt", "2", "--advantage-estimator", "grpo", "--tensorboard-dir", "", "--reward-fn",
        "tests.rlhf.test_example:text_reward", "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1"]


@pytest.mark.slow
def test_lora_resume_equals_an_uninterrupted_run(tmp_path):
    """``--lora-rank`` saves its base once (``SAVE/reference``, the reference) and its adapters with their optimizer
    and dropout RNG each save (``SAVE/actor``, an adapter checkpoint); the resume equals the uninterrupted run, and
    the second save into ``SAVE`` does not write the base again."""
    from megalite.checkpoint import read_checkpoint_info
    from megalite.checkpoint.files import iteration_dir, read_latest

    _resume_equals_uninterrupted(LORA, tmp_path, 1)
    save = tmp_path / "save"
    assert read_latest(str(save / "actor")) == 4 and read_latest(str(save / "reference")) == 2
    assert read_checkpoint_info(iteration_dir(str(save / "actor"), 4))["state"]["rl"]["base"] == 2
    with pytest.raises(ValueError, match="was trained with --lora-rank 4 --lora-alpha 8.0 .*; this run uses "
                                         "--lora-rank 2 --lora-alpha 8.0"):
        RLTrainer(parse_args(LORA + ["--load", str(save), "--lora-rank", "2"]), world_size=1)
    with pytest.raises(ValueError, match="this run uses no --lora-rank"):
        RLTrainer(parse_args(LORA[:-6] + ["--load", str(save)]), world_size=1)


GUIDANCE = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters",
            "40", "--pretrain-lr", "1e-2", "--micro-batch-size", "8", "--pretrain-global-batch-size", "16",
            "--ppo-epochs", "2", "--global-batch-size", "2", "--n-samples-per-prompt", "4", "--advantage-estimator",
            "grpo", "--tensorboard-dir", "", "--max-new-tokens", "4", "--max-total-tokens", "32", "--max-operand", "4",
            "--actor-lr", "1e-2", "--guide-lr", "1e-2", "--environment", "guidance"]


@pytest.mark.slow
def test_guidance_resume_equals_an_uninterrupted_run(tmp_path):
    """The guidance flow saves the guide (``SAVE/guide`` with its optimizer, ``SAVE/guide_reference``) beside the
    policy; the resume equals the uninterrupted run, the guide's rewards and losses included.  A resume in another
    environment, or a guidance run loading a checkpoint that is not an RL one, is a clear error."""
    resumed = _resume_equals_uninterrupted(GUIDANCE, tmp_path, 1, also=("guide_reward", "guide_policy_loss",
                                                                        "attempt_reward"))
    assert any(r["guide_policy_loss"] != 0.0 for r in resumed.values())
    assert {"guide", "guide_reference"} <= set(os.listdir(tmp_path / "save"))
    with pytest.raises(ValueError, match="was trained with --environment guidance; this run uses calculator"):
        RLTrainer(parse_args(GUIDANCE[:-2] + ["--environment", "calculator", "--load", str(tmp_path / "save")]),
                  world_size=1)
    with pytest.raises(ValueError, match="is not an RL checkpoint: --environment guidance warms up"):
        RLTrainer(parse_args(GUIDANCE + ["--load", str(tmp_path / "save" / "actor")]), world_size=1)


PARTIAL = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "40",
           "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
           "--pretrain-global-batch-size", "4", "--advantage-estimator", "grpo", "--ppo-epochs", "2",
           "--tensorboard-dir", "", "--partial-rollout-tokens", "1", "--max-staleness", "2", "--rollout-is-cap", "2",
           "--reward-fn", "tests.rlhf.test_example:text_reward"]


@pytest.mark.slow
def test_partial_rollouts_resume_equals_an_uninterrupted_run(tmp_path):
    """``--partial-rollout-tokens``: the save at iteration 3 holds rows still being generated (their tokens, per-token
    behaviour log-probs and versions); the resume continues them, so its batches, staleness and importance weights
    equal the uninterrupted run's.  The rewards come from ``--use-scoring-server``, which prefetches nothing here,
    so the save holds the whole state of a served run too (other resume tests score locally)."""
    from megalite.checkpoint import CheckpointReader
    from megalite.checkpoint.files import iteration_dir

    resumed = _resume_equals_uninterrupted(PARTIAL + ["--use-scoring-server"], tmp_path, 1,
                                           also=("staleness", "is_weight_mean", "scorer_staleness"), at=3)
    assert any(r["staleness"] > 0 and r["is_weight_mean"] > 0 for r in resumed.values())
    saved = CheckpointReader(iteration_dir(str(tmp_path / "save" / "actor"), 3)).rank_state(0)["partial_rollouts"]
    assert saved["rows"] and all(len(row[1]) == len(row[2]) == len(row[3]) > 0 for row in saved["rows"])


PARTIAL_CALCULATOR = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1",
                      "--pretrain-iters", "60", "--pretrain-lr", "1e-2", "--global-batch-size", "2",
                      "--n-samples-per-prompt", "2", "--advantage-estimator", "grpo", "--micro-batch-size", "4",
                      "--pretrain-global-batch-size", "4",
                      "--ppo-epochs", "1", "--max-new-tokens", "8", "--max-total-tokens", "48", "--environment",
                      "calculator", "--warmup-direct-fraction", "0.5", "--error-reward", "-0.5",
                      "--tensorboard-dir", "", "--partial-rollout-tokens", "2", "--max-staleness", "2",
                      "--rollout-is-cap", "2"]


@pytest.mark.slow
def test_partial_environment_episodes_resume_equals_an_uninterrupted_run(tmp_path):
    """``--partial-rollout-tokens`` with ``--environment calculator``: the save holds episodes paused mid-action
    (seed, tokens, per-token log-probs and versions, the action in progress); the resume replays their finished
    tool calls into fresh environments and continues them, equal to the uninterrupted run."""
    from megalite.checkpoint import CheckpointReader
    from megalite.checkpoint.files import iteration_dir

    # seed 3: rows in flight at the save, and a resumed iteration that trains on rows begun under older weights
    resumed = _resume_equals_uninterrupted(PARTIAL_CALCULATOR + ["--seed", "3"], tmp_path, 1,
                                           also=("staleness", "turns"), at=2)
    assert any(r["staleness"] > 0 for r in resumed.values())
    saved = CheckpointReader(iteration_dir(str(tmp_path / "save" / "actor"), 2)).rank_state(0)["partial_rollouts"]
    assert saved["rows"] and all(len(row["tokens"]) == len(row["log_probs"]) == len(row["versions"])
                                 for row in saved["rows"])


@pytest.mark.parametrize("extra, message", [
    (["--save-interval", "2"], "--save-interval 2 needs --save"),
])
def test_checkpoint_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        RLTrainer(parse_args(ARGV + extra), world_size=2)


def _resume_from_interval_save(argv, tmp_path, ranks: int, run=_run) -> dict:
    """Runs ``argv`` (5 iterations, each rank running ``run``) saving every 2; then resumes its save at iteration 2
    (``latest`` moved back to 2, as a kill after that save leaves it) and asserts iterations 3-5 log what the
    uninterrupted run did (rewards, KL, losses, staleness, IS weights) and that the policy moved; returns the save's
    RL state at iteration 2."""
    from megalite.checkpoint import read_checkpoint_info
    from megalite.checkpoint.files import iteration_dir

    whole, save, resumed = tmp_path / "whole.jsonl", tmp_path / "save", tmp_path / "resumed.jsonl"
    argv = argv + ["--train-iters", "5"]
    assert run_distributed(run, ranks, argv + ["--save", str(save), "--save-interval", "2", "--metrics-file",
                                               str(whole)], timeout=240) == [0] * ranks
    state = read_checkpoint_info(iteration_dir(str(save / "actor"), 2))["state"]
    (save / "actor" / "latest").write_text("2")
    assert run_distributed(run, ranks, argv + ["--load", str(save), "--save", str(tmp_path / "again"),
                                               "--metrics-file", str(resumed)], timeout=240) == [0] * ranks
    expected, records = _records(whole), _records(resumed)
    assert sorted(records) == [3, 4, 5]
    compared = [k for k in COMPARED if k in expected[3]] + ["staleness", "is_weight_mean"]
    for iteration, record in records.items():
        assert {k: record.get(k) for k in compared} == {k: expected[iteration].get(k) for k in compared}, iteration
    assert any(r["staleness"] > 0 for r in records.values()) and any(r["policy_loss"] != 0 for r in records.values())
    return state


@pytest.mark.slow
def test_rollout_ranks_resume_equals_an_uninterrupted_run(tmp_path):
    """--rollout-world-size with --max-staleness 2 and --partial-rollout-tokens: the save at iteration 2 holds the
    rollout rank's state (its prompt stream, rows in flight, and batches 3 and 4, generated ahead with older
    weights); the resume sends those batches again and continues the rest, equal to the uninterrupted run."""
    state = _resume_from_interval_save(PARTIAL + ["--rollout-world-size", "1"], tmp_path, 2)
    saved = state["rl"]["rollout_ranks"]["ranks"][0]
    assert [i for i, _, _ in saved["ahead"]] == [3, 4] and saved["partial"][0]["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("served", [False, True])
def test_lookahead_resume_equals_an_uninterrupted_run(tmp_path, served):
    """A colocated run at --max-staleness 1 draws each rollout one update ahead: the save at iteration 2 holds
    rollout 3 (sampled and scored with the weights after update 1; with --use-scoring-server its request was
    prefetched, and the save holds the server's rewards for it); the resume trains on it, then draws on, equal to
    the uninterrupted run."""
    from megalite.checkpoint import CheckpointReader
    from megalite.checkpoint.files import iteration_dir

    lookahead = PARTIAL[:PARTIAL.index("--partial-rollout-tokens")] + [
        "--max-staleness", "1", "--rollout-is-cap", "2", "--reward-fn", "tests.rlhf.test_example:text_reward",
        "--pretrain-iters", "2"] + (["--use-scoring-server"] if served else [])
    _resume_from_interval_save(lookahead, tmp_path, 1)
    ahead = CheckpointReader(iteration_dir(str(tmp_path / "save" / "actor"), 2)).rank_state(0)["ahead"]
    assert [(saved["rollout"]["iteration"]["json"], saved["rollout"]["version"]["json"]) for saved in ahead] == \
        [(3, 1)]
    assert [("served" in saved) for saved in ahead] == [served]


def _run_logging_syncs(argv):
    """``_run``; each rank appends what each of its weight syncs moved (``base`` or ``adapters``) to
    ``<--metrics-file>.syncs<rank>``."""
    from unittest import mock

    import torch.distributed as dist

    from megalite.lora import LoRAModel
    from megalite.rlhf.weight_sync import WeightSync

    sync = WeightSync.sync

    def logged(self):
        with open(f"{argv[argv.index('--metrics-file') + 1]}.syncs{dist.get_rank()}", "a") as log:
            log.write(("adapters" if isinstance(self.model, LoRAModel) else "base") + "\n")
        sync(self)

    with mock.patch.object(WeightSync, "sync", logged):
        return _run(argv)


@pytest.mark.slow
def test_lora_rollout_ranks_resume_equals_an_uninterrupted_run(tmp_path):
    """--lora-rank beside a rollout rank at --max-staleness 1: the saves write the base once (``SAVE/reference``)
    and the adapters, with the rollout rank's batch 3 generated ahead; the resume sends the rollout rank the loaded
    base once, then the loaded adapters (and the adapters alone at its one sync after update 3), and equals the
    uninterrupted run."""
    from megalite.checkpoint.files import read_latest

    state = _resume_from_interval_save(LORA + ["--max-staleness", "1", "--rollout-is-cap", "2",
                                               "--rollout-world-size", "1"], tmp_path, 2, _run_logging_syncs)
    assert [i for i, _, _ in state["rl"]["rollout_ranks"]["ranks"][0]["ahead"]] == [3]
    assert state["rl"]["base"] == 2 and read_latest(str(tmp_path / "save" / "reference")) == 2
    for rank in (0, 1):  # the trainer rank sends what the rollout rank receives
        assert (tmp_path / f"resumed.jsonl.syncs{rank}").read_text().split() == ["base", "adapters", "adapters"]
