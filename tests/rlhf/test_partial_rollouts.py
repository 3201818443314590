"""Partial rollouts: a generation started under weights v and finished under v+1 keeps, per token, the behaviour
log-prob of the weights that sampled it, and the RL update weighs each token by its own; the RL trainer's
--partial-rollout-tokens."""

import json

import pytest
import torch

from megalite import topology
from megalite.models import GPTModel
from megalite.data.tokenizer import ByteTokenizer
from megalite.rlhf.actor import sequence_log_probs
from megalite.rlhf.env_tasks import CalculatorEnvironment, GuidanceEnvironment
from megalite.rlhf.environment import EpisodeLimits
from megalite.rlhf.generation import RolloutEngine, SamplingConfig
from megalite.rlhf.guidance import GuideClock, PartialHintWriter, guide_rollout
from megalite.rlhf.objectives import PPOActorObjective
from megalite.rlhf.partial_rollouts import PartialEpisodes, PartialRollouts
from megalite.rlhf.backend import TrainingBackend
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.rlhf.trainer_models import build
from megalite.rlhf.update import rl_update
from megalite.testing import run_distributed
from tests.rlhf.common import VOCAB, config, scripted_output
from tests.rlhf.test_guidance import moved, small_guidance_argv

SAMPLING = SamplingConfig(max_new_tokens=6, eos_id=VOCAB - 1, pad_id=0, temperature=1.0)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def _log_probs(model, rollout, state=None):
    """``model``'s log-probs of ``rollout``'s tokens, with the weights ``state`` (default: its own)."""
    current = {k: v.clone() for k, v in model.state_dict().items()}
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        result = sequence_log_probs(model, rollout.input_ids, rollout.attention_mask, SAMPLING.temperature)[0]
    model.load_state_dict(current)
    return result


def _perturb(model, seed):
    """A weight update in place (the engine keeps running on the same parameters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _two_versions(model, sample):
    """Rows started under the weights of version 0 (3 tokens each), finished under version 1: (the rollout of the
    rows that spanned both, the weights of version 0)."""
    partial = PartialRollouts(sample, SAMPLING, chunk_tokens=3, prompt_width=4)
    partial.add(PROMPTS)
    generator = torch.Generator().manual_seed(0)
    first = partial.advance(0, generator)
    assert first is None or len(first) < len(PROMPTS)
    carried = len(partial)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    _perturb(model, 1)
    second = partial.advance(1, generator)
    assert len(partial) == 0 and len(second) == carried >= 2
    return second, v0


def test_a_row_finished_after_a_weight_update_keeps_each_tokens_behaviour_log_prob():
    model = GPTModel(config())
    rollout, v0 = _two_versions(model, RolloutEngine(model).generate)
    p, mask, versions = rollout.prompt_width, rollout.response_mask, rollout.token_versions
    assert rollout.version == 0
    assert torch.equal(versions[:, p - 1:p + 2], torch.zeros(len(rollout), 3, dtype=torch.long))
    assert bool((versions[mask > 0][versions[mask > 0] != 0] == 1).all()) and bool((versions[mask == 0] == -1).all())
    old, new = _log_probs(model, rollout, v0), _log_probs(model, rollout)
    expected = torch.where(versions == 0, old, new) * mask
    torch.testing.assert_close(rollout.behaviour_log_probs, expected, rtol=0, atol=1e-5)
    # the two versions disagree on the carried tokens: one version's log-probs for all would not pass above
    assert float(((old - new).abs() * (versions == 0)).max()) > 1e-3
    assert [row[row != 0].tolist() for row in rollout.prompt_ids] == PROMPTS  # every row carried over, in order


def test_chunk_tokens_bounds():
    model = GPTModel(config())
    with pytest.raises(ValueError, match=r"chunk_tokens must be an integer in \[1, max_new_tokens=6\], got 7"):
        PartialRollouts(RolloutEngine(model).generate, SAMPLING, 7, 4)
    with pytest.raises(ValueError, match="a prompt of 5 tokens does not fit prompt_width 4"):
        PartialRollouts(RolloutEngine(model).generate, SAMPLING, 3, 4).add([[1, 2, 3, 4, 5]])


def _update(argv):
    """rl_update on a rollout started at version 0 and finished at version 1, with the actor at version 1: the
    train/inference gap it logs and its TIS weights come from each token's own behaviour log-prob."""
    args = parse_args(argv)
    validate(args, 1)
    topo = topology.initialize(tp=1, pp=1)
    torch.manual_seed(3)
    model_config = config(max_position_embeddings=16)
    chunk, optimizer = build(GPTModel, model_config, topo, 1e-3, "cpu")
    actor = TrainingBackend(chunk, optimizer, PPOActorObjective(args.ppo), args.micro_batch_size, topo)
    rollout, _ = _two_versions(chunk.module, RolloutEngine(chunk).generate)
    rollout = rollout.rows(0, 2)
    mask = rollout.response_mask
    current = _log_probs(chunk.module, rollout) * mask
    gap = (current - rollout.behaviour_log_probs).abs() * mask
    weights = torch.where(mask > 0, torch.exp(current - rollout.behaviour_log_probs).clamp(max=10.0), 1.0)
    rollout.rewards = torch.tensor([1.0, 0.0])
    rollout.ref_log_probs = current
    rollout.metadata.update(kept_fraction=1.0, generate_s=0.0, log_probs_s=0.0)
    metrics = rl_update(rollout, args, topo, actor, None, "cpu", version=1)
    on_v1 = (rollout.token_versions == 1) & (mask > 0)
    result = (metrics["log_prob_gap"], float(gap.sum() / mask.sum()), metrics["is_weight_mean"],
              float((weights * mask).sum() / mask.sum()), float(gap[on_v1].max()), float(gap.max()))
    return result


