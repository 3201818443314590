"""examples/math_grpo.py, the SFT -> GRPO recipe on the shipped math task, runs end to end (tiny and short) and
reports the held-out verifier accuracy after SFT and after GRPO, read from its metrics file."""

import pytest

from megalite.testing import run_distributed


def _run(argv):
    from examples.math_grpo import main
    return main(argv)


@pytest.mark.slow
def test_recipe_reports_held_out_accuracy_after_sft_and_after_grpo(tmp_path):
    pytest.importorskip("math_verify")
    from examples.math_grpo import accuracies, summary
    argv = ["--count", "14", "--workdir", str(tmp_path), "--hidden-size", "32", "--num-layers", "1",
            "--pretrain-iters", "2", "--pretrain-global-batch-size", "4", "--micro-batch-size", "4",
            "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--held-out-prompts", "4",
            "--train-iters", "2", "--eval-interval", "2", "--ppo-epochs", "1"]
    assert run_distributed(_run, 1, argv, timeout=180, backend="gloo") == [0]
    assert len((tmp_path / "math.jsonl").read_text().splitlines()) == 14
    evaluations = accuracies(str(tmp_path / "metrics.jsonl"))
    assert [i for i, _ in evaluations] == [0, 2]  # after the SFT warm-up, then after two GRPO iterations
    assert all(a in (0.0, 0.25, 0.5, 0.75, 1.0) for _, a in evaluations)  # 4 held-out problems, each right or wrong
    assert summary(4, [(0, 0.25), (10, 0.0), (20, 0.5)]) == \
        "held-out verifier accuracy (4 problems, greedy): after SFT 0.250, after GRPO (iteration 20) 0.500"


def test_recipe_bad_input_exits_2(tmp_path):
    from examples.math_grpo import main
    from megalite.cli import run_cli
    assert run_cli(main, ["--count", "0", "--workdir", str(tmp_path)]) == 2
    assert run_cli(main, ["--count", "4", "--held-out-prompts", "4", "--workdir", str(tmp_path)]) == 2
    assert run_cli(main, ["--count", "40", "--eval-interval", "0", "--workdir", str(tmp_path)]) == 2
    assert run_cli(main, ["--count", "40", "--level", "0", "--workdir", str(tmp_path)]) == 2
