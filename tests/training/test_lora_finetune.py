"""LoRA through the trainer: ``examples/pretrain_gpt.py --finetune --load BASE --lora-rank R`` at tp=2.

A tiny base is pretrained and saved; the LoRA run then trains adapters only: its first loss is the base
model's loss on the same batch (B starts at zero), the loss falls, the base weights stay as loaded, its
checkpoints hold adapter tensors (and their Adam moments) only, pp=2 gives the same losses, and a run stopped
and rerun resumes the adapters, their optimizer, the schedule and the data position exactly.
"""

import os
import runpy
import sys

import pytest
import torch

from megalite.checkpoint import CheckpointReader, load_model
from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.sampler import MicroBatchSampler
from megalite.lora.state import read_adapter_checkpoint
from megalite.testing import run_distributed
from megalite.training.arguments import validate_args
from megalite.training.checkpointing import read_latest
from megalite.training.flags import parse_args
from tests.training.helpers import read_metrics, tiny_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
ITERS, BATCH, SEQ = 6, 8, 16


def _example_on_rank(argv, watch_base):
    """examples/pretrain_gpt.py's main() on this rank with ``argv``; with ``watch_base``, returns whether every
    model-chunk tensor at the end equals its value at the first forward step (after --load)."""
    from megalite.training import gpt

    script = runpy.run_path(SCRIPT, run_name="lora_finetune_test")
    first, gpt_forward = {}, gpt.forward_step

    def forward_step(data_iterator, model):
        if not first:
            first.update({k: v.detach().clone() for k, v in model.state_dict().items()})
            first["_model"] = model
        return gpt_forward(data_iterator, model)

    if watch_base:  # main() passes gpt.forward_step to pretrain(): watch the chunks through it
        gpt.forward_step = forward_step
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        script["main"]()
    finally:
        if watch_base:
            gpt.forward_step = gpt_forward
    if not watch_base:
        return None
    model = first.pop("_model")
    return all(torch.equal(first[k], v) for k, v in model.state_dict().items()) and len(first) > 0


def _run(argv, workdir, watch_base=False):
    workdir.mkdir(parents=True, exist_ok=True)
    argv = tiny_argv(_run.data, workdir, "--tensor-model-parallel-size", "2", "--eval-iters", "0",
                     "--tensorboard-dir", "", *argv)
    results = run_distributed(_example_on_rank, 2, argv, watch_base, timeout=240)
    return results, read_metrics(workdir / "metrics.jsonl")


@torch.no_grad()
def _base_losses(data, base):
    """The base model's loss on each global batch the LoRA runs read (tiny_argv's split and seed; no eval)."""
    train, _, _ = build_train_valid_test_datasets([data], "90,10,0", SEQ, 1234, [ITERS * BATCH, 0, 0],
                                                  vocab_size=64)
    model, losses = load_model(str(base)), []
    for _, indices in zip(range(ITERS), MicroBatchSampler(len(train), 0, BATCH, BATCH, 0, 1)):
        tokens = torch.stack([train[i]["tokens"] for i in indices])
        losses.append(model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().item())
    return losses


