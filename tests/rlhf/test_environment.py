"""Multi-turn environments: the trained tokens are the sampled ones, observations carry no loss, the shipped
verifier and calculator tasks, the limits, and the bad-input cases (wrong types, a tool call that raises); the RL
trainer's --environment."""

import json
import logging
import random

import pytest
import torch

from megalite.data.tokenizer import ByteTokenizer
from megalite.models import GPTModel
from megalite.rlhf.actor import sequence_log_probs
from megalite.rlhf.env_tasks import (CalculatorEnvironment, VerifierEnvironment, calculate, longest_demonstration,
                                     warmup_batch)
from megalite.rlhf.environment import Environment, EpisodeLimits, StepResult, run_episodes
from megalite.rlhf.generation import RolloutEngine, SamplingConfig
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.testing import run_distributed
from tests.rlhf.common import config, scripted_output

TOK = ByteTokenizer()
SAMPLING = SamplingConfig(max_new_tokens=4, eos_id=TOK.eod, pad_id=TOK.pad, temperature=1.0)


class Echo(Environment):
    """Prompts of ``seed + 2`` bytes; every step answers with the observation "#<n>", for ever."""

    def __init__(self):
        super().__init__(TOK)
        self.actions = []

    def reset(self, seed):
        return TOK.tokenize("q" * (seed + 2))

    def step(self, action):
        self.actions.append(action)
        return StepResult(TOK.tokenize(f"#{len(self.actions)}"), reward=0.5)


def test_trained_tokens_are_the_sampled_ones_and_observations_carry_no_loss():
    """Three turns on the real engine: every action span holds exactly the ids the engine sampled (and the
    environment received), with their behaviour log-probs and loss mask 1; every other column has loss mask 0;
    the actor's log-probs of the finished rows equal the behaviour log-probs (what was trained is what was seen)."""
    model = GPTModel(config(vocab_size=TOK.vocab_size, max_position_embeddings=32))
    engine, sampled = RolloutEngine(model), []

    def sample(prompts, prompt_mask, sampling, generator):
        out = engine.generate(prompts, prompt_mask, sampling, generator)
        p = prompts.shape[1]
        sampled.append([(out.tokens[i, p:][out.response_mask[i] > 0].tolist(),
                         out.log_probs[i][out.response_mask[i] > 0].tolist()) for i in range(len(prompts))])
        return out

    envs = [Echo() for _ in range(3)]
    rollout = run_episodes(envs, [0, 3, 1], sample, SAMPLING, EpisodeLimits(max_turns=3, max_total_tokens=32),
                           torch.Generator().manual_seed(5))
    assert rollout.metadata["turns"] == [3, 3, 3] and len(sampled) == 3
    assert rollout.rewards.tolist() == [1.5, 1.5, 1.5] and rollout.metadata["errors"] == [None] * 3
    expected_mask = torch.zeros_like(rollout.response_mask)
    for row, env in enumerate(envs):
        spans = rollout.turn_spans[row]
        assert len(spans) == 3
        for turn, (start, end) in enumerate(spans):
            ids, log_probs = sampled[turn][row]
            assert rollout.input_ids[row, start:end].tolist() == ids == env.actions[turn]
            assert rollout.behaviour_log_probs[row, start - 1:end - 1].tolist() == log_probs
            expected_mask[row, start - 1:end - 1] = 1
            if turn < 2:  # the observation between two actions is in the row, untrained
                observation = TOK.tokenize(f"#{turn + 1}")
                assert rollout.input_ids[row, end:end + len(observation)].tolist() == observation
                assert spans[turn + 1][0] == end + len(observation)
    assert torch.equal(rollout.response_mask, expected_mask)
    assert bool((rollout.behaviour_log_probs[expected_mask == 0] == 0).all())
    with torch.no_grad():
        actor, _ = sequence_log_probs(model, rollout.input_ids, rollout.attention_mask, SAMPLING.temperature)
    torch.testing.assert_close(actor * expected_mask, rollout.behaviour_log_probs, rtol=0, atol=1e-5)


