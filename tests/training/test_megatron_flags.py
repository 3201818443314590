"""Megatron's flags behave as in Megatron: one two-rank run that saves, one that resumes, and bad input.

Run A: --mock-data, --train-samples, --log-throughput, --log-memory, --log-params-norm, --log-num-zeros-in-grad,
implementation selectors accepted with one info line, test-split evaluation at the end,
--no-save-optim/--no-save-rng, and a --load without a checkpoint (one warning, a fresh start).
Run B resumes A with --no-load-optim/--no-load-rng/--override-opt-param-scheduler and stops at --exit-interval; then
--exit-duration-in-mins is agreed across ranks whose clocks disagree.
"""

import contextlib
import io
import time
from argparse import Namespace

import pytest
import torch

from megalite.checkpoint import CheckpointReader, save_global_checkpoint
from megalite.models import GPTConfig
from megalite.testing import run_distributed
from megalite.training.arguments import architecture_differences, use_checkpoint_architecture
from megalite.training.flags import parse_args
from megalite.training.setup import initialize
from tests.data.megatron_fixture import FIXTURE_PREFIX
from tests.training.helpers import read_metrics

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1", "--eval-interval", "100",
        "--eval-iters", "1", "--split", "80,10,10", "--mock-data", "--vocab-size", "64"]


def run_on_rank(argv, duration_check):
    from megalite.training import gpt, pretrain
    from megalite.training.training import _exit_reason

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        iteration = pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, argv=argv,
                             flops_per_token_func=gpt.flops_per_token)
    reason = None
    if duration_check:
        rank = torch.distributed.get_rank()
        args = Namespace(exit_interval=None, exit_duration_in_mins=1.0)
        reason = _exit_reason(args, 7, time.time() - (120 if rank == 0 else 0))
    return iteration, out.getvalue(), err.getvalue(), reason


