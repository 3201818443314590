"""The two-turn guidance flow: attempt -> the guide's hint -> revision -> reward on the revision; the guide's own
rollout (its sampled tokens, behaviour log-probs, improvement rewards), its warm-up, the trainer's bad input, and a
run that trains both models."""

import json
import random

import pytest
import torch

from megalite.data.tokenizer import ByteTokenizer
from megalite.models import GPTModel
from megalite.rlhf.actor import sequence_log_probs
from megalite.rlhf.advantages import compute_advantages
from megalite.rlhf.env_tasks import GuidanceEnvironment, longest_demonstration, warmup_batch
from megalite.rlhf.environment import EpisodeLimits, run_episodes
from megalite.rlhf.generation import RolloutEngine, SamplingConfig
from megalite.rlhf.guidance import guide_rollout, hint_writer
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.testing import run_distributed
from tests.rlhf.common import config, scripted_output

TOK = ByteTokenizer()
SAMPLING = SamplingConfig(max_new_tokens=6, eos_id=TOK.eod, pad_id=TOK.pad, temperature=1.0)


def policy_script(attempts: dict[str, str], log_prob: float = -0.25):
    """A policy sampler: ``attempts[question]`` first, then a revision copying the hint it was shown."""
    def sample(prompts, prompt_mask, sampling, generator):
        actions = []
        for row in prompts.tolist():
            text = TOK.detokenize(row)
            question = text[:text.index("=") + 1]
            answer = text.split("<hint>")[1].split("</hint>")[0] if "<hint>" in text else attempts[question]
            actions.append(TOK.tokenize(answer) + [TOK.eod])
        return scripted_output(prompts, prompt_mask, actions, sampling.pad_id, log_prob)
    return sample


def test_guidance_episode_rewards_the_revision_and_gives_the_guide_its_own_rollout():
    """Right attempt + right hint, wrong attempt + right hint, right attempt + wrong hint: the policy is rewarded on
    its revision (which copies the hint), the hint reaches it as an untrained observation holding the guide's ids,
    and the guide's rollout holds exactly its prompts and sampled hints with their log-probs, rewarded with the
    revision's improvement over the attempt (0, +1, -1)."""
    seeds = [3, 4, 5]
    envs = [GuidanceEnvironment(TOK, max_operand=9) for _ in seeds]
    questions = [TOK.detokenize(env.reset(seed)) for env, seed in zip(envs, seeds)]
    answers = [str(eval(q[:-1])) for q in questions]
    wrong = [str(int(a) + 1) for a in answers]
    assert len(set(questions)) == 3
    attempts = dict(zip(questions, [answers[0], wrong[1], answers[2]]))
    hints = {questions[0]: answers[0], questions[1]: answers[1], questions[2]: wrong[2]}
    seen = []

    def guide(prompt):
        seen.append(prompt)
        question = TOK.detokenize(prompt).split("=")[0] + "="
        ids = TOK.tokenize(hints[question]) + [TOK.eod]
        return ids, [-0.5 - 0.1 * i for i in range(len(ids))]

    for env in envs:
        env.guide = guide
    rollout = run_episodes(envs, seeds, policy_script(attempts), SAMPLING, EpisodeLimits(max_turns=4,
                                                                                       max_total_tokens=40))
    assert rollout.rewards.tolist() == [1.0, 1.0, 0.0] and rollout.metadata["turns"] == [2, 2, 2]
    assert [env.attempt_reward for env in envs] == [1.0, 0.0, 1.0]
    for row, env in enumerate(envs):
        attempt = attempts[questions[row]]
        assert rollout.responses[row] == f"{attempt}<hint>{hints[questions[row]]}</hint>{hints[questions[row]]}"
        (_, e0), (s1, _) = rollout.turn_spans[row]
        assert TOK.detokenize(rollout.input_ids[row, e0:s1]) == f"<hint>{hints[questions[row]]}</hint>"
        assert bool((rollout.response_mask[row, e0 - 1:s1 - 1] == 0).all())
        assert seen[row] == TOK.tokenize(f"{questions[row]}{attempt}|{answers[row]}|")
    guided = guide_rollout(envs, TOK.pad)
    assert guided.rewards.tolist() == [0.0, 1.0, -1.0]
    assert guided.metadata["attempt_rewards"] == [1.0, 0.0, 1.0]
    p = guided.prompt_width
    for row, env in enumerate(envs):
        prompt, hint, log_probs = env.guide_turn
        assert hint == TOK.tokenize(hints[questions[row]]) + [TOK.eod]
        n = guided.attention_mask[row].sum()
        assert guided.input_ids[row, p + len(hint) - n:p + len(hint)].tolist() == prompt + hint
        assert guided.response_mask[row].tolist() == [0.0] * (p - 1) + [1.0] * len(hint) + \
            [0.0] * (guided.input_ids.shape[1] - p - len(hint))
        torch.testing.assert_close(guided.behaviour_log_probs[row, p - 1:p - 1 + len(hint)],
                                   torch.tensor(log_probs), rtol=0, atol=0)
    assert guided.responses[0] == answers[0]


