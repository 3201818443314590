"""Asynchronous save: the checkpoint holds the weights of the save call (no torn state) although training
changes them while the write runs, ``latest`` moves only once the write is verified, and a kill -9
during the background write keeps the previous checkpoint."""

import threading

import torch

from megalite.checkpoint import AsyncSaver, load_model, read_latest, save_sharded
from megalite.checkpoint import writer as checkpoint_writer
from tests.checkpoint.test_bad_input import kill_mid_write


def _model(seed=7):
    from megalite.models import GPTConfig, GPTModel

    return GPTModel(GPTConfig(vocab_size=30, num_layers=2, hidden_size=16, num_attention_heads=4,
                              make_vocab_size_divisible_by=8, seed=seed))


def test_async_save_writes_the_state_of_the_save_call(tmp_path, monkeypatch):
    save = str(tmp_path / "ckpt")
    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    release, started = threading.Event(), threading.Event()
    real_save = checkpoint_writer.dcp.save

    def gated_save(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_writer.dcp, "save", gated_save)
    saver = AsyncSaver()
    save_sharded(save, 5, [model], saver=saver)
    assert started.wait(60) and saver.in_flight
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-3.0).add_(1.0)
    assert read_latest(save) is None
    release.set()
    saver.close()
    assert read_latest(save) == 5
    loaded = load_model(save)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert not torch.equal(model.state_dict()["embedding.word_embeddings.weight"],
                           expected["embedding.word_embeddings.weight"])


_KILLED_ASYNC_SAVE = """
import sys, time
import torch
from megalite.checkpoint import AsyncSaver, integrity, save_sharded
from megalite.models import GPTConfig, GPTModel

model = GPTModel(GPTConfig(vocab_size=30, num_layers=2, hidden_size=16, num_attention_heads=4,
                           make_vocab_size_divisible_by=8, seed=7))
save_sharded(sys.argv[1], 1, [model])
real_hash = integrity.file_digests

def slow_hash(path):
    print("writing", flush=True)
    time.sleep(120)
    return real_hash(path)

integrity.file_digests = slow_hash
saver = AsyncSaver()
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
save_sharded(sys.argv[1], 2, [model], saver=saver)
while True:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)
    time.sleep(0.01)
"""


def test_kill_during_async_write_keeps_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    kill_mid_write(_KILLED_ASYNC_SAVE, save)
    with torch.no_grad():
        ids = torch.arange(6).view(1, 6)
        assert torch.equal(load_model(save)(ids), _model().eval()(ids))
