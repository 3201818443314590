"""Streaming Hugging Face conversion: converting a many-layer model either way holds about one layer plus one
output shard, not the model; the result is the same model (a round trip gives back every tensor exactly).

Peak memory is the growth of the resident set of a rank process of ``run_distributed`` (forked from its clean
fork server; its high-water mark reset just before the conversion: ``/proc/self/clear_refs``), with the allocator setting the conversion tool uses
(:func:`megalite.checkpoint.memory.return_freed_tensors`) and after a warm-up conversion of a tiny model (imports
and first-use costs are not the conversion's).
"""

import json
import os
import sys

import pytest
import torch

from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf, write_hf_tensors
from megalite.checkpoint.hf.files import open_hf_tensors
from megalite.checkpoint.integrity import HASH_BLOCK
from megalite.checkpoint.memory import return_freed_tensors
from megalite.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")

MiB = 1 << 20
SLACK = HASH_BLOCK + 4 * MiB
"""The stated constant on top of one layer and one output shard: hashing a written or read file maps one
16 MiB block at a time, plus 4 MiB for the interpreter, the allocator and the DCP / safetensors bookkeeping
(measured peaks: 16.4-19.7 MiB in all, against bounds of 27.8 and 29.8 MiB and a 61 MiB model)."""
SHARD = 4 * MiB


def _write_qwen3(path, layers: int, hidden: int, vocab: int = 1024) -> tuple[int, int]:
    """A Qwen3 checkpoint of random weights in 4 MiB safetensors shards with an index; returns (largest layer's
    bytes, largest tensor's bytes)."""
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 128, head_dim=64, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    q, kv, ffn = hidden, hidden // 2, 4 * hidden
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
             "self_attn.q_norm.weight": (64,), "self_attn.k_norm.weight": (64,),
             "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
             "mlp.down_proj.weight": (hidden, ffn)}
    shapes.update({f"model.layers.{i}.{name}": shape for i in range(layers) for name, shape in layer.items()})
    generator = torch.Generator().manual_seed(0)
    os.makedirs(path)
    write_hf_tensors(str(path), ((name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()),
                     4 * MiB)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_dict(), f)
    sizes = {name: 4 * torch.Size(shape).numel() for name, shape in layer.items()}
    # the megalite layer: q/k/v fused, gate/up fused (the largest tensor)
    return sum(sizes.values()), 2 * sizes["mlp.gate_proj.weight"]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _peak_growth(to: str, tiny: tuple, model: tuple, *extra) -> int:
    """Bytes the resident set grows by at most while ``model`` (input, output) converts ``to`` "megalite" or "hf",
    after converting ``tiny``; in a rank process of run_distributed (forked from its clean fork server)."""
    convert = convert_hf_to_megalite if to == "megalite" else convert_megalite_to_hf
    assert return_freed_tensors()
    convert(*tiny, *extra)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts at the current resident set
    base = _status("VmRSS")
    convert(*model, *extra)
    return _status("VmHWM") - base


@pytest.mark.slow
def test_conversion_both_ways_streams_layer_by_layer(tmp_path):
    layer, largest = _write_qwen3(tmp_path / "hf", layers=16, hidden=256)
    _write_qwen3(tmp_path / "tiny", layers=1, hidden=128)
    whole = sum(os.path.getsize(tmp_path / "hf" / name) for name in os.listdir(tmp_path / "hf"))
    assert whole > 2 * (layer + SHARD + SLACK)  # holding the model would break the bounds below

    def paths(*names):
        return tuple(str(tmp_path / name) for name in names)

    to_megalite = run_distributed(_peak_growth, 1, "megalite", paths("tiny", "tiny.m"), paths("hf", "m"))[0]
    # one layer in hand plus the tensor being written (its output chunk)
    assert to_megalite <= layer + largest + SLACK, (to_megalite / MiB, layer / MiB)

    to_hf = run_distributed(_peak_growth, 1, "hf", paths("tiny.m", "tiny.back"), paths("m", "back"), SHARD)[0]
    # one output shard filling up plus the megalite tensor being split
    assert to_hf <= layer + SHARD + SLACK, (to_hf / MiB, layer / MiB)

    original, back = open_hf_tensors(str(tmp_path / "hf")), open_hf_tensors(str(tmp_path / "back"))
    assert sorted(original.keys()) == sorted(back.keys())
    for name in original.keys():
        assert torch.equal(original.pop(name), back.pop(name)), name


def test_export_hashes_each_data_file_once(tmp_path, monkeypatch):
    """Reading a checkpoint tensor by tensor maps and hashes its data file once, not once per tensor (which made
    exporting a large model quadratic in its size)."""
    from megalite.checkpoint import stored_chunks

    _write_qwen3(tmp_path / "hf", layers=2, hidden=128)
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "m"))
    hashed = []
    digests = stored_chunks.mapped_digests
    monkeypatch.setattr(stored_chunks, "mapped_digests", lambda data: hashed.append(len(data)) or digests(data))
    convert_megalite_to_hf(str(tmp_path / "m"), str(tmp_path / "back"))
    assert len(hashed) == 1
