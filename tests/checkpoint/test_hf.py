"""Hugging Face conversion: GPT-2 and Llama (GQA, untied) into megalite give the same logits, and back losslessly
(through the safetensors library; Llama's output is sharded with an index above --max-shard-size)."""

import json
import os
import re

import pytest
import torch

from megalite.checkpoint import CheckpointReader, load_model
from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf, read_hf_checkpoint
from megalite.testing import run_distributed
from tests.forked_commands import ForkedCommands

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 70


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                          tie_word_embeddings=False, rope_theta=500.0)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_round_trip_matches_logits_and_is_lossless(kind, tmp_path):
    model = _hf_model(kind)
    model.save_pretrained(tmp_path / "hf")
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "megalite"))
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        logits = load_model(str(tmp_path / "megalite"))(ids)
    assert logits.shape == (2, 10, VOCAB)
    assert (logits - expected).abs().max().item() <= 1e-4

    convert_megalite_to_hf(str(tmp_path / "megalite"), str(tmp_path / "back"),
                           max_shard_size="20KB" if kind == "llama" else "5GB")
    files = sorted(os.listdir(tmp_path / "back"))
    if kind == "llama":
        shards = [f for f in files if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
        assert len(shards) > 1 and all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
        assert files == sorted(["config.json", "generation_config.json", "model.safetensors.index.json", *shards])
        with open(tmp_path / "back" / "model.safetensors.index.json") as f:
            assert sorted(set(json.load(f)["weight_map"].values())) == shards
    else:
        assert files == ["config.json", "generation_config.json", "model.safetensors"]
    assert (json.loads((tmp_path / "back" / "generation_config.json").read_text())
            == json.loads((tmp_path / "hf" / "generation_config.json").read_text()))
    assert_same_hf_model(tmp_path / "hf", tmp_path / "back", type(model), ids, expected)


def assert_same_hf_model(original, back, model_class, ids, expected_logits):
    """``back`` has ``original``'s config.json and exactly its tensors, and transformers loads it to the same logits."""
    config, tensors = read_hf_checkpoint(str(original))
    config_back, tensors_back = read_hf_checkpoint(str(back))
    assert config_back == config
    assert sorted(tensors_back) == sorted(tensors)
    for name in tensors:
        assert torch.equal(tensors_back[name], tensors[name]), name
    reloaded = model_class.from_pretrained(str(back)).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected_logits)


@pytest.mark.slow
def test_command_line_and_bad_input(tmp_path):
    _hf_model("gpt2").save_pretrained(tmp_path / "hf")
    tool = os.path.join(ROOT, "tools", "convert_checkpoint.py")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    # Each command is its own process, forked from one helper that imported torch and the converters once
    # (tests/forked_commands.py); the second batch reads what the first one wrote.
    with ForkedCommands(env, ("torch", "megalite.checkpoint.hf", "megalite.checkpoint.megatron_convert",
                              "megalite.lora.peft"), timeout=120) as helper:
        done, missing = helper.run([
            ([tool, "--from", "hf", "--to", "megalite", "--input", str(tmp_path / "hf"), "--output",
              str(tmp_path / "m")], tmp_path, {}),
            ([tool, "--from", "hf", "--to", "megalite", "--input", str(tmp_path / "nowhere"), "--output",
              str(tmp_path / "m2")], tmp_path, {})])
        assert done.returncode == 0, done.stderr
        (tmp_path / "taken").mkdir()
        (tmp_path / "taken" / "keep.txt").write_text("mine")
        inspect, taken = helper.run([
            (["-m", "megalite.checkpoint", "inspect", str(tmp_path / "m")], tmp_path, {}),
            ([tool, "--from", "megalite", "--to", "hf", "--input", str(tmp_path / "m"), "--output",
              str(tmp_path / "taken")], tmp_path, {})])
    assert inspect.returncode == 0, inspect.stderr
    assert "iteration 0, written by 1 rank(s)" in inspect.stdout and "all match their sha256" in inspect.stdout
    assert re.search(r"decoder\.layers\.1\.self_attention\.linear_qkv\.weight +96x32 +float32 +1 +12\.0 KiB",
                     inspect.stdout)

    assert missing.returncode == 2
    assert f"error: Hugging Face directory {tmp_path / 'nowhere'} does not exist" in missing.stderr
    assert not os.path.exists(tmp_path / "m2")

    assert taken.returncode == 2 and "already exists and is not empty; refusing to overwrite" in taken.stderr
    assert os.listdir(tmp_path / "taken") == ["keep.txt"]

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "m3"))
    assert not os.path.exists(tmp_path / "m3")


def _tp2_rank(converted, resaved, ids):
    """Load a converted checkpoint at tp=2 (split), gather the logits, and save it again at tp=2 (merge)."""
    from megalite import checkpoint, topology
    from megalite.models import GPTModel
    from megalite.tensor_parallel import gather_from_tensor_parallel_region

    topo = topology.initialize(tp=2)
    config = checkpoint.CheckpointReader(converted).config
    model = GPTModel(config).eval()
    checkpoint.load_sharded(converted, [model])
    with torch.no_grad():
        logits = gather_from_tensor_parallel_region(model(ids), topo.tp.group)[..., :config.vocab_size]
    checkpoint.save_sharded(resaved, 1, [model])
    return logits


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_converted_checkpoint_splits_and_merges_at_tp2(kind, tmp_path):
    """Fused QKV (GPT-2 [q;k;v], Llama GQA groups) and gate/up split over 2 TP ranks give the HF logits,
    and the tp=2 shards merge back into the very tensors the converter wrote."""
    model = _hf_model(kind)
    model.save_pretrained(tmp_path / "hf")
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "megalite"))
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    per_rank = run_distributed(_tp2_rank, 2, str(tmp_path / "megalite"), str(tmp_path / "tp2"), ids, timeout=180)
    for logits in per_rank:
        assert (logits - expected).abs().max().item() <= 1e-4
    converted, resaved = CheckpointReader(str(tmp_path / "megalite")), CheckpointReader(str(tmp_path / "tp2"))
    assert sorted(resaved.shapes) == sorted(converted.shapes)
    for name in converted.shapes:
        assert torch.equal(resaved.read(name), converted.read(name)), name


def test_export_writes_each_shard_as_soon_as_it_is_full(tmp_path):
    """Streaming: a 1 KiB limit with 1 KiB tensors; by the time the fourth tensor is produced, the first
    two shards are already on disk (so memory holds one shard, not the model)."""
    from megalite.checkpoint.hf import write_hf_tensors

    on_disk = []

    def pairs():
        for i in range(4):
            on_disk.append(len(os.listdir(tmp_path)))
            yield f"t{i}", torch.full((256,), float(i))

    names = write_hf_tensors(str(tmp_path), pairs(), 1024)
    assert on_disk == [0, 0, 1, 2]
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)] + ["model.safetensors.index.json"]
    (tmp_path / "config.json").write_text("{}")
    _, tensors = read_hf_checkpoint(str(tmp_path))
    assert {n: t[0].item() for n, t in tensors.items()} == {"t0": 0.0, "t1": 1.0, "t2": 2.0, "t3": 3.0}