def test_the_update_weighs_each_token_by_its_own_behaviour_log_prob():
    argv = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--global-batch-size",
            "1", "--n-samples-per-prompt", "2", "--micro-batch-size", "2", "--advantage-estimator", "grpo",
            "--ppo-epochs", "1", "--max-new-tokens", "6", "--max-staleness", "1", "--rollout-is-cap", "10"]
    [(gap, expected_gap, weight, expected_weight, gap_on_v1, gap_max)] = run_distributed(_update, 1, argv, timeout=120)
    assert gap == pytest.approx(expected_gap, rel=1e-5) and weight == pytest.approx(expected_weight, rel=1e-5)
    assert gap_on_v1 < 1e-5 < gap_max  # the tokens of version 1 are on-policy, those of version 0 are not


def _train(argv):
    return RLTrainer(parse_args(argv)).train()


@pytest.mark.slow
def test_rl_trainer_with_partial_rollouts_trains_on_rows_that_span_updates(tmp_path):
    """--partial-rollout-tokens 1: rows grow one token per round; a batch is the first groups to finish, the rest
    continue under the next weights, so some batches hold tokens of an older version (staleness > 0, bounded by
    --max-staleness), whose per-token behaviour log-probs the update corrects with (log_prob_gap, TIS weights).
    With --use-scoring-server each batch is scored there (no lookahead) and the run is the same."""
    # --seed 13: a run whose six iterations reach a reward > 0 (three of them; seed 4's one rewarded iteration went
    # when packed RL rows started sharing rows between groups, which moves the updates by float rounding)
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "40",
            "--train-iters", "6", "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size",
            "4", "--pretrain-global-batch-size", "4", "--advantage-estimator", "grpo", "--ppo-epochs", "1",
            "--partial-rollout-tokens", "1", "--max-staleness", "2", "--rollout-is-cap", "2", "--seed", "13",
            "--metrics-file", str(metrics)]
    assert run_distributed(_train, 1, argv, timeout=120) == [0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 7))
    assert all(r["staleness"] <= 2 for r in records) and any(r["staleness"] >= 1 for r in records)
    assert all(("log_prob_gap" in r) == (r["staleness"] > 0) for r in records)
    served = tmp_path / "served.jsonl"
    assert run_distributed(_train, 1, argv[:-1] + [str(served), "--use-scoring-server"], timeout=120) == [0]
    assert any(r["reward"] > 0 for r in records)
    for a, b in zip(records, [json.loads(line) for line in served.read_text().splitlines()], strict=True):
        assert b["scorer_staleness"] == 0.0
        assert {k: v for k, v in a.items() if not k.startswith(("time_", "samples_per_s"))} == \
            {k: v for k, v in b.items() if not k.startswith(("time_", "samples_per_s", "scorer_"))}
    assert all(r["log_prob_gap"] > 0 and r["is_weight_mean"] > 0 for r in records if r["staleness"] > 0)


