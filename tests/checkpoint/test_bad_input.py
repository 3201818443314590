"""Bad checkpoints get one clear ValueError and change nothing; a failed or killed save keeps the last checkpoint.

Covers: missing directory, no checkpoint, a missing shard file, a truncated metadata file, a flipped
byte, another architecture, a DCP directory that is not megalite's, planted malicious pickles (refused
without running), a partly covered tensor, a disk-full save (also in the middle of a data file), and a save
killed mid-write.
"""

import contextlib
import errno
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megalite.checkpoint import CheckpointWriteError, load_sharded, load_model, read_latest, save_sharded
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.storage import TensorShard
from megalite.checkpoint.writer import write_checkpoint
from megalite.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**changes):
    from megalite.models import GPTConfig

    return GPTConfig(**{"vocab_size": 30, "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
                        "make_vocab_size_divisible_by": 8, "seed": 7, **changes})


def small_gpt(**changes):
    from megalite.models import GPTModel

    return GPTModel(_config(**changes))


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, snapshot):
    return all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def _save_tp2(path):
    from megalite import topology

    topology.initialize(tp=2)
    save_sharded(path, 1, [small_gpt()])


def load_tp2_error(path):
    """Every rank's error when all ranks load ``path`` at tp=2 together (they agree, so none hangs)."""
    import torch.distributed as dist

    from megalite import topology

    topology.initialize(tp=2)
    model = small_gpt(seed=99)
    before = _snapshot(model)
    try:
        load_sharded(path, [model], group=dist.group.WORLD)
    except ValueError as err:
        return str(err), _unchanged(model, before)
    return None, _unchanged(model, before)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst, os.path.join(dst, "iter_0000001")


def rehash(directory, name):
    """Update the manifest entry of ``name``, as someone who planted a file would."""
    import hashlib

    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    with open(os.path.join(directory, name), "rb") as f:
        data = f.read()
    block = manifest["block_size"]
    manifest["files"][name] = {"size": len(data), "sha256": [hashlib.sha256(data[i:i + block]).hexdigest()
                                                             for i in range(0, len(data), block)]}
    with open(path, "w") as f:
        json.dump(manifest, f)


