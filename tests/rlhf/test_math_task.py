"""The shipped math task: deterministic from its seed, right worked steps, answers that verify."""

import json
import re
from fractions import Fraction

import pytest

from megalite.cli import run_cli
from megalite.rlhf.math_task import main, math_problem, math_problems, read_answers, write_math_task
from megalite.rlhf.verifiers import boxed_answer, check_exact

STEP = re.compile(r"(\d+(?:\.\d+)?) ([-+*/]) (\d+(?:\.\d+)?) = (\d+(?:\.\d+)?)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def test_problems_are_deterministic_per_seed_and_index():
    first = math_problems(40, seed=3)
    assert first == math_problems(40, seed=3)
    assert first[:10] == math_problems(10, seed=3)  # problem i does not depend on the count
    assert math_problem(3, 17) == first[17]
    other = math_problems(40, seed=4)
    assert sum(a["prompt"] != b["prompt"] for a, b in zip(first, other)) >= 35
    assert len({p["prompt"] for p in first}) == 40
    # the set is pinned: a change to the generators shows here (str seeds hash the same on every machine)
    assert math_problem(0, 0) == {
        "prompt": "A farm collects 482 eggs and packs them into boxes of 12. Each full box sells for 6 dollars. How many "
                  "dollars does the farm get for its full boxes? Put the final answer in \\boxed{}.",
        "completion": "482 - 2 = 480 eggs in full boxes. 480 / 12 = 40 boxes. 40 * 6 = 240 dollars. "
                      "The answer is \\boxed{240}.",
        "answer": "240"}


def test_worked_steps_are_right_and_every_answer_verifies():
    pytest.importorskip("math_verify")
    from megalite.rlhf.verifiers import check_math
    records = math_problems(200, seed=0)
    kinds = {record["prompt"].split()[1] for record in records}
    assert len(kinds) == 5  # all five problem kinds are drawn
    assert any("." in record["answer"] for record in records)  # unit conversions give decimal answers
    for record in records:
        steps = STEP.findall(record["completion"])
        assert len(steps) >= 2, record  # multi-step
        for a, op, b, c in steps:
            assert OPS[op](Fraction(a), Fraction(b)) == Fraction(c), record
        assert Fraction(steps[-1][3]) == Fraction(record["answer"]), record
        assert record["prompt"].endswith("Put the final answer in \\boxed{}.")
        assert boxed_answer(record["completion"]) == record["answer"]
        assert check_math(record["completion"], record["answer"]).reward == 1.0, record
        assert check_exact(record["completion"], record["answer"]).reward == 1.0, record


def test_difficulty_levels_are_deterministic_right_and_ordered():
    pytest.importorskip("math_verify")
    from megalite.rlhf.verifiers import check_math
    assert math_problems(30, seed=2, level=3) == math_problems(30, seed=2)  # the default is the hardest level
    for level, (fewest, most, biggest) in {1: (1, 1, 18), 2: (2, 2, 54), 3: (2, 3, None)}.items():
        records = math_problems(100, seed=5, level=level)
        assert records == math_problems(100, seed=5, level=level) and math_problem(5, 7, level) == records[7]
        assert len({r["prompt"] for r in records}) >= 90
        for record in records:
            steps = STEP.findall(record["completion"])
            assert fewest <= len(steps) <= most and Fraction(record["answer"]) > 0, record
            for a, op, b, c in steps:
                assert OPS[op](Fraction(a), Fraction(b)) == Fraction(c), record
                if biggest is not None:
                    assert max(Fraction(a), Fraction(b), Fraction(c)) <= biggest, record
            assert check_math(record["completion"], record["answer"]).reward == 1.0, record
    # easier levels are shorter: fewer tokens to generate, and fewer to get wrong
    lengths = [max(len(r["completion"]) for r in math_problems(100, seed=5, level=level)) for level in (1, 2, 3)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[2] / 2
    with pytest.raises(ValueError, match=r"level must be one of \[1, 2, 3\], got 0"):
        math_problem(0, 0, level=0)


def test_jsonl_round_trip_and_a_users_own_file(tmp_path):
    path = tmp_path / "math.jsonl"
    write_math_task(str(path), 12, seed=1)
    assert read_answers(str(path)) == math_problems(12, seed=1)
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"prompt": "2+2?", "answer": "4", "source": "mine"}) + "\n\n")
    assert read_answers(str(own)) == [{"prompt": "2+2?", "answer": "4", "source": "mine"}]


def test_bad_task_input_is_one_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "2+2?"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: the record needs a non-empty string 'answer'"):
        read_answers(str(bad))
    bad.write_text("[1]\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: a record must be a JSON object"):
        read_answers(str(bad))
    bad.write_text("\n")
    with pytest.raises(ValueError, match="holds no problems"):
        read_answers(str(bad))
    with pytest.raises(ValueError, match="positive integer"):
        math_problems(0)
    code = run_cli(main, [str(tmp_path / "x.jsonl"), "--count", "0"])  # as `python -m megalite.rlhf.math_task`
    assert code == 2 and "--count must be positive" in capsys.readouterr().err
    assert run_cli(main, [str(tmp_path / "x.jsonl"), "--level", "4"]) == 2 and "--level" in capsys.readouterr().err
    assert run_cli(main, [str(tmp_path / "y.jsonl"), "--count", "3", "--level", "1"]) == 0
    assert read_answers(str(tmp_path / "y.jsonl")) == math_problems(3, level=1)