def test_episodes_near_the_token_limit_sample_only_what_fits():
    """Episodes of different lengths reach max_total_tokens (the model's whole context) in the same turn with
    different budgets: each samples only what fits (one batch asking the longest budget of all overran the
    context), every row ends at the limit, and the trained tokens keep their behaviour log-probs."""
    model = GPTModel(config(vocab_size=TOK.vocab_size, max_position_embeddings=16))
    rollout = run_episodes([Echo() for _ in range(3)], [0, 3, 1], RolloutEngine(model).generate, SAMPLING,
                           EpisodeLimits(max_turns=9, max_total_tokens=16), torch.Generator().manual_seed(2))
    assert rollout.attention_mask.sum(dim=1).tolist() == [16, 15, 16]  # the 2nd row's "#2" would not fit
    assert rollout.metadata["turns"] == [3, 2, 3] and rollout.metadata["errors"] == [None] * 3
    with torch.no_grad():
        actor, _ = sequence_log_probs(model, rollout.input_ids, rollout.attention_mask, SAMPLING.temperature)
    torch.testing.assert_close(actor * rollout.response_mask, rollout.behaviour_log_probs, rtol=0, atol=1e-5)


def scripted(script: dict[str, list[str]], log_prob: float = -0.5):
    """A sampler that writes ``script[prompt][turn]`` (turn = observations so far) for the row of each prompt."""
    def sample(prompts, prompt_mask, sampling, generator):
        actions = []
        for row in prompts.tolist():
            text = TOK.detokenize(row)
            prompt = next(key for key in script if text.startswith(key))
            actions.append((TOK.tokenize(script[prompt][text.count("</result>")]) + [TOK.eod])
                           [:sampling.max_new_tokens])
        return scripted_output(prompts, prompt_mask, actions, sampling.pad_id, log_prob)
    return sample


def _calculator(seeds, max_operand=99):
    envs = [CalculatorEnvironment(TOK, max_operand) for _ in seeds]
    prompts = [TOK.detokenize(env.reset(seed)) for env, seed in zip(envs, seeds)]
    return envs, prompts


def test_calculator_tool_round_trip_and_a_failing_tool_call_ends_only_its_episode(caplog):
    envs, prompts = _calculator([1, 2, 3, 4])
    a, b = prompts[0][:-1].split("*")
    script = {prompts[0]: [f"<calc>{a}*{b}</calc>", str(int(a) * int(b))],
              prompts[1]: ["<calc>7//0</calc>", "0"],
              prompts[2]: ["<calc>__import__('os')</calc>", "0"],
              prompts[3]: ["-1"]}
    sampling = SamplingConfig(max_new_tokens=40, eos_id=TOK.eod, pad_id=TOK.pad)
    with caplog.at_level(logging.WARNING, logger="megalite.rlhf.environment"):
        rollout = run_episodes(envs, [1, 2, 3, 4], scripted(script), sampling,
                               EpisodeLimits(max_turns=4, max_total_tokens=80, error_reward=-2.0))
    assert rollout.rewards.tolist() == [1.0, -2.0, -2.0, 0.0]
    assert rollout.metadata["turn_rewards"] == [[0.0, 1.0], [-2.0], [-2.0], [0.0]]
    errors = rollout.metadata["errors"]
    assert errors[0] is None and errors[3] is None
    assert errors[1].startswith("ZeroDivisionError") and errors[2].startswith("ValueError")
    assert "ZeroDivisionError" in caplog.text and "ValueError" in caplog.text
    answer = str(int(a) * int(b))
    assert rollout.responses[0] == f"<calc>{a}*{b}</calc><result>{answer}</result>{answer}"
    (s0, e0), (s1, e1) = rollout.turn_spans[0]
    observation = rollout.input_ids[0, e0:s1]
    assert TOK.detokenize(observation) == f"<result>{answer}</result>"
    assert bool((rollout.response_mask[0, e0 - 1:s1 - 1] == 0).all())
    assert int(rollout.response_mask[0].sum()) == (e0 - s0) + (e1 - s1)


def test_verifier_task_scores_its_single_answer():
    envs = [VerifierEnvironment(TOK) for _ in range(3)]
    prompts = [TOK.detokenize(env.reset(seed)) for env, seed in zip(envs, [0, 1, 0])]
    assert prompts[0] == prompts[2]  # equal seeds: one GRPO group asks one question
    a, b = prompts[1][:-1].split("+")
    script = {prompts[0]: ["x"], prompts[1]: [str(int(a) + int(b))]}
    rollout = run_episodes(envs, [0, 1, 0], scripted(script), SAMPLING,
                           EpisodeLimits(max_turns=3, max_total_tokens=16))
    assert rollout.rewards.tolist() == [0.0, 1.0, 0.0] and rollout.metadata["turns"] == [1, 1, 1]