@pytest.mark.slow
def test_partial_rollouts_on_rollout_ranks_stay_there_across_weight_syncs(tmp_path):
    """--partial-rollout-tokens with --rollout-world-size: the rollout rank keeps the rows in flight and sends each
    batch with its per-token versions.  On-policy (--max-staleness 0) the run equals the colocated one; with
    --max-staleness 2 rows started under older synced weights finish under newer ones (staleness up to 2, the
    update correcting with each token's behaviour log-prob)."""
    base = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters",
            "40", "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
            "--pretrain-global-batch-size", "4", "--advantage-estimator", "grpo", "--ppo-epochs", "1",
            "--partial-rollout-tokens", "1", "--tensorboard-dir", "", "--reward-fn",
            "tests.rlhf.test_example:text_reward"]
    paths = [tmp_path / "colocated.jsonl", tmp_path / "disaggregated.jsonl", tmp_path / "stale.jsonl"]
    on_policy = base + ["--train-iters", "2"]
    assert run_distributed(_train, 1, on_policy + ["--metrics-file", str(paths[0])], timeout=120,
                           backend="gloo") == [0]
    assert run_distributed(_train, 2, on_policy + ["--rollout-world-size", "1", "--metrics-file", str(paths[1])],
                           timeout=120) == [0, 0]
    colocated, disaggregated = ([json.loads(line) for line in path.read_text().splitlines()] for path in paths[:2])
    assert len(colocated) == 2 and any(r["policy_loss"] != 0.0 for r in colocated)
    for a, b in zip(colocated, disaggregated):
        assert {k: v for k, v in a.items() if not k.startswith(("time_", "samples_per_s"))} == \
            {k: v for k, v in b.items() if not k.startswith(("time_", "sync_", "samples_per_s"))}
    argv = base + ["--train-iters", "4", "--rollout-world-size", "1", "--max-staleness", "2", "--rollout-is-cap", "2",
                   "--metrics-file", str(paths[2])]
    assert run_distributed(_train, 2, argv, timeout=120) == [0, 0]
    records = [json.loads(line) for line in paths[2].read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 5))
    assert all(r["staleness"] <= 2 for r in records) and any(r["staleness"] >= 1 for r in records)
    assert all(r["log_prob_gap"] > 0 for r in records if r["staleness"] > 0)


def parity_reward(prompt: str, response: str) -> float:
    """A reward whose two-sample groups are all-equal about half the time (dynamic sampling drops those)."""
    return float(len(response) % 2)


