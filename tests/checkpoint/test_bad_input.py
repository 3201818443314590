"""Bad checkpoints get one clear ValueError and change nothing; a killed save keeps the last checkpoint."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from megalite.checkpoint import CheckpointReader, load_checkpoint, load_model, read_latest, save_checkpoint
from megalite.checkpoint.format import rank_file, write_checkpoint
from megalite.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**changes):
    from megalite.models import GPTConfig

    return GPTConfig(**{"vocab_size": 30, "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
                        "make_vocab_size_divisible_by": 8, "seed": 7, **changes})


def _model(**changes):
    from megalite.models import GPTModel

    return GPTModel(_config(**changes))


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, snapshot):
    return all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def _save_tp2(path):
    from megalite import topology

    topology.initialize(tp=2)
    save_checkpoint(path, 1, [_model()])


def test_missing_truncated_and_foreign_checkpoints(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"checkpoint directory {missing} does not exist"):
        load_model(missing)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        load_model(str(tmp_path))

    tp2 = str(tmp_path / "tp2")
    run_distributed(_save_tp2, 2, tp2, timeout=120)
    with torch.no_grad():
        assert torch.equal(load_model(tp2)(torch.arange(6).view(1, 6)), _model().eval()(torch.arange(6).view(1, 6)))

    target = _model(seed=99)
    before = _snapshot(target)
    broken = str(tmp_path / "broken")
    shutil.copytree(tp2, broken)
    shard = rank_file(os.path.join(broken, "iter_0000001"), 1)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(ValueError, match="rank_00001.pt is unreadable \\(truncated or corrupt\\)"):
        load_checkpoint(broken, [target])
    os.remove(shard)
    with pytest.raises(ValueError, match="was saved by 2 ranks but the files of ranks \\[1\\] are missing"):
        load_checkpoint(broken, [target])

    with pytest.raises(ValueError, match="different architecture: num_layers is 2 in the checkpoint but 3 in the model"):
        load_checkpoint(tp2, [_model(num_layers=3)])
    other = _model(hidden_size=32, seed=99)
    other_before = _snapshot(other)
    with pytest.raises(ValueError, match="hidden_size is 16 in the checkpoint but 32 in the model"):
        load_checkpoint(tp2, [other])
    with pytest.raises(ValueError, match=f"checkpoint directory {missing} does not exist"):
        load_checkpoint(missing, [target])
    assert not os.path.exists(missing)
    assert _unchanged(target, before) and _unchanged(other, other_before)


def test_partly_covered_tensor_is_reported(tmp_path):
    piece = torch.ones(2, 4)
    write_checkpoint(str(tmp_path), 1, {"config": None, "tensors": {"w": {"shape": (3, 4), "pieces": [((0, 0), piece)]}}})
    reader = CheckpointReader(str(tmp_path))
    with pytest.raises(ValueError, match="'w' region \\(\\(0, 3\\), \\(0, 4\\)\\) is covered for only 8 of 12 elements"):
        reader.read("w")


_KILLED_SAVE = """
import sys, time
import torch
from megalite.checkpoint import format, save_checkpoint
from megalite.models import GPTConfig, GPTModel

model = GPTModel(GPTConfig(vocab_size=30, num_layers=2, hidden_size=16, num_attention_heads=4,
                           make_vocab_size_divisible_by=8, seed=7))
save_checkpoint(sys.argv[1], 1, [model])

def slow_write(path, state):
    with open(path, "wb") as f:
        f.write(b"partial")
        f.flush()
        print("writing", flush=True)
        time.sleep(120)

format._write_file = slow_write
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
save_checkpoint(sys.argv[1], 2, [model])
"""


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, save], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert read_latest(save) == 1
    assert os.path.exists(os.path.join(save, "iter_0000002.tmp"))
    with torch.no_grad():
        ids = torch.arange(6).view(1, 6)
        assert torch.equal(load_model(save)(ids), _model().eval()(ids))
    save_checkpoint(save, 2, [_model()])
    assert read_latest(save) == 2 and sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002", "latest"]
