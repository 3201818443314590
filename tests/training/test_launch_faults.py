"""Faults under torchrun: a stalled collective, SIGTERM while blocked, SIGTERM to the agent, a killed worker
and a killed launcher under tools/supervise.py (automatic restart, no orphans), and a two-agent multi-node run."""

import glob
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megalite.testing import run_distributed
from megalite.training.checkpointing import read_latest
from tests.leftover_processes import running
from tests.training.helpers import pretrain_on_rank, read_metrics, tiny_argv

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULT_SCRIPT = os.path.join(ROOT, "tests", "training", "fault_script.py")
PRETRAIN = os.path.join(ROOT, "examples", "pretrain_gpt.py")


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **extra}


def _torchrun(log_dir, nproc=2, *launch):
    return [sys.executable, "-m", "torch.distributed.run", *(launch or ("--standalone",)), "--nproc_per_node",
            str(nproc), "--log-dir", str(log_dir), "--redirects", "3"]


def _rank_log(log_dir, local_rank, attempt=0):
    """Everything worker ``local_rank`` printed, over every torchrun run logged in ``log_dir``."""
    paths = sorted(glob.glob(os.path.join(str(log_dir), "*", f"attempt_{attempt}", str(local_rank), "std*.log")))
    return "".join(open(p).read() for p in paths)


def _wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _pids(pid_dir, attempt, ranks=(0, 1)):
    return [int(open(os.path.join(pid_dir, f"attempt{attempt}_rank{r}")).read()) for r in ranks]


def test_stalled_collective_names_the_group_and_the_rank(tiny_data, tmp_path):
    """Rank 1 stalls in iteration 2; rank 0's gradient all-reduce times out and says where and who.  Rank 1
    ``hang``s: it dies at torchrun's SIGTERM instead of waiting out its own 20 s (the next test checks those)."""
    logs = tmp_path / "logs"
    # 12 s: the timeout also bounds the process-group start-up, which took over 3 s under 12 parallel test workers.
    argv = tiny_argv(tiny_data, tmp_path, "--train-iters", "5", "--distributed-timeout-minutes", "0.2")
    proc = subprocess.run(_torchrun(logs) + [FAULT_SCRIPT, *argv], cwd=tmp_path, capture_output=True, text=True,
                          env=_env(MEGALITE_TEST_FAULTS="0:1:2:hang"), timeout=240)
    assert proc.returncode != 0
    rank0 = _rank_log(logs, 0)
    assert ("[rank 0] error: a collective on the dp group (ranks [0, 1]) did not complete within "
            "--distributed-timeout-minutes; rank 1 did not arrive") in rank0, rank0
    assert "Traceback" not in rank0