def test_max_turns_and_max_total_tokens_end_episodes():
    envs, prompts = _calculator([5, 6], max_operand=9)
    script = {prompts[0]: ["<calc>1+1</calc>"] * 9, prompts[1]: ["<calc>1+1</calc>"] * 9}
    sampling = SamplingConfig(max_new_tokens=40, eos_id=TOK.eod, pad_id=TOK.pad)
    rollout = run_episodes(envs[:1], [5], scripted(script), sampling, EpisodeLimits(max_turns=2,
                                                                                  max_total_tokens=200))
    assert rollout.metadata["turns"] == [2] and rollout.rewards.tolist() == [0.0]
    assert rollout.responses[0] == "<calc>1+1</calc><result>2</result><calc>1+1</calc>"  # no last observation
    # 4 prompt + 17 action + 18 observation tokens leave 6 of 45 for the second action, which is cut there
    rollout = run_episodes(envs, [5, 6], scripted(script), sampling, EpisodeLimits(max_turns=9, max_total_tokens=45))
    assert rollout.attention_mask.sum(dim=1).tolist() == [45, 45] and rollout.metadata["turns"] == [2, 2]
    assert [end - start for _, (start, end) in rollout.turn_spans] == [6, 6]
    assert rollout.response_mask.sum(dim=1).tolist() == [17 + 6, 17 + 6]
    # ... and with 30 the observation no longer fits: the episode ends after its first action
    rollout = run_episodes(envs, [5, 6], scripted(script), sampling, EpisodeLimits(max_turns=9, max_total_tokens=30))
    assert rollout.attention_mask.sum(dim=1).tolist() == [21, 21] and rollout.metadata["turns"] == [1, 1]


class BadReset(Environment):
    def reset(self, seed):
        return "1+1="


class BadStep(Environment):
    def __init__(self, result):
        super().__init__(TOK)
        self.result = result

    def reset(self, seed):
        return [49, 43]

    def step(self, action):
        return self.result


@pytest.mark.parametrize("env, message", [
    (BadReset(TOK), "BadReset.reset must return token ids"),
    (BadStep(([1], 1.0, True)), "BadStep.step must return a StepResult"),
    (BadStep(StepResult(["a"], 1.0)), "BadStep.step's observation must return token ids"),
    (BadStep(StepResult([1], "1.0")), "BadStep.step returned a reward of type str"),
])
def test_an_environment_returning_a_wrong_type_is_a_clear_error(env, message):
    with pytest.raises(TypeError, match=message):
        run_episodes([env], [0], scripted({"1+": ["2"]}), SAMPLING, EpisodeLimits(max_turns=2, max_total_tokens=16))


def test_calculator_tool_accepts_integer_arithmetic_only():
    assert calculate("12*(3+4) - 7//2 % 5") == 81 and calculate("-3*-3") == 9
    for bad in ("2**8", "1.5*2", "x+1", "9" * 13 + "+0", "1+"):
        with pytest.raises(ValueError):
            calculate(bad)
    with pytest.raises(ZeroDivisionError):
        calculate("1%0")


def test_warmup_batch_trains_the_actions_of_a_demonstration_only():
    batch = warmup_batch(lambda: CalculatorEnvironment(TOK, 9), random.Random(0), 3, 48)
    for ids, attention, loss in zip(batch["input_ids"].tolist(), batch["attention_mask"], batch["loss_mask"]):
        n = int(attention.sum())
        text = TOK.detokenize(ids[:n])
        question, answer = text.split("=")[0], str(eval(text.split("=")[0]))
        assert text == f"{question}=<calc>{question}</calc><result>{answer}</result>{answer}"
        trained = "".join(chr(t) if t < 256 else "$" for t, m in zip(ids[1:], loss.tolist()) if m)
        assert trained == f"<calc>{question}</calc>${answer}$"  # both actions with their end-of-document, no more
        assert ids[n:] == [TOK.pad] * (len(ids) - n)
    with pytest.raises(ValueError, match="a CalculatorEnvironment demonstration of .* tokens does not fit in 20"):
        warmup_batch(lambda: CalculatorEnvironment(TOK, 9), random.Random(0), 3, 20)
    direct = warmup_batch(lambda: CalculatorEnvironment(TOK, 9, direct_fraction=1.0), random.Random(0), 3, 48)
    for ids, attention in zip(direct["input_ids"].tolist(), direct["attention_mask"]):
        question, answer = TOK.detokenize(ids).split("=")
        assert answer == str(eval(question)) and ids[int(attention.sum()) - 1] == TOK.eod  # no tool call
    # "9*9=" "<calc>9*9</calc>" eod "<result>81</result>" "81" eod, the longest the trainer checks for
    args = parse_args(RUN + ["--max-operand", "9", "--warmup-direct-fraction", "0.5"])
    assert longest_demonstration(args) == 4 + 16 + 1 + 19 + 2 + 1
    assert longest_demonstration(parse_args(RUN + ["--environment", "verifier"])) == len("9+9=18") + 1


