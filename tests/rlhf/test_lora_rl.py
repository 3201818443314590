"""LoRA in RL: ``RLTrainer`` with ``--lora-rank`` trains the actor's adapters only on its frozen warmed-up base, and
weight sync to a rollout rank sends the adapters only, which the rollout engine applies (unmerged, by the adapters'
hooks on its model).

A short GRPO run colocated and the same run with one rollout rank give equal metrics (the rollouts, rewards and
losses of an engine fed adapter-only syncs are the colocated engine's); each sync sends exactly the adapters' bytes;
the rollout engine's log-probs equal the actor's recomputed ones bit for bit (batch-invariant mode, so any
difference in the synced adapters would show); the base weights end bit-identical to the warmed-up actor while the
adapters moved, the reference is that base with the adapters off (no copy: KL exactly 0 before the first update),
and the optimizer holds the adapters only.
"""

import json
from unittest import mock

import pytest
import torch

from megalite.distributed.unwrap import unwrap
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.rlhf.trainer_models import attach_adapters
from megalite.testing import run_distributed

BASE = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "3",
        "--train-iters", "2", "--micro-batch-size", "4", "--pretrain-global-batch-size", "8", "--ppo-epochs", "2",
        "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--advantage-estimator", "grpo",
        "--tensorboard-dir", "", "--reward-fn", "tests.rlhf.test_example:text_reward", "--lora-rank", "4",
        "--lora-alpha", "8", "--batch-invariant", "--recompute-old-log-probs"]


def _run(argv):
    """Train; on a trainer rank return what the test checks of the actor, its adapters, its reference and its
    optimizer (the warmed-up actor's weights are copied as the adapters attach)."""
    warmed_up = {}

    def attach(args, chunk, *rest):
        warmed_up.update({k: v.clone() for k, v in unwrap(chunk).state_dict().items()})
        return attach_adapters(args, chunk, *rest)

    trainer = RLTrainer(parse_args(argv))
    with mock.patch("megalite.rlhf.trainer.attach_adapters", attach):
        trainer.train()
    if not hasattr(trainer, "actor"):
        return None  # a rollout rank
    base = unwrap(trainer.actor.chunk).state_dict()
    adapters = unwrap(trainer.actor.trained[0])
    params = list(adapters.parameters())
    return {"base_unchanged": base.keys() == warmed_up.keys() and all(torch.equal(base[k], warmed_up[k])
                                                                       for k in base),
            "reference_is_base": trainer.reference.module is unwrap(trainer.actor.chunk),
            "frozen": not any(p.requires_grad for p in unwrap(trainer.actor.chunk).parameters()),
            "adapters_moved": all(adapter.lora_B.abs().sum() > 0 for _, adapter in adapters.named_adapters()),
            "adapter_bytes": sum(p.numel() * p.element_size() for p in params),
            "optimizer_numel": sum(shard.param.numel() for shard in trainer.actor.optimizer.shards),
            "adapter_numel": sum(p.numel() for p in params)}


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_grpo_with_lora_trains_adapters_only_and_syncs_them_alone(tmp_path):
    paths = [tmp_path / "colocated.jsonl", tmp_path / "disaggregated.jsonl"]
    [colocated_state] = run_distributed(_run, 1, BASE + ["--metrics-file", str(paths[0])], timeout=180, backend="gloo")
    trainer_state, rollout_state = run_distributed(_run, 2, BASE + ["--rollout-world-size", "1", "--metrics-file",
                                                                     str(paths[1])], timeout=180)
    assert rollout_state is None
    for state in (colocated_state, trainer_state):
        assert state["base_unchanged"] and state["reference_is_base"] and state["frozen"], state
        assert state["adapters_moved"], state
        assert state["optimizer_numel"] == state["adapter_numel"] > 0
    colocated, disaggregated = _records(paths[0]), _records(paths[1])
    assert all(r["policy_loss"] != 0.0 for r in colocated)  # the second epoch moved the policy
    # the reference is the base: the policy equals it exactly until the first update, then it has moved from it
    assert colocated[0]["kl"] == 0.0 and colocated[1]["kl"] > 0.0
    # one sync after the first update (none after the last): exactly the adapters, at tp=1 their global size
    assert disaggregated[0]["sync_bytes_sent"] == trainer_state["adapter_bytes"]
    assert "sync_bytes_sent" not in disaggregated[1]
    assert [(r["log_prob_gap"], r["log_prob_gap_max"]) for r in disaggregated] == [(0.0, 0.0)] * 2
    for a, b in zip(colocated, disaggregated):
        assert {k: v for k, v in a.items() if not k.startswith(("time_", "samples_per_s"))} == \
            {k: v for k, v in b.items() if not k.startswith(("time_", "sync_", "samples_per_s"))}


@pytest.mark.parametrize("extra, message", [
    (["--lora-rank", "33"],
     r"LoRA rank 33 is larger than layer decoder.layers.0.self_attention.linear_qkv \(\[96, 32\]\) allows"),
    (["--lora-target-modules", "linear_qkv,q_proj"], "q_proj.* match no layer; the available ones are linear_qkv"),
])
def test_lora_bad_input_is_refused_before_any_collective(extra, message):
    """validate() (no process group yet) refuses what the adapters cannot run: a rank above a layer's and an unknown
    target (saving and resuming: tests/rlhf/test_resume.py)."""
    args = parse_args(BASE + extra)
    with pytest.raises(ValueError, match=message):
        validate(args, 1)