@pytest.mark.slow
def test_lora_finetune_trains_adapters_only_and_resumes(tiny_data, tmp_path):
    _run.data = tiny_data
    base = tmp_path / "base"
    _run(["--train-iters", "3", "--save", str(base)], tmp_path / "pretrain")
    lora = ["--finetune", "--load", str(base), "--lora-rank", "4", "--lora-alpha", "16", "--train-iters", str(ITERS),
            "--lr", "1e-2"]

    results, full = _run([*lora, "--save", str(tmp_path / "adapters")], tmp_path / "full", watch_base=True)
    assert results == [True, True]  # the frozen base weights are unchanged on both TP ranks
    base_losses = _base_losses(tiny_data, base)
    losses = [r["loss"] for r in full]
    assert [r["iteration"] for r in full] == list(range(1, ITERS + 1))
    assert abs(losses[0] - base_losses[0]) <= 1e-5 * base_losses[0], (losses, base_losses)
    # Each iteration reads a new batch, so the loss falls against the base model's loss on the same batch.
    gaps = [b - a for a, b in zip(losses, base_losses)]
    assert all(gap > 0 for gap in gaps[2:]) and sum(gaps[3:]) / 3 > 0.02, (losses, base_losses)

    saved = CheckpointReader(str(tmp_path / "adapters"))
    assert saved.iteration == ITERS and saved.state["lora"]["rank"] == 4
    names = set(saved.shapes)
    adapters = {n for n in names if n.startswith("decoder.layers.") and n.endswith((".lora_A.weight",
                                                                                    ".lora_B.weight"))}
    assert len(adapters) == 2 * 4 * 2  # A and B of qkv, proj, fc1, fc2 in both layers
    moments = {f"optimizer.{key}.{n}" for key in ("exp_avg", "exp_avg_sq") for n in adapters}
    assert names == adapters | moments, sorted(names - adapters - moments)
    assert set(read_adapter_checkpoint(str(tmp_path / "adapters"))[2]) == adapters  # what export_peft is given

    # Pipeline-parallel (frozen embedding and output layer on other stages than most adapters): the same losses.
    _, piped = _run([*lora, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"],
                    tmp_path / "pp2")
    for record, reference in zip(piped, full, strict=True):
        assert abs(record["loss"] - reference["loss"]) <= 1e-5 * reference["loss"], (piped, full)

    # Stop after iteration 3 (saving), rerun the same command: it resumes and matches the run above.
    stopped = [*lora, "--save", str(tmp_path / "resumed")]
    _run([*stopped, "--exit-interval", "3"], tmp_path / "first_half")
    assert read_latest(str(tmp_path / "resumed")) == 3
    _, second = _run(stopped, tmp_path / "second_half")
    assert [r["iteration"] for r in second] == [4, 5, 6]
    for resumed, uninterrupted in zip(second, full[3:]):
        assert abs(resumed["loss"] - uninterrupted["loss"]) <= 1e-6 * uninterrupted["loss"], (resumed, uninterrupted)
        assert resumed["lr"] == pytest.approx(uninterrupted["lr"], rel=1e-12)


@pytest.mark.parametrize("extra, message", [
    ([], "--lora-rank needs --finetune --load BASE"),
    (["--finetune", "--use-torch-fsdp2"], "--lora-rank does not work with --use-torch-fsdp2"),
    (["--finetune", "--use-distributed-optimizer"], "--lora-rank does not work with --use-distributed-optimizer"),
    (["--finetune", "--num-experts", "4"], "--lora-rank does not work with --num-experts"),
    (["--finetune", "--lora-target-modules", "linear_qkv,q_proj"], "match no layer; the available ones are"),
    (["--finetune", "--hidden-size", "32", "--num-attention-heads", "4", "--lora-rank", "33"],
     r"LoRA rank 33 is larger than layer decoder.layers.0.self_attention.linear_qkv \(\[96, 32\]\) allows"),
])
def test_lora_flags_the_adapters_cannot_use_are_refused(tmp_path, extra, message):
    args = parse_args(["--load", str(tmp_path), "--lora-rank", "4", "--vocab-size", "64", *extra])
    with pytest.raises(ValueError, match=message):
        validate_args(args, 2)


def test_adapter_checkpoint_as_load_is_refused_before_the_process_group(tmp_path):
    """--load of an adapter checkpoint (no base weights in it): one line naming the fix, not a missing tensor."""
    from megalite.lora import LoRAConfig, apply_lora
    from megalite.lora.state import save_adapters
    from megalite.models import GPTConfig, GPTModel
    from megalite.training.setup import initialize

    config = GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16)
    save_adapters(str(tmp_path / "adapters"), 3, apply_lora(GPTModel(config), LoRAConfig(rank=2)))
    argv = ["--finetune", "--load", str(tmp_path / "adapters"), "--lora-rank", "2", "--vocab-size", "64"]
    with pytest.raises(ValueError, match="holds LoRA adapters, not a base model: pass the base model as --load"):
        initialize(argv)
