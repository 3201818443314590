"""Placement and offload in the RL trainer (megalite.rlhf.trainer): with --offload-frozen-models --offload-optimizer (PPO with a
critic, a target critic on the host, a reward model and the reference) the losses, rewards and updated weights
are bit-identical to the run without, and each phase's logged device bytes fall by exactly what the plan
parks in that phase (+-5%): the frozen models and the optimizer state in generation, the optimizer state in
scoring, the frozen models in training.  On a GPU the memory the CUDA allocator holds in each phase falls by
the same bytes (the parked tensors are really freed); with CUDA the pool is pinned.  The pool is allocated once
and reused; bad placement input fails with one clear error."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint import save_sharded
from megalite.data.tokenizer import ByteTokenizer
from megalite.models import GPTConfig
from megalite.rlhf import CriticModel, PolyakTarget
from megalite.rlhf.placement import OffloadConfig, Placement
from megalite.testing import run_distributed
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate

ARGV = ["--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "2", "--train-iters", "3",
        "--micro-batch-size", "4", "--pretrain-global-batch-size", "8", "--global-batch-size", "8", "--ppo-epochs", "2",
        "--target-critic-tau", "0.5", "--tensorboard-dir", ""]
OFFLOAD = ["--offload-frozen-models", "--offload-optimizer"]
SERVED = ["--use-scoring-server", "--teacher-topk", "4", "--distill-coef", "0.1"]


def _bytes(tensors) -> dict[str, int]:
    """Bytes of ``tensors``: as the tensor accounting counts them ("device") and as the CUDA caching allocator
    does ("allocator": blocks of 512 bytes)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    return {"device": sum(sizes), "allocator": sum(-(-size // 512) * 512 for size in sizes)}


def _run(argv, directory, owner):
    """Two scenarios (a local reward model; a scoring server for the reward model and teacher on rank ``owner``, moved in
    per request), each without and with offload: the final weights, the bytes the plan parks, whether the
    on-demand models are parked at the end, and (rank 0) the metrics records."""
    build = RLTrainer.build_placement
    results = {}
    for scenario, scenario_argv in (("local", []), ("served", SERVED + ["--scoring-server-rank", str(owner)])):
        for name, extra in (("plain", []), ("offload", OFFLOAD)):
            placements = []
            RLTrainer.build_placement = lambda *a: placements.append(build(*a)) or placements[-1]
            path = os.path.join(directory, f"{scenario}-{name}.jsonl")
            assert RLTrainer(parse_args(argv + scenario_argv + extra + ["--metrics-file", path])).train() == 0
            results[scenario, name] = _summary(placements[0], path)
    return results


def _summary(placement, metrics_path) -> dict:
    models = placement.models
    weights = {f"{m}.{k}": v.detach().cpu().clone() for m in ("actor", "critic")
               for k, v in models[m].module.state_dict().items()}
    weights.update({f"target.{k}": v.clone() for k, v in models["target critic"].target.params.items()})
    phase_moved = [m for m in models.values() if m.kind != "trained" and not m.on_demand]
    frozen = [t for m in phase_moved for t in [*m.module.parameters(), *m.module.buffers()]]
    # Every state tensor on the device is parked, the step counts too (on the device under fused Adam on a GPU,
    # where each holds a 512-byte allocator block).
    state = [t for m in models.values() if m.optimizer is not None
             for s in m.optimizer.optimizer.state.values() for t in s.values() if t.device == placement.device]
    on_demand = {m.name: all(p.data_ptr() == m.offloaders["weights"].pool[n].data_ptr()
                             for n, p in m.module.named_parameters())
                 for m in models.values() if m.on_demand and m.offloaders}
    allocated = {}
    if placement.device.type == "cuda":  # what the allocator holds in each phase, outside any transient
        for phase in ("generation", "scoring", "training"):
            with placement.phase(phase):
                allocated[phase] = torch.cuda.memory_allocated(placement.device)
    return {"weights": weights, "frozen": _bytes(frozen), "optimizer": _bytes(state), "allocated": allocated,
            "target_params": _bytes(models["target critic"].target.params.values())["device"],
            "pinned": [t.is_pinned() for m in models.values() for o in m.offloaders.values() for t in o.pool_tensors()],
            "cuda": torch.cuda.is_available(),
            "on_demand_parked": on_demand,
            "records": [json.loads(line) for line in open(metrics_path)] if dist.get_rank() == 0 else None}


def _numbers(records):
    return [{k: v for k, v in r.items() if not k.startswith(("mem_", "time_", "samples_per_s"))} for r in records]


def _check(results, owner: int):
    for rank in results:
        for scenario in ("local", "served"):
            plain, offload = rank[scenario, "plain"]["weights"], rank[scenario, "offload"]["weights"]
            assert plain.keys() == offload.keys()
            for key, value in plain.items():
                assert torch.equal(value, offload[key]), (scenario, key)
    for scenario in ("local", "served"):
        numbers = _numbers(results[0][scenario, "plain"]["records"])
        assert numbers == _numbers(results[0][scenario, "offload"]["records"]), scenario
        assert [r["iteration"] for r in numbers] == [1, 2, 3] and all("value_loss" in r for r in numbers)
    assert results[owner]["served", "offload"]["on_demand_parked"] == {"reward model": True, "teacher": True}
    plain, offload = results[0]["local", "plain"], results[0]["local", "offload"]
    frozen, optimizer = offload["frozen"], offload["optimizer"]
    assert frozen["device"] > 0 and optimizer["device"] > 0
    def parked(kind):
        return {"generation": frozen[kind] + optimizer[kind], "scoring": optimizer[kind], "training": frozen[kind]}

    for before, after in zip(plain["records"][1:], offload["records"][1:]):  # optimizer state exists from here
        for phase, expected in parked("device").items():
            drop = before[f"mem_{phase}_device_bytes"] - after[f"mem_{phase}_device_bytes"]
            assert abs(drop - expected) <= 0.05 * expected, (phase, drop, expected)
    for phase, expected in (parked("allocator").items() if offload["allocated"] else ()):
        drop = plain["allocated"][phase] - offload["allocated"][phase]
        assert abs(drop - expected) <= 0.05 * expected, (phase, "allocated", drop, expected)
        # The pool gains what is parked, except the target's weights, whose pool is the Polyak master.
        for phase in ("generation", "scoring", "training"):
            gained = after[f"mem_{phase}_pool_bytes"] - before[f"mem_{phase}_pool_bytes"]
            wanted = frozen["device"] - offload["target_params"] + optimizer["device"]
            assert abs(gained - wanted) <= 0.05 * wanted, (phase, gained, wanted)
    assert offload["pinned"] and all(offload["pinned"]) == offload["cuda"]  # pinned wherever CUDA is


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A reward-model checkpoint (an untrained critic over the example's byte vocabulary)."""
    path = str(tmp_path_factory.mktemp("reward_model"))
    config = GPTConfig(vocab_size=ByteTokenizer().vocab_size, num_layers=1, hidden_size=16, num_attention_heads=2,
                       max_position_embeddings=16, make_vocab_size_divisible_by=8)
    save_sharded(path, 0, [CriticModel(config)])
    return path


@pytest.mark.slow
def test_offload_keeps_numbers_and_frees_what_the_plan_parks(tmp_path, reward_model):
    argv = ARGV + ["--tensor-model-parallel-size", "2", "--reward-model", reward_model]
    _check(run_distributed(_run, 2, argv, str(tmp_path), 1, timeout=240), owner=1)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_on_one_gpu(tmp_path, reward_model):
    argv = ARGV + ["--tensor-model-parallel-size", "1", "--reward-model", reward_model]
    _check(run_distributed(_run, 1, argv, str(tmp_path), 0, timeout=240), owner=0)


def test_placement_moves_and_bad_input():
    for extra, message in ((["--target-critic-tau", "0.5", "--advantage-estimator", "grpo"], "needs --advantage"),
                           (["--target-critic-tau", "0"], r"rate in \(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            validate(parse_args(["--tensor-model-parallel-size", "1"] + extra), 1)
    placement = Placement(OffloadConfig(offload_frozen_models=True), "cpu")
    critic = CriticModel(GPTConfig(vocab_size=16, num_layers=1, hidden_size=8, num_attention_heads=2))
    placement.add_frozen("reference", critic)
    with pytest.raises(ValueError, match="already has a model named 'reference'"):
        placement.add_frozen("reference", critic)
    with pytest.raises(ValueError, match=r"phases \['rollout'\] must be a non-empty subset"):
        placement.add_frozen("reward model", critic, phases=("rollout",))
    with pytest.raises(ValueError, match="model 'meta' has tensors on meta; the placement's device is cpu"):
        placement.add_frozen("meta", torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="must be a PolyakTarget, got CriticModel"):
        placement.add_target("target", critic, critic)
    with pytest.raises(ValueError, match="'reference' is a frozen model, not a target"):
        placement.update_target("reference", critic)
    with pytest.raises(ValueError, match="unknown phase 'rollout'"):
        with placement.phase("rollout"):
            pass
    with pytest.raises(RuntimeError, match="phase 'training' started inside phase 'scoring'"):
        with placement.phase("scoring"), placement.phase("training"):
            pass
    placement.add_target("target", CriticModel(critic.config), PolyakTarget(critic, 0.5))
    rows = [line.split() for line in placement.table().splitlines()[1:]]
    assert rows[0] == ["model", "state", "generation", "scoring", "training"]
    assert ["reference", "weights", "pool", "device", "pool"] in rows
    assert ["target", "polyak", "master", "pool", "pool", "pool"] in rows
    # The pool is allocated once: every later cycle parks in the same tensors; loads make separate copies.
    pool = placement.models["reference"].offloaders["weights"].pool
    for cycle in range(2):
        for phase in ("generation", "scoring", "training"):
            with placement.phase(phase):
                parked = [p.data_ptr() == pool[n].data_ptr() for n, p in critic.named_parameters()]
                assert parked == [phase != "scoring"] * len(parked), (cycle, phase)
        if cycle == 0:
            first = {n: t.data_ptr() for n, t in pool.items()}
    assert {n: t.data_ptr() for n, t in pool.items()} == first
