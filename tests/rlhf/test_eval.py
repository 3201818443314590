"""The RL trainer's evaluation: pass@k with --eval-samples (the unbiased estimator, checked against counting every
k-subset), on a scripted sampler whose passing samples per prompt are known."""

import itertools
import random

import pytest

from megalite import topology
from megalite.rlhf.arithmetic import TOKENIZER
from megalite.rlhf.generation import SamplingConfig
from megalite.rlhf.rollouts import draw_prompts
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.rlhf.trainer_log import eval_line, evaluate, pass_at_k
from megalite.testing import run_distributed
from tests.rlhf.common import scripted_output


def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_pass():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    with pytest.raises(ValueError, match="pass@k needs 0 <= c <= n and 1 <= k <= n, got n=4, c=1, k=5"):
        pass_at_k(4, 1, 5)


SAMPLES = 4
ARGV = ["--tensor-model-parallel-size", "1", "--global-batch-size", "6", "--micro-batch-size", "6",
        "--eval-interval", "1", "--eval-samples", str(SAMPLES)]


def _passing(prompt: str) -> int:
    """How many of the SAMPLES sampled answers to ``prompt`` the scripted sampler gets right."""
    a, b = prompt[:-1].split("+")
    return (int(a) + int(b)) % (SAMPLES + 1)


def _evaluate():
    args = parse_args(ARGV)
    validate(args, 1)
    topo = topology.initialize(tp=1, pp=1)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod, pad_id=TOKENIZER.pad)

    def sample(prompts, prompt_mask, config, generator):
        actions, seen = [], {}
        for row in prompts.tolist():
            prompt = TOKENIZER.detokenize(row)
            right = str(eval(prompt[:-1]))
            turn = seen[prompt] = seen.get(prompt, -1) + 1  # the row's place in its prompt's group
            answer = right if config.greedy or turn < _passing(prompt) else right + "0"
            actions.append((TOKENIZER.tokenize(answer) + [TOKENIZER.eod])[:config.max_new_tokens])
        return scripted_output(prompts, prompt_mask, actions, config.pad_id, -1.0)

    metrics = evaluate(sample, args, sampling, args.reward, topo, "cpu", 0)
    return metrics, [TOKENIZER.detokenize(row) for row in _prompts(args, topo)]


def _prompts(args, topo):
    """The evaluation prompts of this rank (the ones evaluate draws)."""
    return [TOKENIZER.tokenize(p) for p in draw_prompts(args, random.Random(args.seed * 1000 + 500009 + topo.dp.rank))]


def test_evaluation_logs_pass_at_1_and_pass_at_n_over_the_sampled_responses():
    [(metrics, prompts)] = run_distributed(_evaluate, 1, timeout=120)
    passing = [_passing(p) for p in prompts]
    assert len(prompts) == 6 and len(set(passing)) > 1
    assert metrics["valid_reward"] == 1.0  # greedy answers are right
    assert metrics["valid_pass@1"] == pytest.approx(sum(c / SAMPLES for c in passing) / 6, abs=1e-12)
    assert metrics[f"valid_pass@{SAMPLES}"] == pytest.approx(sum(c > 0 for c in passing) / 6, abs=1e-12)
    line = eval_line(2, {**metrics, "valid_pass@1": 0.5, f"valid_pass@{SAMPLES}": 0.75})
    assert line.endswith(f"(greedy) | pass@1 0.500 | pass@{SAMPLES} 0.750")


@pytest.mark.parametrize("extra, message", [
    (["--eval-interval", "1", "--eval-samples", "0"], "--eval-samples 0 needs --eval-interval and at least 1"),
    (["--eval-samples", "4"], "--eval-samples 4 needs --eval-interval"),
])
def test_eval_samples_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        validate(parse_args(ARGV[:6] + extra), 1)

