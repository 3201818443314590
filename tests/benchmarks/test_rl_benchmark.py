"""benchmarks/rl.py reads each run's own metrics: --part trl runs the example several times in one directory (the
sides in turns, several rounds), and the metrics logger appends to an existing file."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_each_example_run_reads_only_its_own_iterations(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("rl_benchmark", os.path.join(ROOT, "benchmarks", "rl.py"))
    rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl)
    runs = []

    def example(cmd, **_):  # what examples/rlhf_ppo.py does with --metrics-file: appends one line per iteration
        runs.append(len(runs))
        with open(cmd[cmd.index("--metrics-file") + 1], "a") as f:
            for iteration in range(1, 4):
                f.write(json.dumps({"iteration": iteration, "run": runs[-1]}) + "\n")

    monkeypatch.setattr(rl.subprocess, "run", example)
    args = type("Args", (), {"n_samples_per_prompt": 2, "global_batch_size": 2, "iters": 3})()
    for run in range(3):  # the same directory and port, as --part trl's sides and rounds
        records = rl.run_example([], args, str(tmp_path), procs=1)
        assert [(r["iteration"], r["run"]) for r in records] == [(i, run) for i in range(1, 4)]