def test_sigterm_while_blocked_in_a_collective_exits_within_30s(tiny_data, tmp_path):
    logs, pid_dir = tmp_path / "logs", tmp_path / "pids"
    pid_dir.mkdir()
    argv = tiny_argv(tiny_data, tmp_path, "--train-iters", "5")
    proc = subprocess.Popen(_torchrun(logs) + [FAULT_SCRIPT, *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=_env(MEGALITE_TEST_FAULTS="0:1:2:stall", MEGALITE_TEST_PID_DIR=str(pid_dir)))
    try:
        metrics = tmp_path / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 180, "iteration 1")
        time.sleep(2)
        workers = _pids(pid_dir, 0)
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        _wait_for(lambda: not any(running(pid) for pid in workers), 30, "the workers to exit after SIGTERM")
    finally:
        proc.kill()
        proc.communicate()
    rank0 = _rank_log(logs, 0)
    # Where it is blocked (group, file:line) is best effort; that it says so and exits is the contract.
    assert "[rank 0] error: SIGTERM received 20 s ago, but this rank is still blocked" in rank0, rank0
    assert "; exiting without saving" in rank0, rank0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launch_saves_and_workers_exit_cleanly(tiny_data, tmp_path, sig):
    """SIGTERM to the torchrun agent (as srun sends it), or SIGINT to the whole process group (Ctrl-C):
    the workers save at the iteration boundary and exit 0 with one line and no traceback.  torchrun itself
    exits 1 either way (its agent re-raises the signal after stopping the workers), as docs/launching.md says."""
    logs, save = tmp_path / "logs", tmp_path / "ckpt"
    argv = tiny_argv(tiny_data, tmp_path, "--train-iters", "100000", "--save", str(save))
    proc = subprocess.Popen(_torchrun(logs) + [PRETRAIN, *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 180, "two iterations")
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the agent and every worker
    else:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    last = read_metrics(metrics)[-1]["iteration"]
    assert read_latest(str(save)) == last
    for rank in (0, 1):
        log = _rank_log(logs, rank)
        assert "error" not in log and "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert f"{sig.name} received: stopping after iteration {last}" in _rank_log(logs, 0)
    assert "forcefully exiting via" not in out, out
    assert "exitcode  :" not in out, out  # no worker failed
    assert proc.returncode == 1, out


def test_supervisor_restarts_killed_worker_and_launcher_without_orphans(tiny_data, tmp_path):
    """Attempt 0 loses rank 1 (kill -9) in iteration 5; in attempt 1 rank 0 kills the torchrun agent (kill -9)
    in its third iteration, and both workers must be gone within 10 s; attempt 2 finishes.  The losses of
    every iteration equal those of an uninterrupted run."""
    save, pid_dir = tmp_path / "ckpt", tmp_path / "pids"
    pid_dir.mkdir()
    flags = ["--train-iters", "10"]
    reference = _reference_run(tiny_data, tmp_path / "reference", 2, flags)
    argv = tiny_argv(tiny_data, tmp_path, *flags, "--save", str(save), "--load", str(save), "--save-interval", "2")
    command = [sys.executable, os.path.join(ROOT, "tools", "supervise.py"), "--max-restarts", "2",
               "--restart-delay", "1", "--", *_torchrun(tmp_path / "logs"), FAULT_SCRIPT, *argv]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(MEGALITE_TEST_FAULTS="0:1:5:kill;1:0:3:kill-launcher",
                                     MEGALITE_TEST_PID_DIR=str(pid_dir)))
    try:
        _wait_for(lambda: os.path.exists(pid_dir / "attempt2_rank0"), 240, "the third attempt")
        # The launcher of attempt 1 died before attempt 2 started (1 s delay): its workers must be gone.
        orphans = _pids(pid_dir, 1)
        _wait_for(lambda: not any(running(pid) for pid in orphans), 10, "attempt 1's workers to die with torchrun")
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert out.count("supervise: attempt") == 2, out
    survivor = _rank_log(tmp_path / "logs", 0)
    assert "[rank 0] error: lost the connection to another rank, which failed or was killed first" in survivor
    assert "Traceback" not in survivor
    assert read_latest(str(save)) == 10
    resumed = {r["iteration"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert sorted(resumed) == list(range(1, 11))
    for record in reference:
        for key in ("loss", "lr", "grad_norm"):
            assert resumed[record["iteration"]][key] == record[key], (record["iteration"], key)


def _reference_run(tiny_data, workdir, world, flags):
    workdir.mkdir()
    run_distributed(pretrain_on_rank, world, tiny_argv(tiny_data, workdir, *flags), timeout=300)
    return read_metrics(workdir / "metrics.jsonl")


def test_two_agent_multi_node_run_matches_one_agent(tiny_data, tmp_path):
    """Two torchrun agents (--nnodes 2 --nproc_per_node 4, c10d rendezvous on 127.0.0.1) train tp2 x pp2 x dp2
    and log the same losses as the 8 ranks of one launch."""
    flags = ["--train-iters", "3", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    reference = _reference_run(tiny_data, tmp_path / "reference", 8, flags)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = tiny_argv(tiny_data, tmp_path, *flags)
    launch = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "megalite-two-agents")
    agents = [subprocess.Popen(_torchrun(tmp_path / f"node{n}", 4, *launch) + [PRETRAIN, *argv], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
              for n in range(2)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for record, expected in zip(records, reference):
        for key in ("loss", "lr", "grad_norm"):
            assert record[key] == expected[key], (record["iteration"], key)
