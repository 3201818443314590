"""examples/pretrain_gpt.py from the command line: bad input fails fast with one clear line; SIGTERM saves."""

import glob
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.training.checkpointing import read_latest
from tests.forked_commands import PRELOAD, ForkedCommands, run_commands
from tests.training.helpers import read_metrics, tiny_argv

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")


def _env():
    """Environment of a one-process run, on a free port so parallel runs do not collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}


def _bad_inputs(tiny_data, tmp):
    """(name, command, expected message fragment) of every bad-input case."""
    corrupt = os.path.join(tmp, "corrupt")
    for suffix in (".idx", ".bin"):
        with open(corrupt + suffix, "wb") as f:
            f.write(b"this is not an index" * 4)
    wide = os.path.join(tmp, "wide")
    with IndexedDatasetBuilder(wide) as builder:
        for doc in range(24):
            builder.add_document(np.full(40, 300 if doc % 4 == 0 else 7))
    python = [sys.executable, SCRIPT]

    def torchrun(name):
        port = _env()["MASTER_PORT"]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                "--log-dir", os.path.join(tmp, "torchrun", name), "--redirects", "3", SCRIPT]

    return [
        ("missing-data", python + ["--data-path", os.path.join(tmp, "nowhere")],
         f"error: indexed dataset file '{os.path.join(tmp, 'nowhere')}.idx' does not exist"),
        ("corrupt-data", python + ["--data-path", corrupt], "not a Megatron indexed dataset"),
        ("vocab-too-small", torchrun("vocab-too-small") + ["--data-path", wide, "--split", "1,0,0", "--train-iters", "2",
                                        "--global-batch-size", "8", "--eval-iters", "0"],
         (f"error: dataset {wide}: document ", " holds token id 300, outside the vocabulary of 259 ids")),
        ("batch", python + ["--data-path", tiny_data, "--micro-batch-size", "3", "--global-batch-size", "8"],
         "error: global batch size 8 is not divisible by micro batch size 3 * data-parallel size 1 = 3"),
        ("heads-tp", torchrun("heads-tp") + ["--data-path", tiny_data, "--tensor-model-parallel-size", "2",
                                 "--num-attention-heads", "3", "--hidden-size", "48"],
         "error: num_attention_heads=3 is not divisible by the tensor-parallel size 2"),
        ("seq-max-pos", python + ["--data-path", tiny_data, "--seq-length", "128", "--max-position-embeddings", "64"],
         "error: sequence length 128 is greater than max position embeddings 64"),
        ("unknown-flag", python + ["--data-path", tiny_data, "--no-such-flag", "3"],
         "error: unrecognized arguments: --no-such-flag 3"),
        ("context-parallel", python + ["--context-parallel-size", "2"],
         "error: world size 1 is not divisible by tp*pp*cp = 1*1*2 = 2"),
        ("finetune-without-checkpoint", python + ["--data-path", tiny_data, "--finetune", "--load", f"{tmp}/none"],
         f"error: --finetune needs a checkpoint, but --load {tmp}/none holds none"),
        ("load-holds-no-checkpoint", python + ["--data-path", tiny_data, "--load", tmp],
         f"error: {tmp} holds corrupt.bin"),
    ]


@pytest.fixture(scope="module")
def bad_runs(tiny_data, tmp_path_factory):
    """Run every bad-input command at once, each in its own process forked after torch was imported once
    (tests/forked_commands.py); map name -> (fragment, exit code, each rank's output).

    A torchrun launch redirects each rank's output to files, so the launcher's own failure report
    stays out of what is checked.
    """
    tmp = str(tmp_path_factory.mktemp("bad"))
    cases = _bad_inputs(tiny_data, tmp)
    env = _env()
    done = run_commands([(cmd[1:], tmp, {"MASTER_PORT": _env()["MASTER_PORT"]}) for _, cmd, _ in cases], env,
                        timeout=180)
    results = {}
    for (name, _, fragment), proc in zip(cases, done):
        ranks = [proc.stdout + proc.stderr]
        if "torch.distributed.run" in proc.args:
            ranks = [_read_rank_logs(os.path.join(tmp, "torchrun", name), rank) for rank in (0, 1)]
        results[name] = (fragment, proc.returncode, ranks)
    return results


def _read_rank_logs(log_dir, local_rank):
    paths = glob.glob(os.path.join(log_dir, "*", "attempt_0", str(local_rank), "std*.log"))
    assert len(paths) == 2, paths
    return "".join(open(p).read() for p in sorted(paths))


@pytest.mark.parametrize("name", ["missing-data", "corrupt-data", "vocab-too-small", "batch", "heads-tp",
                                  "seq-max-pos", "unknown-flag", "context-parallel", "finetune-without-checkpoint",
                                  "load-holds-no-checkpoint"])
def test_bad_input_gives_one_error_line(bad_runs, name):
    """Every rank prints exactly one line ``[rank N] error: ...`` (no prefix for one process), its only line
    when the flags or files are bad (a bad token id is found once training runs, after rank 0's start-up
    lines); the exit code is non-zero.  Each rank prints its own line, so the message survives the launcher
    killing the others first.  A rank the launcher stopped before it reached its own checks (the first
    rank's exit makes torchrun stop the rest) has printed nothing; at least one rank must have the line."""
    fragments, code, ranks = bad_runs[name]
    assert code != 0
    assert any(output.strip() for output in ranks), ranks
    for rank, output in enumerate(ranks):
        prefix = f"[rank {rank}] error: " if len(ranks) > 1 else "error: "
        lines = output.strip().splitlines()
        if not lines and len(ranks) > 1 and name != "vocab-too-small":
            continue
        errors = [line for line in lines if line.startswith(prefix)]
        assert len(errors) == 1 and (len(lines) == 1 or (name == "vocab-too-small" and rank == 0)), output
        for fragment in (fragments if isinstance(fragments, tuple) else (fragments,)):
            assert fragment.removeprefix("error: ") in errors[0], output


def test_sigterm_saves_and_exits_zero(tiny_data, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_data, tmp_path, "--train-iters", "10000", "--save", str(save))
    proc = subprocess.Popen([sys.executable, SCRIPT, *argv], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    last = read_metrics(metrics)[-1]["iteration"]
    assert read_latest(str(save)) == last < 10000
    assert f"stopping after iteration {last}" in out


def _tree(directory):
    """Every file under ``directory`` with its size and modification time."""
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, files in os.walk(directory) for f in files}


def test_nothing_is_saved_or_loaded_unless_asked(tiny_data, tmp_path):
    """The Quickstart names its checkpoint directory; a second experiment of another size from the same
    working directory without --save/--load neither loads that checkpoint (it would refuse the architecture)
    nor writes one.  Before, pretrain_gpt.py defaulted both to checkpoints/gpt."""
    first = tiny_argv(tiny_data, tmp_path, "--train-iters", "3", "--save", "checkpoints/gpt", "--load",
                      "checkpoints/gpt")
    with ForkedCommands(_env(), PRELOAD + ("torch._dynamo", "torch.optim")) as helper:
        (run,) = helper.run([_pretrain(first, tmp_path)])
        assert run.returncode == 0, run.stderr
        assert read_latest(str(tmp_path / "checkpoints" / "gpt")) == 3
        # The planner's prediction for this layout at start, the measurement beside it after the warm-up iteration.
        lines = run.stdout.splitlines()
        plan = [i for i, line in enumerate(lines) if line.startswith("plan (") and " per rank (weights " in line]
        measured = [i for i, line in enumerate(lines) if line.startswith("measured after warm-up (plan): step ")]
        iteration_2 = next(i for i, line in enumerate(lines) if line.startswith("iteration 2/3"))
        assert len(plan) == 1 and len(measured) == 1 and plan[0] < iteration_2 < measured[0], run.stdout
        assert " max RSS (" in lines[measured[0]] and " MFU " in lines[measured[0]], lines[measured[0]]
        before = _tree(tmp_path / "checkpoints")
        other, fresh = tmp_path / "other", tmp_path / "fresh"
        other.mkdir()
        fresh.mkdir()
        second = tiny_argv(tiny_data, other, "--train-iters", "3", "--hidden-size", "48", "--num-layers", "1")
        runs = helper.run([_pretrain(second, tmp_path), _pretrain(tiny_argv(tiny_data, fresh, "--train-iters", "3"),
                                                                   fresh)])
    assert [run.returncode for run in runs] == [0, 0], [run.stderr for run in runs]
    assert [r["iteration"] for r in read_metrics(other / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    assert _tree(tmp_path / "checkpoints") == before
    assert not (fresh / "checkpoints").exists()


def _pretrain(argv, cwd):
    """``examples/pretrain_gpt.py ARGV`` from ``cwd`` as a ForkedCommands command, on a port of its own."""
    return [SCRIPT, *argv], cwd, {"MASTER_PORT": _env()["MASTER_PORT"]}
