"""What a checkpoint write costs beyond the bytes: the manifest's block hashes of each data file are computed
while the file is written (not in a second pass over it)."""

import os

import torch

from megalite.checkpoint import integrity, load_model, save_sharded, writer
from megalite.models import GPTConfig, GPTModel

CONFIG = GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                   make_vocab_size_divisible_by=8, seed=3)


def test_data_files_are_hashed_while_written(tmp_path, monkeypatch):
    # Blocks of 4 KiB: each data file spans dozens of blocks, with writes straddling their boundaries.
    monkeypatch.setattr(integrity, "HASH_BLOCK", 4096)
    monkeypatch.setattr(writer, "HASH_BLOCK", 4096, raising=False)
    hashed_after = []
    real = integrity.file_digests

    def spy(path):
        hashed_after.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(integrity, "file_digests", spy)
    model = GPTModel(CONFIG)
    directory = save_sharded(str(tmp_path / "ckpt"), 1, [model])
    manifest = integrity.read_manifest(directory)
    data = sorted(name for name in manifest["files"] if integrity.is_data_file(name))
    assert data and not [name for name in hashed_after if integrity.is_data_file(name)]
    for name in data:
        digests = manifest["files"][name]["sha256"]
        assert len(digests) > 10
        assert digests == real(os.path.join(directory, name))
    assert integrity.verify_files(directory, manifest) is None
    loaded = load_model(str(tmp_path / "ckpt"))
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_a_block_hashed_in_pieces_equals_its_digest(tmp_path, monkeypatch):
    """The writer's helper thread reads a block a piece at a time (a piece of memory, not a block): the digests equal
    those of whole blocks, for files ending inside a piece, at a piece boundary and at a block boundary."""
    monkeypatch.setattr(integrity, "HASH_BLOCK", 4096)
    monkeypatch.setattr(integrity, "HASH_READ", 1000)
    for size in (5, 999, 1000, 4095, 4096, 4097, 3 * 4096 + 1500):
        data = os.urandom(size)
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert [integrity.hash_block(fd, i) for i in range(-(-size // 4096))] == integrity.block_digests(data)
        finally:
            os.close(fd)
