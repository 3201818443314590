"""Verifiable rewards: math answers as math-verify decides, exact match, \\boxed{} extraction, code under limits."""

import sys
import threading

import pytest

from megalite.rlhf.verifiers import Verdict, answer_reward, boxed_answer, check_code, check_exact, check_math


def test_boxed_answer_takes_the_last_balanced_box():
    assert boxed_answer("first \\boxed{1}, finally \\boxed{\\frac{3}{4}} done") == "\\frac{3}{4}"
    assert boxed_answer("no box here") is None
    assert boxed_answer("\\boxed{unclosed {") is None


def test_exact_match_uses_the_boxed_answer_or_the_whole_response():
    assert check_exact("so the answer is \\boxed{ 42 }", "42") == Verdict(1.0, "exact match")
    assert check_exact("  42\n", "42").reward == 1.0
    wrong = check_exact("\\boxed{0.5}", "1/2")
    assert wrong.reward == 0.0 and "'0.5' is not '1/2'" in wrong.reason


def test_math_answers_are_equivalent_as_math_verify_decides():
    math_verify = pytest.importorskip("math_verify")
    for answer in ("1/2", "0.5", "\\frac{1}{2}"):
        for response in ("The answer is \\boxed{0.5}.", "\\boxed{\\frac{1}{2}}", "so it is 1/2", "\\boxed{\\dfrac12}"):
            expected = math_verify.verify(math_verify.parse(f"\\boxed{{{answer}}}"), math_verify.parse(response))
            assert expected, (answer, response)  # the peer's own verdict: these are one answer
            assert check_math(response, answer).reward == 1.0, (answer, response)
    wrong = check_math("\\boxed{0.6}", "1/2")
    assert wrong.reward == 0.0 and "is not 1/2" in wrong.reason
    assert check_math("I do not know", "7") == Verdict(0.0, "no answer found in the response")


def test_math_without_math_verify_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match="pip install math-verify"):
        check_math("\\boxed{1}", "1")


def test_bad_verifier_input_is_one_clear_error():
    pytest.importorskip("math_verify")
    with pytest.raises(ValueError, match="reference answer is empty"):
        check_exact("1", " ")
    with pytest.raises(ValueError, match="must be a string, got int"):
        check_math(3, "3")
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        check_math("\\boxed{1}", "}{")
    with pytest.raises(ValueError, match="no tests"):
        check_code("x = 1", "  ")
    with pytest.raises(ValueError, match="time limit must be positive"):
        check_code("x = 1", "assert x", time_limit=0)
    with pytest.raises(ValueError, match="at least 64 MiB"):
        check_code("x = 1", "assert x", memory_mb=8)


def test_code_passes_and_fails_on_its_tests():
    program = "def add(a, b):\n    return a + b"
    assert check_code(program, "assert add(2, 3) == 5") == Verdict(1.0, "all tests passed")
    assert check_code(program, "assert add(2, 3) == 6") == Verdict(0.0, "exit 1: AssertionError")


def test_code_timeout_memory_blowup_and_crash_score_zero_with_the_reason():
    assert check_code("import time\ntime.sleep(30)", "pass", time_limit=1) == Verdict(0.0, "timed out after 1 s")
    assert check_code("x = bytearray(4 << 30)", "pass", memory_mb=256) == Verdict(0.0, "exit 1: MemoryError")
    assert check_code("import ctypes\nctypes.string_at(0)", "pass") == Verdict(0.0, "killed by SIGSEGV")
    flood = Verdict(0.0, "exit 1: OSError: [Errno 27] File too large")  # output is capped at OUTPUT_LIMIT
    assert check_code("import sys\nsys.stdout.write('x' * (32 << 20))", "pass") == flood


def test_code_has_no_network():
    verdict = check_code("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", "pass")
    assert verdict == Verdict(0.0, "exit 1: OSError: network access is disabled while verifying code")


def test_math_reward_is_a_reward_fn_for_the_rl_trainer():
    pytest.importorskip("math_verify")
    from megalite.rlhf.scoring import score_batches
    from megalite.rlhf.trainer_config import parse_args, validate
    args = parse_args(["--reward-fn", "megalite.rlhf.verifiers:math_reward", "--tensor-model-parallel-size", "1",
                       "--global-batch-size", "4", "--micro-batch-size", "4"])
    validate(args, 1)
    [scores] = score_batches(args.reward, [(["3+4=", "3+4=", "3+4=", "9+9="], ["7", "7.0", "8", "\\boxed{18}"])])
    assert scores.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_answer_reward_scores_by_the_prompts_answer(tmp_path):
    pytest.importorskip("math_verify")
    from megalite.rlhf.math_task import math_problems, read_answers, write_math_task
    path = tmp_path / "math.jsonl"
    write_math_task(str(path), 5, seed=2)
    reward = answer_reward(read_answers(str(path)))
    for record in math_problems(5, seed=2):
        assert reward(record["prompt"], record["completion"]) == 1.0
        assert reward(record["prompt"], "\\boxed{-1}") == 0.0
    exact = answer_reward([{"prompt": "half?", "answer": "1/2"}], check=check_exact)
    assert exact("half?", "\\boxed{1/2}") == 1.0 and exact("half?", "0.5") == 0.0
    with pytest.raises(ValueError, match="no answer for prompt 'other\\?' among the 1 records"):
        exact("other?", "1")
    with pytest.raises(ValueError, match="has two answers, '1' and '2'"):
        answer_reward([{"prompt": "p", "answer": "1"}, {"prompt": "p", "answer": "2"}])


def test_math_checks_run_off_the_main_thread():
    """A scoring server calls the reward on its serving thread, where math-verify's signal.alarm is refused."""
    pytest.importorskip("math_verify")
    verdicts = []
    thread = threading.Thread(target=lambda: verdicts.append(check_math("\\boxed{0.5}", "1/2")))
    thread.start()
    thread.join(timeout=60)
    assert [v.reward for v in verdicts] == [1.0]


def test_code_that_exits_before_its_tests_scores_zero():
    """Exit status 0 is not a pass: a program that stops before the tests (a reward hack) fails."""
    tests = "assert False"
    assert check_code("import sys\nsys.exit(0)", tests) == \
        Verdict(0.0, "exit 1: SystemExit(0) before the tests finished")
    assert check_code("import os\nos._exit(0)", tests) == Verdict(0.0, "exit 0 before the tests finished")
    assert check_code("print('all tests passed')", "print('ok')") == Verdict(1.0, "all tests passed")