def test_megatron_training_flags(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    argv_a = TINY + ["--train-samples", "24", "--log-throughput", "--save", str(a), "--load", str(a),
                     "--no-save-optim", "--no-save-rng", "--metrics-file", str(tmp_path / "a.jsonl"),
                     "--log-memory", "--log-params-norm", "--log-num-zeros-in-grad", "--use-mcore-models",
                     "--transformer-impl", "transformer_engine"]
    results = run_distributed(run_on_rank, 2, argv_a, False, timeout=240)
    (iteration, out, err, _), (_, out1, err1, _) = results
    assert iteration == 3 and err.count(f"WARNING: --load {a} holds no checkpoint; training starts from scratch") == 1
    assert not err1 and not out1
    assert "model: 5,616 parameters" in out and "data: mock data; train/valid/test samples 24/8/8" in out
    records = read_metrics(tmp_path / "a.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 3, 3]
    assert all(r["tflops"] > 0 for r in records[:3]) and records[3]["test_loss"] > 0 and "test_ppl" in records[3]
    # --log-memory, --log-params-norm, --log-num-zeros-in-grad: on the printed line and in the metrics file.
    assert all(r["max_rss_gib"] > 0 and r["params_norm"] > 0 and r["num_zeros"] >= 0 for r in records[:3])
    assert out.count(" | params_norm ") == out.count(" | num_zeros ") == out.count(" | max_rss_gib ") == 3
    assert out.count("info: accepted with no effect here: ") == 1
    assert ("info: accepted with no effect here: --use-mcore-models (megalite has one model implementation, in plain "
            "PyTorch); --transformer-impl (megalite's layers are its own PyTorch modules, without Transformer "
            "Engine)\n") in out
    saved = CheckpointReader(str(a))
    assert saved.iteration == 3 and saved.rank_state(0).get("rng") is None
    assert not any(name.startswith("optimizer.") for name in saved.shapes)

    # A longer run changes the LR decay length, which Megatron only resumes with --override-opt-param-scheduler.
    argv_b = TINY + ["--train-samples", "48", "--exit-interval", "5", "--load", str(a), "--save", str(b),
                     "--no-load-optim", "--no-load-rng", "--override-opt-param-scheduler",
                     "--metrics-file", str(tmp_path / "b.jsonl")]
    results = run_distributed(run_on_rank, 2, argv_b, True, timeout=240)
    (iteration, out, err, reason), (_, _, _, reason1) = results
    assert iteration == 5 and not err
    assert (f"loaded checkpoint {a} at iteration 3, layout tp=1 pp=1 dp=2 ep=1 vpp=None -> tp=1 pp=1 dp=2 ep=1 "
            "vpp=None") in out
    assert "--exit-interval 5 reached: stopping after iteration 5" in out
    assert [r["iteration"] for r in read_metrics(tmp_path / "b.jsonl")] == [4, 5]
    assert CheckpointReader(str(b)).iteration == 5
    assert reason == reason1 == "--exit-duration-in-mins 1.0 reached"


def _initialize_error(argv, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError) as info:
        initialize(argv)
    return str(info.value)


def test_bad_input_names_the_problem(tmp_path, monkeypatch):
    """Each is one ValueError before any process group exists (run_cli prints it as one line)."""
    data = ["--data-path", FIXTURE_PREFIX]
    good = {suffix: open(FIXTURE_PREFIX + suffix, "rb").read() for suffix in (".idx", ".bin")}

    def corrupt(name, idx=good[".idx"], bin_=good[".bin"]):
        broken = str(tmp_path / name)
        for suffix, raw in ((".idx", idx), (".bin", bin_)):
            with open(broken + suffix, "wb") as f:
                f.write(raw)
        return ["--data-path", broken, "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]

    cases = [
        (corrupt("magic", idx=b"MGLTIDX\x00\x00" + good[".idx"][9:]), "bad magic b'MGLTIDX\\x00\\x00', expected b'MMIDIDX"),
        (corrupt("version", idx=good[".idx"][:9] + b"\x02" + good[".idx"][10:]), "unsupported index version 2, expected 1"),
        (corrupt("short_idx", idx=good[".idx"][:-16]), "bytes, expected 4182 for 207 sequences and 208 document indices"),
        (corrupt("short_bin", bin_=good[".bin"][:-2]), "25230 bytes, expected 25232 (12616 tokens of uint16; truncated"),
        (data + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", FIXTURE_PREFIX + ".idx"],
         "GPT2BPETokenizer needs --merge-file to name an existing file, got None"),
        (data + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)],
         f"{tmp_path} holds no Hugging Face tokenizer"),
        (data + ["--tokenizer-type", "WordPiece"], "argument --tokenizer-type: invalid choice: 'WordPiece'"),
        (data + ["--finetune"], "--finetune needs --load"),
        (data + ["--finetune", "--use-checkpoint-args", "--load", str(tmp_path / "empty")],
         f"--finetune and --use-checkpoint-args need a checkpoint, but --load {tmp_path / 'empty'} holds none"),
        (data + ["--exit-on-missing-checkpoint", "--load", str(tmp_path / "empty")],
         f"--exit-on-missing-checkpoint needs a checkpoint, but --load {tmp_path / 'empty'} holds none"),
        (data + ["--train-iters", "5", "--train-samples", "40"], "--train-iters 5 and --train-samples 40 are mutually"),
        (data + ["--swiglu", "--openai-gelu"], "--swiglu and --openai-gelu are mutually exclusive"),
        (data + ["--recompute-method", "block"], "recompute_method='block' needs recompute_granularity 'full'"),
    ]
    for argv, message in cases:
        assert message in _initialize_error(argv, monkeypatch), (argv, message)


def test_checkpoint_architecture_is_taken_and_every_mismatch_is_named(tmp_path, monkeypatch):
    config = GPTConfig(vocab_size=512, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm",
                       activation="swiglu", ffn_hidden_size=48, add_bias_linear=False,
                       untie_embeddings_and_output_weights=True, max_position_embeddings=64)
    from megalite.checkpoint import global_shapes

    save_global_checkpoint(str(tmp_path / "ckpt"), config,
                           {n: torch.zeros(s) for n, s in global_shapes(config).items()})
    args = parse_args([])
    flags = use_checkpoint_architecture(args, CheckpointReader(str(tmp_path / "ckpt")).config_dict)
    assert "--swiglu" in flags and "--rotary-base 500000.0" in flags and "--disable-bias-linear" in flags
    assert args.group_query_attention and args.vocab_size == 512
    assert architecture_differences(CheckpointReader(str(tmp_path / "ckpt")).config_dict,
                                    GPTConfig(**{**vars(config), "moe": None})) == []
    message = _initialize_error(["--data-path", FIXTURE_PREFIX, "--tokenizer-type", "NullTokenizer",
                                 "--vocab-size", "511", "--load", str(tmp_path / "ckpt"), "--num-layers", "3", "--seq-length", "16"],
                                monkeypatch)
    assert message.startswith(f"checkpoint {tmp_path / 'ckpt'} holds a different architecture: ")
    for part in ("--num-layers is 2 in the checkpoint but 3 in this run",
                 "--hidden-size is 32 in the checkpoint but 128 in this run",
                 "--swiglu/--openai-gelu is 'swiglu' in the checkpoint but 'gelu' in this run",
                 "--untie-embeddings-and-output-weights is True in the checkpoint but False in this run",
                 "--rotary-base is 500000.0 in the checkpoint but 10000 in this run"):
        assert part in message, message
