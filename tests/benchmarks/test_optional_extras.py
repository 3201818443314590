"""Benchmarks run without the optional extras: pipeline.py skips its Gantt charts with a one-line note when
matplotlib is missing; a benchmark whose comparison needs an extra (transformers, Ray, llguidance) stops at
once with one error line and exit status 2 instead of a traceback halfway through."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def _run_without(module, script, *args, cwd):
    """Run benchmarks/``script`` as ``python benchmarks/script`` would, with ``module`` made unimportable."""
    code = ("import runpy, sys\n"
            f"sys.modules[{module!r}] = None\n"
            f"sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r})\n"
            f"sys.argv = [{script!r}, *{list(args)!r}]\n"
            f"runpy.run_path({os.path.join(ROOT, 'benchmarks', script)!r}, run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_pipeline_benchmark_without_matplotlib_notes_and_finishes(tmp_path):
    done = _run_without("matplotlib", "pipeline.py", "--steps", "1", "--hidden", "16", "--seq-length", "4", "--batch", "1",
                        "--png-dir", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "note: no Gantt charts without matplotlib (pip install 'megalite[plot]')"
    assert any(line.startswith("bubble zbv measured") for line in lines)
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("module,script,message", [
    ("transformers", "inference.py", "error: this benchmark (transformers builds its model and is its baseline) "
                                     "needs transformers (pip install 'megalite[hf]')"),
    ("ray", "training_service.py", "error: the Ray-vs-local comparison needs ray (pip install 'megalite[ray]')"),
    ("llguidance", "grammar_mask.py", "error: the grammar-library comparison needs llguidance "
                                      "(pip install 'megalite[grammar]')"),
])
def test_benchmark_that_needs_an_extra_stops_with_one_line(tmp_path, module, script, message):
    done = _run_without(module, script, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr.strip()) == (2, "", message)


def test_moe_models_benchmark_without_torchtitan_notes_and_finishes(tmp_path):
    """No torchtitan: one note instead of the step comparison (the ep=4 part, skipped here, needs only megalite)."""
    done = _run_without("torchtitan", "moe_models.py", "--skip-ep", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[1:] == [
        "note: torchtitan is not importable, so the step comparison is skipped (see this file's docstring)"]