RUN = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "2",
       "--train-iters", "2", "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--advantage-estimator",
       "grpo", "--micro-batch-size", "4", "--pretrain-global-batch-size", "4", "--ppo-epochs", "1",
       "--max-new-tokens", "8", "--max-total-tokens", "48", "--environment", "calculator"]


def _train(argv):
    return RLTrainer(parse_args(argv)).train()


@pytest.mark.slow
def test_rl_trainer_plays_the_environment(tmp_path):
    """--environment: the trainer warms up on demonstrations, plays episodes and trains on the environment's reward
    (an untrained policy's tool calls mostly fail: their episodes end with --error-reward, the run goes on)."""
    metrics = tmp_path / "metrics.jsonl"
    assert run_distributed(_train, 1, RUN + ["--metrics-file", str(metrics), "--error-reward", "-0.5"],
                           timeout=120) == [0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(-0.5 <= r["reward"] <= 1.0 and 0 < r["response_length"] and r["entropy"] > 0 for r in records)
    assert all(1 <= r["turns"] <= 3 and 0 <= r["episode_errors"] <= 1 for r in records)


@pytest.mark.parametrize("extra, message", [
    (["--eval-interval", "1"], "--environment calculator is rewarded by the environment on the training ranks"),
    (["--dynamic-sampling"], "runs without --rollout-world-size, --use-scoring-server, --dynamic-sampling"),
    (["--max-new-tokens", "48"], "--max-new-tokens 48 must be below --max-total-tokens 48"),
    (["--environment", "chess"], "argument --environment: invalid choice: 'chess'"),
    (["--max-operand", "20"], "--environment calculator warm-up demonstrations up to --max-operand 20 take 49 "
                              "tokens, more than --max-total-tokens 48"),
    (["--warmup-direct-fraction", "1.5"], r"direct_fraction must be in \[0, 1\], got 1.5"),
    (["--environment", "verifier", "--warmup-direct-fraction", "0.5"],
     "--warmup-direct-fraction shapes the warm-up of --environment calculator"),
])
def test_rl_trainer_environment_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        validate(parse_args(RUN + extra), 1)


@pytest.mark.slow
def test_calculator_reward_rises_as_the_policy_learns_to_call_the_tool(tmp_path):
    """Warmed up on demonstrations half of which answer a*b (operands up to 20) without the tool, the policy
    mostly guesses wrong without it; GRPO on the environment's reward learns to call the calculator: the episodes
    grow longer (tool calls and their results) and the reward of the last iterations beats the first ones'."""
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--tensor-model-parallel-size", "1", "--hidden-size", "64", "--num-layers", "2", "--pretrain-iters",
            "150", "--train-iters", "14", "--global-batch-size", "8", "--n-samples-per-prompt", "8",
            "--advantage-estimator", "grpo", "--micro-batch-size", "64", "--max-new-tokens", "20",
            "--max-total-tokens", "56", "--ppo-epochs", "1", "--actor-lr", "5e-4", "--error-reward", "0",
            "--max-operand", "20", "--environment", "calculator", "--warmup-direct-fraction", "0.5",
            "--metrics-file", str(metrics)]
    assert run_distributed(_train, 1, argv, timeout=300) == [0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first, last = records[:4], records[-4:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "reward") > mean(first, "reward") + 0.15, [r["reward"] for r in records]
    assert mean(last, "response_length") > mean(first, "response_length") + 3, [r["response_length"] for r in records]