def flip_byte(path, offset):
    """Flip the lowest bit of byte ``offset`` of file ``path`` (same size, other content)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: code execution, which loading must refuse."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_missing_truncated_flipped_foreign_and_malicious_checkpoints(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"checkpoint directory {missing} does not exist"):
        load_model(missing)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        load_model(str(tmp_path))

    tp2 = str(tmp_path / "tp2")
    run_distributed(_save_tp2, 2, tp2, timeout=120)
    with torch.no_grad():
        assert torch.equal(load_model(tp2)(torch.arange(6).view(1, 6)), small_gpt().eval()(torch.arange(6).view(1, 6)))
    target = small_gpt(seed=99)
    before = _snapshot(target)

    broken, directory = _copy(tp2, str(tmp_path / "truncated"))
    metadata = os.path.join(directory, ".metadata")
    with open(metadata, "r+b") as f:
        f.truncate(os.path.getsize(metadata) // 2)
    with pytest.raises(ValueError, match=r"\.metadata has \d+ bytes, the manifest records \d+ \(truncated"):
        load_sharded(broken, [target])

    broken, directory = _copy(tp2, str(tmp_path / "missing_shard"))
    os.remove(os.path.join(directory, "__1_0.distcp"))
    with pytest.raises(ValueError, match=r"checkpoint file .*missing_shard/iter_0000001/__1_0\.distcp is missing"):
        load_sharded(broken, [target])

    broken, directory = _copy(tp2, str(tmp_path / "flipped"))
    shard = os.path.join(directory, "__0_0.distcp")
    flip_byte(shard, os.path.getsize(shard) // 2)
    with pytest.raises(ValueError, match=r"flipped/iter_0000001/__0_0\.distcp fails its content hash check"):
        load_sharded(broken, [target])
    with pytest.raises(ValueError, match="fails its content hash check"):
        load_model(broken)
    for error, unchanged in run_distributed(load_tp2_error, 2, broken, timeout=120):
        assert error is not None and "__0_0.distcp fails its content hash check" in error and unchanged

    with pytest.raises(ValueError, match="different architecture: num_layers is 2 in the checkpoint but 3 in the model"):
        load_sharded(tp2, [small_gpt(num_layers=3)])
    other = small_gpt(hidden_size=32, seed=99)
    other_before = _snapshot(other)
    with pytest.raises(ValueError, match="hidden_size is 16 in the checkpoint but 32 in the model"):
        load_sharded(tp2, [other])
    with pytest.raises(ValueError, match=f"checkpoint directory {missing} does not exist"):
        load_sharded(missing, [target])
    assert not os.path.exists(missing)

    import torch.distributed.checkpoint as dcp

    foreign = str(tmp_path / "foreign")
    dcp.save({"weight": torch.ones(3)}, checkpoint_id=foreign, no_dist=True)
    with pytest.raises(ValueError, match="is a torch.distributed.checkpoint directory but not a megalite checkpoint"):
        load_sharded(foreign, [target])

    marker = str(tmp_path / "payload_ran")
    broken, directory = _copy(tp2, str(tmp_path / "evil_metadata"))
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    rehash(directory, ".metadata")
    with pytest.raises(ValueError, match=r"\.metadata is unreadable \(truncated, corrupt or unsafe\): .*open is not allowed"):
        load_sharded(broken, [target])
    broken, directory = _copy(tp2, str(tmp_path / "evil_shard"))
    with open(os.path.join(directory, "__0_0.distcp"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    rehash(directory, "__0_0.distcp")
    with pytest.raises(ValueError, match=r"reading .*evil_shard/iter_0000001 failed: .*__0_0\.distcp holds no plain "
                                          r"record of .* \(corrupt, altered"):
        load_sharded(broken, [target])
    assert not os.path.exists(marker)
    assert _unchanged(target, before) and _unchanged(other, other_before)


def _load_tp2_error_with_blocks(path, block):
    from megalite.checkpoint import integrity

    integrity.HASH_BLOCK = block
    return load_tp2_error(path)


def test_a_flip_in_any_hash_block_is_caught_by_the_rank_that_hashes_it(tmp_path, monkeypatch):
    """Small hash blocks: the one data file spans many blocks, split between the two loading ranks; a flip
    in its last block (rank 1's share) is one error on both ranks, and nothing is loaded."""
    from megalite.checkpoint import integrity

    block = 1024
    monkeypatch.setattr(integrity, "HASH_BLOCK", block)
    save = str(tmp_path / "ckpt")
    save_sharded(save, 1, [small_gpt()])
    directory = os.path.join(save, "iter_0000001")
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["block_size"] == block
    assert all(len(entry["sha256"]) == -(-entry["size"] // block) for entry in manifest["files"].values())
    shard = os.path.join(directory, "__0_0.distcp")
    assert len(manifest["files"]["__0_0.distcp"]["sha256"]) > 4
    flip_byte(shard, os.path.getsize(shard) - 100)
    for error, unchanged in run_distributed(_load_tp2_error_with_blocks, 2, save, block, timeout=120):
        assert error is not None and "__0_0.distcp fails its content hash check" in error and unchanged


def test_partly_covered_tensor_is_reported(tmp_path):
    write_checkpoint(str(tmp_path), 1, [TensorShard("w", (3, 4), (0, 0), torch.ones(2, 4))], {"config": None})
    reader = CheckpointReader(str(tmp_path))
    with pytest.raises(ValueError, match="'w' region \\(\\(0, 3\\), \\(0, 4\\)\\) is covered for only 8 of 12 elements"):
        reader.read("w")


@contextlib.contextmanager
def full_disk():
    """A disk with no room for checkpoint data files: opening one for writing fails with ENOSPC."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    def full(self, path, mode):
        if "distcp" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, path, mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(filesystem.FileSystem, "create_stream", full)
        yield


def test_disk_full_during_save_is_one_error_and_keeps_latest(tmp_path):
    save = str(tmp_path / "ckpt")
    save_sharded(save, 1, [small_gpt()])
    with full_disk(), pytest.raises(CheckpointWriteError, match=f"saving iteration 2 to {save} failed: no space left "
                                                                f"on {save} \\(needed about 1 MiB\\); the partial "
                                                                "iter_0000002.tmp was removed and latest still names "
                                                                "iteration 1"):
        save_sharded(save, 2, [small_gpt(seed=3)])
    assert read_latest(save) == 1 and sorted(os.listdir(save)) == ["iter_0000001", "latest"]
    with torch.no_grad():
        ids = torch.arange(6).view(1, 6)
        assert torch.equal(load_model(save)(ids), small_gpt().eval()(ids))


class _FillsUp:
    """A write stream on a disk that is full after ``room`` bytes."""

    def __init__(self, stream, room):
        self._stream, self._room = stream, room

    def write(self, data):
        size = memoryview(data).nbytes
        if size > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= size
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def test_disk_full_in_the_middle_of_a_data_file_says_no_space_and_how_much(tmp_path, monkeypatch):
    """torch.save reports a failed write only as 'unexpected pos'; the error names the full disk and the size."""
    from torch.distributed.checkpoint import filesystem

    save = str(tmp_path / "ckpt")
    real = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def filling(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FillsUp(stream, 600) if "distcp" in str(path) and "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", filling)
    model = small_gpt(hidden_size=64)
    needed = sum(p.nbytes for p in model.state_dict().values())
    with pytest.raises(CheckpointWriteError) as err:
        save_sharded(save, 1, [model])
    assert str(err.value) == (f"saving iteration 1 to {save} failed: no space left on {save} (needed about "
                              f"{-(-needed // 2 ** 20)} MiB); the partial iter_0000001.tmp was removed and latest "
                              "still names no checkpoint")
    assert os.listdir(save) == []


KILLED_SAVE = """
import sys, time
import torch
from megalite.checkpoint import integrity, save_sharded
from megalite.models import GPTConfig, GPTModel

model = GPTModel(GPTConfig(vocab_size=30, num_layers=2, hidden_size=16, num_attention_heads=4,
                           make_vocab_size_divisible_by=8, seed=7))
save_sharded(sys.argv[1], 1, [model])

def slow_hash(path):
    print("writing", flush=True)
    time.sleep(120)

integrity.file_digests = slow_hash
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
save_sharded(sys.argv[1], 2, [model])
"""


def kill_mid_write(script: str, save: str) -> None:
    """Run ``script save`` (it saves iteration 1, then prints "writing" inside the write of iteration 2),
    kill -9 it there, and check that ``latest`` still names iteration 1 and the partial write is a ``.tmp``."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, save], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert read_latest(save) == 1
    assert os.path.exists(os.path.join(save, "iter_0000002.tmp"))


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    kill_mid_write(KILLED_SAVE, save)
    with torch.no_grad():
        ids = torch.arange(6).view(1, 6)
        assert torch.equal(load_model(save)(ids), small_gpt().eval()(ids))
    save_sharded(save, 2, [small_gpt()])
    assert read_latest(save) == 2 and sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002", "latest"]


def test_inspect_of_a_bad_directory_is_one_error_line_and_exit_status_2(tmp_path, capsys):
    from megalite.checkpoint.__main__ import main
    from megalite.cli import run_cli

    assert run_cli(main, ["inspect", str(tmp_path / "missing")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: checkpoint directory {tmp_path / 'missing'} does not exist\n"