def _dynamic_batches(argv):
    """The trainer's rollouts of a partial, dynamically sampled run, with a weight update (in place) after each
    batch: per batch, the largest gap between each token's behaviour log-prob and its own version's weights'
    log-prob, whether the version is the oldest token's, the staleness, the kept fraction and whether each group's
    rewards vary; and the groups that finished against the groups trained."""
    trainer = RLTrainer(parse_args(argv))
    trainer._setup()
    rollouts, module = trainer.rollouts, trainer.actor.chunk.module
    taken = []
    take = rollouts.partial.take

    def counted(groups, *rest):
        batch = take(groups, *rest)
        taken.append(0 if batch is None else len(batch) // 2)
        return batch
    rollouts.partial.take = counted
    states, batches = {0: {k: v.clone() for k, v in module.state_dict().items()}}, []
    for rollout in rollouts:
        versions, mask = rollout.token_versions, rollout.response_mask
        expected = torch.zeros_like(rollout.behaviour_log_probs)
        for version in versions[mask > 0].unique().tolist():
            expected = torch.where(versions == version, _log_probs(module, rollout, states[version]), expected)
        rewards = rollout.rewards.view(-1, 2)
        batches.append((float(((rollout.behaviour_log_probs - expected * mask).abs()).max()),
                        rollout.version == int(versions[mask > 0].min()), rollouts.version - rollout.version,
                        rollout.metadata["kept_fraction"], (rewards[:, 0] != rewards[:, 1]).tolist(),
                        len(rollouts.partial)))
        _perturb(module, rollouts.version + 10)
        rollouts.version += 1
        states[rollouts.version] = {k: v.clone() for k, v in module.state_dict().items()}
    return batches, sum(taken)


@pytest.mark.slow
def test_partial_rollouts_with_dynamic_sampling_train_varied_complete_groups():
    """--partial-rollout-tokens with --dynamic-sampling: groups are filtered once complete (all-equal rewards
    dropped), a refill round asks only for the groups still missing and the rows in flight carry over; every token
    of a trained batch keeps the log-prob of the weights (version) that sampled it."""
    argv = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "40",
            "--train-iters", "5", "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size",
            "4", "--pretrain-global-batch-size", "4", "--advantage-estimator", "grpo", "--partial-rollout-tokens", "1",
            "--max-staleness", "2", "--dynamic-sampling", "--max-num-gen-batches", "8", "--max-new-tokens", "4",
            "--reward-fn", "tests.rlhf.test_partial_rollouts:parity_reward"]
    [(batches, finished)] = run_distributed(_dynamic_batches, 1, argv, timeout=120)
    assert len(batches) == 5
    for gap, oldest, staleness, kept, varied, in_flight in batches:
        assert gap < 1e-5 and oldest and 0 <= staleness <= 2
        assert varied[:round(kept * 2)] == [True] * round(kept * 2)  # the kept groups lead the batch
    assert any(staleness > 0 for _, _, staleness, _, _, _ in batches)
    assert any(in_flight for *_, in_flight in batches)
    assert finished > 2 * 5  # some finished groups were dropped for all-equal rewards and refilled


@pytest.mark.parametrize("extra, message", [
    (["--partial-rollout-tokens", "4"], r"--partial-rollout-tokens 4 needs 1 <= tokens <= --max-new-tokens 3"),
    (["--partial-rollout-tokens", "1", "--environment", "guidance", "--max-total-tokens", "32",
      "--guide-samples-per-attempt", "2", "--advantage-estimator", "grpo"],
     r"and --guide-samples-per-attempt 1 \(several hints branch an episode; partial rollouts keep whole groups\)"),
])
def test_partial_rollouts_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        validate(parse_args(["--tensor-model-parallel-size", "1", "--global-batch-size", "2",
                             "--n-samples-per-prompt", "2", "--micro-batch-size", "4"] + extra), 1)


TOK = ByteTokenizer()


def _calculator_script(weights: dict):
    """A sampler that plays the calculator task with the tool, continuing whatever part of its action a row
    holds: first "<calc>a*b</calc>", then the result it read; each token's log-prob is -(version + 1) / 10 for
    the ``weights["version"]`` it is sampled under."""
    def sample(prompts, prompt_mask, sampling, generator):
        actions = []
        for row in prompts.tolist():
            text = TOK.detokenize(row)
            if "</result>" in text:
                done, target = text.rsplit("</result>", 1)[1], text.split("<result>")[1].split("</result>")[0]
            else:
                done, target = text.split("=", 1)[1], f"<calc>{text.split('=')[0]}</calc>"
            ids = TOK.tokenize(target) + [TOK.eod]
            assert TOK.tokenize(done) == ids[:len(TOK.tokenize(done))]  # the action so far is the script's
            actions.append(ids[len(TOK.tokenize(done)):][:sampling.max_new_tokens])
        return scripted_output(prompts, prompt_mask, actions, sampling.pad_id, -(weights["version"] + 1) / 10)
    return sample