def test_an_episode_cut_before_its_revision_gives_the_guide_no_credit():
    """When the hint does not fit in max_total_tokens the episode ends after the attempt: no revision, the guide's
    reward is 0 (the attempt stands), and the policy keeps the attempt's reward of 0."""
    env = GuidanceEnvironment(TOK, max_operand=9, guide=lambda prompt: (TOK.tokenize("12345") + [TOK.eod], [-1.0] * 6))
    question = TOK.detokenize(env.reset(0))
    rollout = run_episodes([env], [0], policy_script({question: str(eval(question[:-1]))}), SAMPLING,
                           EpisodeLimits(max_turns=4, max_total_tokens=len(question) + 8))
    assert rollout.metadata["turns"] == [1] and rollout.rewards.tolist() == [0.0]
    assert env.attempt_reward == 1.0 and env.revision_reward is None
    assert guide_rollout([env], TOK.pad).rewards.tolist() == [0.0]


def test_hint_writer_log_probs_are_the_guide_models():
    """The hints sampled on the real engine carry the guide model's own log-probs of the sampled tokens."""
    model = GPTModel(config(vocab_size=TOK.vocab_size, max_position_embeddings=32))
    write = hint_writer(RolloutEngine(model).generate, SAMPLING, torch.Generator().manual_seed(3))
    env = GuidanceEnvironment(TOK, max_operand=9, guide=write)
    env.reset(1)
    env.step(TOK.tokenize("7") + [TOK.eod])
    prompt, hint, log_probs = env.guide_turn
    assert 1 <= len(hint) <= SAMPLING.max_new_tokens and prompt[-1] == TOK.tokenize("|")[0]
    ids = torch.tensor([prompt + hint])
    with torch.no_grad():
        actor, _ = sequence_log_probs(model, ids, torch.ones_like(ids), SAMPLING.temperature)
    torch.testing.assert_close(actor[0, len(prompt) - 1:], torch.tensor(log_probs), rtol=0, atol=1e-5)


def test_warmup_demonstrations_of_the_policy_and_the_guide():
    """The policy's warm-up trains a right attempt (a wrong one is shown untrained) and the revision copying the
    hint; the guide's trains its hint only: the answer, or a wrong number at wrong_hint_fraction 1."""
    policy = warmup_batch(lambda: GuidanceEnvironment(TOK, 9), random.Random(0), 16, 40)
    wrong_attempts = 0
    for ids, attention, loss in zip(policy["input_ids"].tolist(), policy["attention_mask"], policy["loss_mask"]):
        text = TOK.detokenize(ids[:int(attention.sum())])
        question, rest = text.split("=")
        answer = str(eval(question))
        attempt = rest.split("<hint>")[0]
        assert rest.split("<hint>")[1] == f"{answer}</hint>{answer}"
        trained = "".join(chr(t) if t < 256 else "$" for t, m in zip(ids[1:], loss.tolist()) if m)
        wrong_attempts += attempt != answer
        assert trained == (f"{answer}$" if attempt != answer else f"{answer}${answer}$")
    assert 0 < wrong_attempts < 16
    for fraction in (0.0, 1.0):
        guide = warmup_batch(lambda: GuidanceEnvironment(TOK, 9, wrong_hint_fraction=fraction).guide_task(),
                             random.Random(0), 8, 40)
        for ids, attention, loss in zip(guide["input_ids"].tolist(), guide["attention_mask"], guide["loss_mask"]):
            question, attempt_and_answer = TOK.detokenize(ids[:int(attention.sum())]).split("=")
            _, answer, hint = attempt_and_answer.split("|")
            assert answer == str(eval(question)) and (hint == answer) == (fraction == 0.0)
            trained = "".join(chr(t) if t < 256 else "$" for t, m in zip(ids[1:], loss.tolist()) if m)
            assert trained == f"{hint}$"
    # "9*9=" "81" eod "<hint>81</hint>" "81" eod: the policy's, longer than the guide's "9*9=81|81|" "81" eod
    assert longest_demonstration(parse_args(RUN)) == 4 + 3 + 15 + 3


RUN = ["--tensor-model-parallel-size", "1", "--hidden-size", "64", "--num-layers", "2", "--pretrain-iters", "150",
       "--train-iters", "10", "--global-batch-size", "4", "--n-samples-per-prompt", "8", "--advantage-estimator",
       "grpo", "--micro-batch-size", "32", "--pretrain-global-batch-size", "64", "--ppo-epochs", "1",
       "--max-new-tokens", "5", "--max-total-tokens", "32", "--max-operand", "9", "--guide-lr", "2e-3",
       "--environment", "guidance", "--warmup-wrong-hint-fraction", "0.25"]


