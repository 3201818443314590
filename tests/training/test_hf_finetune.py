"""Fine-tuning a Hugging Face model: convert, train at tp=2 with only data and tokenizer flags, convert back.

GPT-2 (tanh GELU, learned positions) and a Llama-3-style model (GQA, rope_theta 500000, untied
output, a head dimension other than hidden/heads) are built with transformers.  The first
iteration's loss equals the HF model's loss on the same batch; the exported model's logits equal
megalite's; the export carries the run's tokenizer.
"""

import contextlib
import io
import json
import os

import pytest
import torch

from megalite.checkpoint import load_model
from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf
from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.sampler import MicroBatchSampler
from megalite.testing import run_distributed
from tests.data.megatron_fixture import FIXTURE_DIR, FIXTURE_PREFIX
from tests.training.helpers import read_metrics

transformers = pytest.importorskip("transformers")
VOCAB, SEQ, BATCH = 512, 32, 4


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         activation_function="gelu_new", resid_pdrop=0.0, attn_pdrop=0.0,
                                         embd_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                          max_position_embeddings=64, tie_word_embeddings=False, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.eval()


def _first_batch():
    """The first global batch pretrain() reads with the flags below (default seed, no eval samples)."""
    train, _, _ = build_train_valid_test_datasets([FIXTURE_PREFIX], "100,0,0", SEQ, 1234, [BATCH, 0, 0])
    indices = next(iter(MicroBatchSampler(len(train), 0, BATCH, BATCH, 0, 1)))
    return torch.stack([train[i]["tokens"] for i in indices])


def _finetune_on_rank(argv):
    """pretrain() on this rank; returns what it printed."""
    from megalite.training import gpt, pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, argv=argv)
    return out.getvalue()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_finetune_hf_model_at_tp2_and_export(kind, tmp_path):
    model = _hf_model(kind)
    model.save_pretrained(tmp_path / "hf")
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "converted"))
    tokens = _first_batch()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()

    argv = ["--data-path", FIXTURE_PREFIX, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", os.path.join(FIXTURE_DIR, "hf_tokenizer"), "--split", "100,0,0",
            "--load", str(tmp_path / "converted"), "--use-checkpoint-args", "--finetune",
            "--tensor-model-parallel-size", "2", "--seq-length", str(SEQ), "--micro-batch-size", str(BATCH),
            "--global-batch-size", str(BATCH), "--train-iters", "1", "--eval-iters", "0", "--lr", "1e-3", "--lr-decay-style", "constant",
            "--save", str(tmp_path / "tuned"), "--metrics-file", str(tmp_path / "metrics.jsonl")]
    printed = run_distributed(_finetune_on_rank, 2, argv, timeout=240)[0]
    loss = read_metrics(tmp_path / "metrics.jsonl")[0]["loss"]
    assert abs(loss - hf_loss) <= 1e-4 * hf_loss, (loss, hf_loss)
    assert (f"loaded checkpoint {tmp_path / 'converted'} at iteration 0 (--finetune: model weights only, starting "
            f"at iteration 0), layout tp=1 pp=1 dp=1 ep=1 vpp=None -> tp=2 pp=1 dp=1 ep=1 vpp=None") in printed
    assert "--num-layers 2 --hidden-size 32" in printed

    convert_megalite_to_hf(str(tmp_path / "tuned"), str(tmp_path / "back"))
    back = type(model).from_pretrained(str(tmp_path / "back")).eval()
    ids = tokens[:2, :16]
    with torch.no_grad():
        expected = load_model(str(tmp_path / "tuned"))(ids)
        assert (back(ids).logits - expected).abs().max().item() <= 1e-4
        assert (back(ids).logits - model(ids).logits).abs().max().item() > 1e-4, "the step changed nothing"
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (exported["eos_token_id"], exported["bos_token_id"]) == (0, 0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert tokenizer("hello world").input_ids == \
        transformers.AutoTokenizer.from_pretrained(os.path.join(FIXTURE_DIR, "hf_tokenizer"))("hello world").input_ids


def _held_out_batch():
    """4 samples after the 5 global batches the journey below trains on."""
    train, _, _ = build_train_valid_test_datasets([FIXTURE_PREFIX], "100,0,0", SEQ, 1234, [12 * BATCH, 0, 0])
    return torch.stack([train[i]["tokens"] for i in range(len(train) - BATCH, len(train))])


@pytest.mark.slow
def test_qwen3_fine_tune_journey(tmp_path):
    """Qwen3-style tiny model from HF -> convert (its tokenizer travels) -> examples/pretrain_gpt.py
    --use-checkpoint-args --finetune, 5 iterations at tp=2 -> convert back (the original config.json and
    generation_config.json) -> transformers' loss on a held-out batch equals megalite's."""
    import shutil
    import socket
    import subprocess
    import sys

    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0,
                                      eos_token_id=[0, 2])  # the fixture tokenizer's eos (0) and one more
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "hf")
    for name in os.listdir(os.path.join(FIXTURE_DIR, "hf_tokenizer")):
        shutil.copy(os.path.join(FIXTURE_DIR, "hf_tokenizer", name), tmp_path / "hf" / name)
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "converted"))

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
               os.path.join(root, "examples", "pretrain_gpt.py"), "--data-path", FIXTURE_PREFIX,
               "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
               str(tmp_path / "converted" / "hf_tokenizer"), "--split", "100,0,0",
               "--load", str(tmp_path / "converted"), "--use-checkpoint-args", "--finetune",
               "--tensor-model-parallel-size", "2", "--seq-length", str(SEQ), "--micro-batch-size", str(BATCH),
               "--global-batch-size", str(BATCH), "--train-iters", "5", "--eval-iters", "0", "--lr", "1e-3",
               "--lr-decay-style", "constant", "--lr-warmup-fraction", "0", "--tensorboard-dir",
               str(tmp_path / "runs"), "--save", str(tmp_path / "tuned")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]

    convert_megalite_to_hf(str(tmp_path / "tuned"), str(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    tokens = _held_out_batch()
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(back(ids).logits.reshape(-1, VOCAB), labels.reshape(-1))
        ours = load_model(str(tmp_path / "tuned"))(ids, labels=labels).mean()
        before = torch.nn.functional.cross_entropy(model(ids).logits.reshape(-1, VOCAB), labels.reshape(-1))
    assert abs(hf_loss.item() - ours.item()) <= 1e-5 * ours.item(), (hf_loss.item(), ours.item())
    assert abs(before.item() - ours.item()) > 1e-4, "fine-tuning changed nothing"
    for name in ("config.json", "generation_config.json"):  # the original's files, carried through training
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((tmp_path / "hf" / name).read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert tokenizer("hello world").input_ids == \
        transformers.AutoTokenizer.from_pretrained(os.path.join(FIXTURE_DIR, "hf_tokenizer"))("hello world").input_ids