def _calculator_rounds(partial, weights, rounds, start=0):
    """``rounds`` rounds from version ``start`` (one weight update each): the groups that finished."""
    finished = []
    for version in range(start, start + rounds):
        weights["version"] = version
        rollout = partial.advance(version)
        finished += [] if rollout is None else [rollout]
    return finished


def test_calculator_episodes_paused_mid_action_continue_after_weight_updates():
    """Environment episodes under partial rollouts: actions of up to 2 tokens per round, so the tool call
    "<calc>a*b</calc>" spans nine rounds (nine weight versions); the tool's observation keeps loss mask 0 and
    version -1, every sampled token keeps its version's log-prob, the trained tokens are exactly the sampled ones,
    and a state saved in the middle of the answer after the tool call (JSON) resumes, the tool call replayed into a
    fresh environment, to the same batches."""
    weights = {"version": 0}
    sampling = SamplingConfig(max_new_tokens=20, eos_id=TOK.eod, pad_id=TOK.pad)

    def make():
        return PartialEpisodes(_calculator_script(weights), sampling, 2, EpisodeLimits(max_turns=3,
                                                                                        max_total_tokens=48),
                               lambda: CalculatorEnvironment(TOK, max_operand=9), group_size=2)
    partial = make()
    partial.add([5, 5, 7, 7])
    first = _calculator_rounds(partial, weights, 10)
    saved = json.loads(json.dumps(partial.state()))
    assert not first and any(row["spans"] and row["turn_start"] is not None for row in saved["rows"])
    rest = _calculator_rounds(partial, weights, 10, start=10)
    resumed = make()
    resumed.load_state(saved)
    assert [r.input_ids.tolist() for r in _calculator_rounds(resumed, weights, 10, start=10)] == \
        [r.input_ids.tolist() for r in rest]
    assert sum(len(r) for r in rest) == 4 and len(partial) == 0
    for rollout in rest:
        assert rollout.rewards.tolist() == [1.0] * len(rollout) and rollout.metadata["turns"] == [2] * len(rollout)
        mask, versions = rollout.response_mask, rollout.token_versions
        assert bool((versions[mask == 0] == -1).all()) and bool((versions[mask > 0] >= 0).all())
        torch.testing.assert_close(rollout.behaviour_log_probs, -(versions + 1) / 10 * mask, rtol=0, atol=1e-7)
        assert rollout.version == int(versions[mask > 0].min())
        for row, (prompt, response) in enumerate(zip(rollout.prompts, rollout.responses)):
            product = eval(prompt[:-1])
            assert response == f"<calc>{prompt[:-1]}</calc><result>{product}</result>{product}"
            (s0, e0), (s1, e1) = rollout.turn_spans[row]
            assert len(set(versions[row, s0 - 1:e0 - 1].tolist())) == 9  # the tool call spans nine versions
            assert bool((mask[row, e0 - 1:s1 - 1] == 0).all()) and TOK.detokenize(
                rollout.input_ids[row, e0:s1]) == f"<result>{product}</result>"


def _guidance_scripts(weights: dict):
    """A policy and a guide that continue whatever part of their turn a row holds: the policy attempts the product
    + 1 (wrong) and revises by copying the hint; the guide hints the product.  Each token's log-prob is
    -(version + 1) / 10 for the policy's ``weights["version"]``, -(version + 1) / 10 - 0.05 for the guide's
    ``weights["clock"].version``."""
    def continue_script(prompts, prompt_mask, sampling, target_of, log_prob):
        actions = []
        for row in prompts.tolist():
            done, target = target_of(TOK.detokenize(row))
            ids = TOK.tokenize(target) + [TOK.eod]
            assert TOK.tokenize(done) == ids[:len(TOK.tokenize(done))]  # the turn so far is the script's
            actions.append(ids[len(TOK.tokenize(done)):][:sampling.max_new_tokens])
        return scripted_output(prompts, prompt_mask, actions, sampling.pad_id, log_prob)

    def policy_target(text):
        if "</hint>" in text:
            return text.rsplit("</hint>", 1)[1], text.split("<hint>")[1].split("</hint>")[0]
        return text.split("=", 1)[1], str(eval(text.split("=")[0]) + 1)

    def guide_target(text):
        return text.rsplit("|", 1)[1], text.split("|")[1]

    def policy(prompts, prompt_mask, sampling, generator):
        return continue_script(prompts, prompt_mask, sampling, policy_target, -(weights["version"] + 1) / 10)

    def guide(prompts, prompt_mask, sampling, generator):
        return continue_script(prompts, prompt_mask, sampling, guide_target,
                               -(weights["clock"].version + 1) / 10 - 0.05)
    return policy, guide