@pytest.mark.parametrize("extra, message", [
    (["--advantage-estimator", "gae"], "--environment guidance trains a guide model beside the policy with a "
                                       "critic-free --advantage-estimator"),
    (["--environment", "calculator"], "--warmup-wrong-hint-fraction shapes the warm-up of --environment guidance"),
    (["--warmup-wrong-hint-fraction", "2"], r"wrong_hint_fraction must be in \[0, 1\], got 2.0"),
    (["--max-total-tokens", "20"], "--environment guidance warm-up demonstrations up to --max-operand 9 take 25 "
                                   "tokens, more than --max-total-tokens 20"),
    (["--guide-samples-per-attempt", "0"], "--guide-samples-per-attempt 0 needs a positive number"),
    (["--guide-samples-per-attempt", "3", "--micro-batch-size", "64"],
     r"96 sequences per DP rank \(4 prompts x 8 samples x 3 hints\) are not divisible by --micro-batch-size 64"),
])
def test_guidance_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        validate(parse_args(RUN + extra), 1)
    with pytest.raises(ValueError, match="--guide-samples-per-attempt 2 needs a positive number and, above 1, "
                                         "--environment guidance"):
        validate(parse_args(RUN[:-4] + ["--guide-samples-per-attempt", "2"]), 1)