def _guidance_rounds(partial, weights, rounds, start=0):
    """``rounds`` rounds from version ``start``, both models updated after each: the groups that finished."""
    finished = []
    for version in range(start, start + rounds):
        weights["version"] = weights["clock"].version = version
        rollout = partial.advance(version)
        finished += [] if rollout is None else [rollout]
    return finished


def test_guidance_episodes_pause_in_the_attempt_the_hint_and_the_revision_across_weight_updates():
    """The guidance flow under partial rollouts, one token per round: the attempt, the guide's hint and the
    revision each span several weight versions; every policy token keeps its version's log-prob, every hint token
    its guide version's (in the guide's rollout, with its token versions), the hint reaches the policy as an
    untrained observation, and a state saved while a hint is half written (JSON) resumes into fresh environments and
    writers to the same batches of both models."""
    weights = {"version": 0, "clock": GuideClock()}
    sampling = SamplingConfig(max_new_tokens=6, eos_id=TOK.eod, pad_id=TOK.pad)
    policy, guide = _guidance_scripts(weights)

    def make():
        return PartialEpisodes(policy, sampling, 1, EpisodeLimits(max_turns=3, max_total_tokens=40),
                               lambda: GuidanceEnvironment(TOK, max_operand=9, guide=PartialHintWriter(
                                   guide, sampling, 1, weights["clock"])), group_size=2)
    partial = make()
    partial.add([5, 5, 6, 6])
    first = _guidance_rounds(partial, weights, 4)
    saved = json.loads(json.dumps(partial.state()))
    assert not first and any(row["pending"] and row["env"]["writer"]["tokens"] for row in saved["rows"])
    rest = _guidance_rounds(partial, weights, 30, start=4)
    resumed = make()
    resumed.load_state(saved)
    again = _guidance_rounds(resumed, weights, 30, start=4)

    def both(rollouts):
        return [(r.input_ids.tolist(), r.behaviour_log_probs.tolist(), g.input_ids.tolist(),
                 g.behaviour_log_probs.tolist(), g.token_versions.tolist(), g.rewards.tolist())
                for r, g in ((r, guide_rollout(r.metadata["environments"], TOK.pad)) for r in rollouts)]
    assert both(again) == both(rest)
    assert sum(len(r) for r in rest) == 4 and len(partial) == 0
    for rollout in rest:
        envs = rollout.metadata["environments"]
        mask, versions = rollout.response_mask, rollout.token_versions
        assert rollout.rewards.tolist() == [1.0] * len(rollout) and rollout.metadata["turns"] == [2] * len(rollout)
        assert bool((versions[mask == 0] == -1).all()) and bool((versions[mask > 0] >= 0).all())
        torch.testing.assert_close(rollout.behaviour_log_probs, -(versions + 1) / 10 * mask, rtol=0, atol=1e-7)
        guided = guide_rollout(envs, TOK.pad)
        g_mask, g_versions = guided.response_mask, guided.token_versions
        assert bool((g_versions[g_mask == 0] == -1).all()) and bool((g_versions[g_mask > 0] >= 0).all())
        torch.testing.assert_close(guided.behaviour_log_probs, (-(g_versions + 1) / 10 - 0.05) * g_mask, rtol=0,
                                   atol=1e-7)
        assert guided.version == int(g_versions[g_mask > 0].min()) and guided.rewards.tolist() == [1.0] * len(envs)
        for row, (prompt, response) in enumerate(zip(rollout.prompts, rollout.responses)):
            product = eval(prompt[:-1])
            assert response == f"{product + 1}<hint>{product}</hint>{product}"
            (s0, e0), (s1, e1) = rollout.turn_spans[row]
            hint_versions = envs[row].guide_versions
            assert len(set(versions[row, s0 - 1:e0 - 1].tolist())) == e0 - s0 > 1  # one version per attempt token
            assert len(set(hint_versions)) == len(hint_versions) > 1
            assert len(set(versions[row, s1 - 1:e1 - 1].tolist())) == e1 - s1 > 1
            # the hint was written after the attempt (from the round that ended it) and before the revision
            assert max(versions[row, s0 - 1:e0 - 1].tolist()) <= min(hint_versions)
            assert max(hint_versions) < min(versions[row, s1 - 1:e1 - 1].tolist())
            assert bool((mask[row, e0 - 1:s1 - 1] == 0).all()) and TOK.detokenize(
                rollout.input_ids[row, e0:s1]) == f"<hint>{product}</hint>"