def test_several_hints_per_attempt_branch_the_episode_and_group_the_guide_by_attempt():
    """--guide-samples-per-attempt 2: each attempt gets two hints (right, then wrong), each followed by its own
    revision as a row of its own after the attempt's first; the guide's reward per hint is its revision's
    improvement, its GRPO advantage is relative to the other hint to the same attempt, and the policy's group is
    every revision to one question (two attempts x two hints): all equal to a computation by hand."""
    args = parse_args(RUN + ["--n-samples-per-prompt", "2", "--global-batch-size", "2", "--micro-batch-size", "4",
                             "--guide-samples-per-attempt", "2"])
    validate(args, 1)
    seeds = [3, 3, 4, 4]  # two questions, two attempts each
    envs = [GuidanceEnvironment(TOK, max_operand=9, hints=2) for _ in seeds]
    questions = [TOK.detokenize(env.reset(seed)) for env, seed in zip(envs, seeds)]
    answers = [str(eval(q[:-1])) for q in questions]
    attempts = {questions[0]: answers[0], questions[2]: str(int(answers[2]) + 1)}  # right, wrong
    calls = []

    def guide(prompt):
        question = TOK.detokenize(prompt).split("=")[0]
        answer = str(eval(question))
        ids = TOK.tokenize(answer if len(calls) % 2 == 0 else str(int(answer) + 2)) + [TOK.eod]
        calls.append(ids)
        return ids, [-0.5 - 0.1 * len(calls)] * len(ids)

    for env in envs:
        env.guide = guide
    rollout = run_episodes(envs, seeds, policy_script(attempts), SAMPLING, EpisodeLimits(max_turns=4,
                                                                                       max_total_tokens=40))
    rows = rollout.metadata["environments"]
    assert len(rollout) == 8 and len(calls) == 8 and rows[0::2] == envs and rollout.metadata["turns"] == [2] * 8
    hints = [TOK.detokenize(ids[:-1]) for ids in calls]
    for row in range(8):
        attempt = attempts[questions[row // 2]]
        assert rollout.responses[row] == f"{attempt}<hint>{hints[row]}</hint>{hints[row]}"
        (s0, e0), (s1, _) = rollout.turn_spans[row]
        assert bool((rollout.response_mask[row, s0 - 1:e0 - 1] == 1).all())  # the shared attempt is trained in both
        assert bool((rollout.response_mask[row, e0 - 1:s1 - 1] == 0).all())
    policy_rewards = [1.0, 0.0] * 4  # each revision copies its hint: right, wrong
    assert rollout.rewards.tolist() == policy_rewards
    guided = guide_rollout(rows, TOK.pad)
    improvements = [0.0, -1.0, 0.0, -1.0, 1.0, 0.0, 1.0, 0.0]  # attempts right (question 1), wrong (question 2)
    assert guided.rewards.tolist() == improvements
    assert [TOK.detokenize(ids[:-1]) for ids in [rows[i].guide_turn[1] for i in range(8)]] == hints
    assert [rows[i].guide_turn[2][0] for i in range(8)] == pytest.approx([-0.5 - 0.1 * k for k in range(1, 9)])

    def by_hand(scores, group):
        out = []
        for start in range(0, len(scores), group):
            g = scores[start:start + group]
            mean = sum(g) / group
            std = (sum((x - mean) ** 2 for x in g) / (group - 1)) ** 0.5
            out += [(x - mean) / (std + args.advantage.eps) for x in g]
        return out

    for config, scored, scores, group in ((args.guide_advantage, guided, improvements, 2),
                                          (args.advantage, rollout, policy_rewards, 4)):
        mask = scored.response_mask
        last = mask * (torch.arange(mask.shape[1]) == (mask * torch.arange(mask.shape[1])).argmax(dim=1,
                                                                                                    keepdim=True))
        advantages, _ = compute_advantages(config, last * torch.tensor(scores)[:, None], mask)
        per_row = [float(a[m > 0][0]) for a, m in zip(advantages, mask)]
        assert per_row == pytest.approx(by_hand(scores, group), rel=1e-6, abs=1e-7)
        assert bool(((advantages - torch.tensor(per_row)[:, None]) * mask == 0).all())


def moved(trainer) -> tuple[float, float]:
    """How far the trainer's policy and guide moved from their warm-up weights (their reference copies)."""
    def distance(model, reference):
        return max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    return (distance(trainer.actor.chunk.module, trainer.reference.module),
            distance(trainer.guide.backend.chunk.module, trainer.guide.reference.module))


def _train(argv):
    """The run, and how far each trained model moved (:func:`moved`)."""
    trainer = RLTrainer(parse_args(argv))
    trainer.train()
    return moved(trainer)


@pytest.mark.slow
def test_guidance_run_trains_both_models_and_the_revision_overtakes_the_attempt(tmp_path):
    """Warmed up with a quarter of the guide's hints wrong (and a policy that copies hints), the revision starts no
    better than the attempt; RL trains the policy and the guide, each with its own optimizer, and the guide,
    rewarded with the revision's improvement, learns to write right hints (both optimizers and references offloaded
by the placement plan between their phases): the revision's reward ends above the
    attempt's and the guide's reward rises."""
    metrics = tmp_path / "metrics.jsonl"
    argv = RUN + ["--metrics-file", str(metrics), "--offload-optimizer", "--offload-frozen-models"]
    [(actor_moved, guide_moved)] = run_distributed(_train, 1, argv, timeout=300)
    assert actor_moved > 0 and guide_moved > 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 11))
    # both optimizers' state (and both references) wait in the host pool while the policy and the guide generate
    assert all(0 < r["mem_generation_device_bytes"] < r["mem_training_device_bytes"] for r in records)
    assert all(r["mem_generation_pool_bytes"] > 0 for r in records)
    assert all(-1 <= r["guide_reward"] <= 1 and "guide_policy_loss" in r for r in records)
    first, last = records[:3], records[-4:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(first, "reward") <= mean(first, "attempt_reward") + 0.05, records[:3]
    assert mean(last, "reward") > mean(last, "attempt_reward") + 0.05, [(r["reward"], r["attempt_reward"])
                                                                        for r in records]
    assert mean(last, "guide_reward") > mean(first, "guide_reward") + 0.05, [r["guide_reward"] for r in records]


def small_guidance_argv(metrics, train_iters: int, max_operand: int, *extra: str) -> list[str]:
    """The trainer's flags of a short guidance run (a one-layer width-32 policy and guide, 2 prompts x 2 samples)
    writing ``metrics``, with ``extra`` flags."""
    return ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "40",
            "--pretrain-lr", "1e-2", "--actor-lr", "1e-2", "--guide-lr", "1e-2", "--train-iters", str(train_iters),
            "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--advantage-estimator",
            "grpo", "--micro-batch-size", "4", "--pretrain-global-batch-size", "8", "--ppo-epochs", "1",
            "--max-new-tokens", "4", "--max-total-tokens", "32", "--max-operand", str(max_operand),
            "--environment", "guidance", *extra, "--tensorboard-dir", "", "--metrics-file", str(metrics)]


@pytest.mark.slow
def test_a_run_with_two_hints_per_attempt_trains_both_models(tmp_path):
    """--guide-samples-per-attempt 2 through the trainer: twice the rows for both models (one per hint), both
    trained, and the throughput counts every revision."""
    metrics = tmp_path / "metrics.jsonl"
    argv = small_guidance_argv(metrics, 2, 4, "--guide-samples-per-attempt", "2")
    [(actor_moved, guide_moved)] = run_distributed(_train, 1, argv, timeout=120)
    assert actor_moved > 0 and guide_moved > 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2] and all("guide_policy_loss" in r for r in records)
    # 2 prompts x 2 attempts x 2 hints: each a revision the policy trains on
    assert all(r["samples_per_s"] == pytest.approx(8 / r["time_iteration_s"], rel=1e-9) for r in records)