def _guidance_run(argv):
    """A partial-rollout guidance run: per batch, the largest gap between each token's behaviour log-prob and the
    log-prob under the weights of its version, for the policy's rollout and the guide's (the weights of both models
    snapshotted at every version), their staleness and how many versions their tokens span; and how far each model
    moved from its warm-up (``test_guidance.moved``)."""
    trainer = RLTrainer(parse_args(argv))
    setup, batches = trainer._setup, []

    def snapshot(module):
        return {k: v.clone() for k, v in module.state_dict().items()}

    def watched_setup():
        ready = setup()
        rollouts, states = trainer.rollouts, {}
        models = (trainer.actor.chunk.module, trainer.guide.backend.chunk.module)
        make = rollouts.rollout

        def rollout(iteration):
            states[rollouts.version] = [snapshot(model) for model in models]
            batch = make(iteration)
            row = []
            for which, (model, made) in enumerate(zip(models, (batch, batch.metadata["guide"]))):
                versions, mask = made.token_versions, made.response_mask
                expected = torch.zeros_like(made.behaviour_log_probs)
                for version in versions[mask > 0].unique().tolist():
                    expected = torch.where(versions == version, _log_probs(model, made, states[version][which]),
                                           expected)
                row.append((float((made.behaviour_log_probs - expected * mask).abs().max()),
                            rollouts.version - made.version, len(versions[mask > 0].unique())))
            batches.append(row)
            return batch
        rollouts.rollout = rollout
        return ready
    trainer._setup = watched_setup
    trainer.train()
    return (batches, *moved(trainer))


@pytest.mark.slow
def test_a_guidance_run_with_partial_rollouts_trains_both_models_on_tokens_of_several_versions(tmp_path):
    """--partial-rollout-tokens 1 with --environment guidance: episodes pause in any turn (the guide's hint
    included) and continue under the next weights of both models; in every batch each policy token and each hint
    token carries the log-prob of the weights (of its model, at its version) that sampled it, some batches span
    several versions, and the run trains the policy and the guide."""
    metrics = tmp_path / "metrics.jsonl"
    argv = small_guidance_argv(metrics, 5, 9, "--partial-rollout-tokens", "1", "--max-staleness", "2",
                               "--rollout-is-cap", "2")
    [(batches, actor_moved, guide_moved)] = run_distributed(_guidance_run, 1, argv, timeout=120)
    assert len(batches) == 5 and actor_moved > 0 and guide_moved > 0
    for policy, guide in batches:
        assert policy[0] < 1e-5 and guide[0] < 1e-5
        assert 0 <= policy[1] <= 2 and 0 <= guide[1] <= policy[1]
    assert any(policy[2] > 1 for policy, _ in batches) and any(guide[2] > 1 for _, guide in batches)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    assert all("guide_policy_loss" in r and r["staleness"] == p[1] for r, (p, _) in zip(records, batches))
