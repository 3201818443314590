"""The shipped environments: a single-turn verifier task, a calculator-tool arithmetic task and the two-turn
guidance flow, and their warm-up.

:class:`VerifierEnvironment` asks one question and scores the one answer with a verifier (by default the RL
trainer's "a+b=" task and its exact-answer reward).  :class:`CalculatorEnvironment` asks a multiplication
"a*b=" the policy may work out with a calculator tool: an action ``<calc>EXPR</calc>`` is a tool call, which the
environment evaluates and answers with the observation ``<result>VALUE</result>`` (reward 0, the episode goes on);
any other action is the final answer, rewarded 1 when it is the product.  A tool call whose expression is not
plain integer arithmetic, or divides by zero, raises, and the episode driver ends that episode with its error
reward.  :class:`GuidanceEnvironment` is the guidance flow: the policy's attempt at "a*b=", a second (trained) model's
hint, the policy's revised attempt, a reward on the revision (``megalite.rlhf.guidance`` trains the guide on
the revision's improvement).  :func:`warmup_batch` turns an environment's demonstration episodes into the RL trainer's warm-up
batches (``--environment``).
"""

from __future__ import annotations

import ast
import copy
import operator
import random
import re
from typing import Callable

from megalite.data.synthetic import arithmetic_answer
from megalite.rlhf.arithmetic import TOKENIZER, lm_batch, problem
from megalite.rlhf.environment import Environment, StepResult
from megalite.rlhf.rewards import arithmetic_reward

TOOL_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
"""A calculator call in the model's text; the first one in an action is executed."""

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod}
MAX_DIGITS = 12
"""Operands and results longer than this are refused (a tool call may not blow up the observation)."""


def calculate(expression: str) -> int:
    """The value of integer arithmetic (``+ - * // %``, unary minus, parentheses); a ValueError for anything else
    and a ZeroDivisionError for a zero divisor."""
    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            result = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
        else:
            raise ValueError(f"the calculator takes integer + - * // % only, not {ast.dump(node):.60}")
        if len(str(abs(result))) > MAX_DIGITS:
            raise ValueError(f"the calculator refuses numbers over {MAX_DIGITS} digits")
        return result
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"the calculator cannot parse {expression!r}") from None
    return value(tree.body)


class VerifierEnvironment(Environment):
    """One question (``make_prompt(rng)``), one answer, scored by ``verify(prompt, answer_text)``; ``answer(prompt)``
    writes a good answer for warm-up demonstrations.  The defaults are the RL trainer's "a+b=" problems up to
    ``max_operand`` and its exact-answer reward."""

    def __init__(self, tokenizer, make_prompt: Callable[[random.Random], str] | None = None,
                 verify: Callable[[str, str], float] = arithmetic_reward,
                 answer: Callable[[str], str] = arithmetic_answer, max_operand: int = 9):
        super().__init__(tokenizer)
        self.make_prompt = make_prompt or (lambda rng: problem(rng, max_operand))
        self.verify, self.answer, self.prompt = verify, answer, ""

    def reset(self, seed: int) -> list[int]:
        return self.pose(random.Random(seed))

    def pose(self, rng: random.Random) -> list[int]:
        """The question drawn from ``rng``, as prompt ids."""
        self.prompt = self.make_prompt(rng)
        return self.tokenizer.tokenize(self.prompt)

    def step(self, action: list[int]) -> StepResult:
        return StepResult([], float(self.verify(self.prompt, self.action_text(action))), done=True)

    def demonstration(self) -> list[tuple[list[int], bool]]:
        return [(self.tokenizer.tokenize(self.answer(self.prompt)) + [self.tokenizer.eod], True)]


class CalculatorEnvironment(Environment):
    """"a*b=" with ``0 <= a, b <= max_operand``, a ``<calc>EXPR</calc>`` calculator tool, reward 1 for the product.

    ``direct_fraction`` of the demonstrations answer at once without the tool (drawn with the question): a warm-up
    that has not learned when to call the tool, which RL then has to learn."""

    def __init__(self, tokenizer, max_operand: int = 99, direct_fraction: float = 0.0):
        super().__init__(tokenizer)
        if not 0.0 <= direct_fraction <= 1.0:
            raise ValueError(f"direct_fraction must be in [0, 1], got {direct_fraction}")
        self.max_operand, self.direct_fraction = max_operand, direct_fraction
        self.question, self.answer, self.direct = "", 0, False

    def reset(self, seed: int) -> list[int]:
        return self.pose(random.Random(seed))

    def pose(self, rng: random.Random) -> list[int]:
        """The question drawn from ``rng``, as prompt ids."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        self.question, self.answer = f"{a}*{b}", a * b
        self.direct = rng.random() < self.direct_fraction
        return self.tokenizer.tokenize(self.question + "=")

    def demonstration(self) -> list[tuple[list[int], bool]]:
        """Call the calculator on the question, then copy its result (or answer at once when ``direct``)."""
        tokens, eod = self.tokenizer.tokenize, self.tokenizer.eod
        if self.direct:
            return [(tokens(str(self.answer)) + [eod], True)]
        return [(tokens(f"<calc>{self.question}</calc>") + [eod], True),
                (tokens(f"<result>{self.answer}</result>"), False), (tokens(str(self.answer)) + [eod], True)]

    def step(self, action: list[int]) -> StepResult:
        text = self.action_text(action)
        call = TOOL_CALL.search(text)
        if call is not None:
            return StepResult(self.tokenizer.tokenize(f"<result>{calculate(call.group(1))}</result>"))
        return StepResult([], float(text.strip() == str(self.answer)), done=True)


HintWriter = Callable[[list[int]], tuple]
"""The guide of :class:`GuidanceEnvironment`: its prompt's token ids -> the hint's sampled ids (ending in
end-of-document unless cut) and their behaviour log-probs, and optionally each token's policy version
(``megalite.rlhf.guidance.hint_writer`` builds one on a sampler).  A writer that writes the hint over several
rounds (partial rollouts: ``megalite.rlhf.guidance.PartialHintWriter``) raises
:class:`~megalite.rlhf.environment.StepPending` until it is done, and keeps the hint so far: its ``state()`` and
``load_state()`` are saved and restored with the environment's."""


def _product(rng: random.Random, max_operand: int) -> str:
    return f"{rng.randint(0, max_operand)}*{rng.randint(0, max_operand)}="


class GuidanceEnvironment(Environment):
    """attempt -> hint -> revised attempt -> reward on the revision, for "a*b=" with ``0 <= a, b <= max_operand``.

    The policy's first action is its attempt (turn reward 0).  The guide, a second model, reads the question,
    the attempt's ids as sampled and the reference answer (privileged information the policy lacks, as a
    teacher marking the attempt has) as ``"a*b=" + attempt + "|answer|"``, and writes a hint; the policy sees it
    as the observation ``<hint>HINT</hint>`` (the guide's sampled ids as they are) and answers again: the
    revision, rewarded 1 when it is the product.  After the episode ``attempt_reward``, ``revision_reward``
    (None when the episode ended before a revision: then the attempt stands) and ``guide_turn`` (the guide's
    prompt ids, hint ids and log-probs, None before a hint) describe it; ``guide_versions`` holds each hint
    token's guide version when the writer gives them (partial rollouts), else None.

    With ``hints`` > 1 the guide writes that many hints to the attempt, and the step branches the episode
    (:attr:`~megalite.rlhf.environment.StepResult.branches`): each hint gets its own copy of this environment and
    its own revision, as a row of its own right after this one.

    ``guide`` may be None for demonstrations only.  In the policy's demonstrations the attempt is right or (half
    of them, drawn with the question) a wrong number, shown but not trained, and the revision copies a right
    hint; in the guide's (:meth:`guide_task`) the hint is the answer, or a wrong number for
    ``wrong_hint_fraction`` of them: a guide RL still has to teach."""

    HINT_OPEN, HINT_CLOSE = "<hint>", "</hint>"

    def __init__(self, tokenizer, max_operand: int = 9, guide: HintWriter | None = None,
                 wrong_hint_fraction: float = 0.0, hints: int = 1):
        super().__init__(tokenizer)
        if not 0.0 <= wrong_hint_fraction <= 1.0:
            raise ValueError(f"wrong_hint_fraction must be in [0, 1], got {wrong_hint_fraction}")
        if not isinstance(hints, int) or hints < 1:
            raise ValueError(f"hints must be a positive integer, got {hints!r}")
        self.hints = hints
        self.task = VerifierEnvironment(tokenizer, lambda rng: _product(rng, max_operand))
        self.max_operand, self.guide, self.wrong_hint_fraction = max_operand, guide, wrong_hint_fraction
        self.attempt_reward, self.revision_reward, self.guide_turn, self.guide_versions = 0.0, None, None, None
        self.wrong_attempt, self.wrong_hint = "", ""

    def reset(self, seed: int) -> list[int]:
        return self.pose(random.Random(seed))

    def pose(self, rng: random.Random) -> list[int]:
        """The question drawn from ``rng``, as prompt ids (the demonstrations' draws come from ``rng`` too)."""
        prompt = self.task.pose(rng)
        answer, largest = int(self.task.answer(self.task.prompt)), max(self.max_operand ** 2, 1)
        wrong = lambda: str((answer + rng.randint(1, largest)) % (largest + 1))  # noqa: E731  (0..largest, not answer)
        self.wrong_attempt = wrong() if rng.random() < 0.5 else ""
        self.wrong_hint = wrong() if rng.random() < self.wrong_hint_fraction else ""
        self.attempt_reward, self.revision_reward, self.guide_turn, self.guide_versions = 0.0, None, None, None
        return prompt

    _STATE = ("attempt_reward", "revision_reward", "guide_turn", "guide_versions")

    def state(self) -> dict:
        """The rewards, the guide's turn and its writer's hint in progress: the hint was sampled by another model,
        so a replay of the policy's actions could not redraw it."""
        writer = getattr(self.guide, "state", None)
        return {**{name: getattr(self, name) for name in self._STATE}, "writer": writer and writer()}

    def load_state(self, state: dict) -> None:
        for name in self._STATE:
            setattr(self, name, state[name])
        if self.guide_turn is not None:
            self.guide_turn = tuple(map(list, self.guide_turn))
        if state["writer"] is not None:
            self.guide.load_state(state["writer"])

    def guide_prompt(self, attempt: list[int]) -> list[int]:
        """What the guide reads: the question, the attempt's ids (without end-of-document) and the answer."""
        if self.tokenizer.eod in attempt:
            attempt = attempt[:attempt.index(self.tokenizer.eod)]
        tokens = self.tokenizer.tokenize
        return tokens(self.task.prompt) + list(attempt) + tokens(f"|{self.task.answer(self.task.prompt)}|")

    def hint_observation(self, hint: list[int]) -> list[int]:
        """The policy's observation around the guide's ids (without end-of-document)."""
        if self.tokenizer.eod in hint:
            hint = hint[:hint.index(self.tokenizer.eod)]
        tokens = self.tokenizer.tokenize
        return tokens(self.HINT_OPEN) + list(hint) + tokens(self.HINT_CLOSE)

    def step(self, action: list[int]) -> StepResult:
        score = self.task.step(action).reward
        if self.guide_turn is not None:
            self.revision_reward = score
            return StepResult([], score, done=True)
        if self.guide is None:
            raise RuntimeError("GuidanceEnvironment was built without a guide; it can only give demonstrations")
        self.attempt_reward = score
        prompt = self.guide_prompt(action)
        branches = []
        for _ in range(self.hints):
            hint, log_probs, *versions = self.guide(prompt)
            branch = copy.copy(self) if branches else self
            branch.guide_turn = (prompt, list(hint), list(log_probs))
            branch.guide_versions = list(versions[0]) if versions else None
            branches.append((branch, self.hint_observation(hint)))
        return StepResult(branches[0][1], branches=branches[1:])

    def demonstration(self) -> list[tuple[list[int], bool]]:
        """A right attempt, or a wrong one (shown, not trained); a right hint; the revision copying it."""
        tokens, eod = self.tokenizer.tokenize, self.tokenizer.eod
        answer = self.task.answer(self.task.prompt)
        return [(tokens(self.wrong_attempt or answer) + [eod], not self.wrong_attempt),
                (self.hint_observation(tokens(answer)), False), (tokens(answer) + [eod], True)]

    def guide_task(self) -> "Environment":
        """The guide's side of this episode as a one-turn environment whose demonstration is the hint: its
        warm-up (``warmup_batch``) reads the guide's prompt after the demonstrated attempt."""
        return _GuideTask(self)


class _GuideTask(Environment):
    def __init__(self, episode: GuidanceEnvironment):
        super().__init__(episode.tokenizer)
        self.episode = episode

    def reset(self, seed: int) -> list[int]:
        return self.pose(random.Random(seed))

    def pose(self, rng: random.Random) -> list[int]:
        self.episode.pose(rng)
        attempt, _ = self.episode.demonstration()[0]
        return self.episode.guide_prompt(attempt)

    def demonstration(self) -> list[tuple[list[int], bool]]:
        episode = self.episode
        hint = episode.wrong_hint or episode.task.answer(episode.task.prompt)
        return [(self.tokenizer.tokenize(hint) + [self.tokenizer.eod], True)]


ENVIRONMENTS = {"verifier": VerifierEnvironment, "calculator": CalculatorEnvironment, "guidance": GuidanceEnvironment}
"""The RL trainer's ``--environment`` choices."""


def make_environment(args, guide: HintWriter | None = None) -> Environment:
    """A fresh episode of the trainer's ``--environment`` (``--max-operand``, ``--warmup-direct-fraction``,
    ``--warmup-wrong-hint-fraction``, ``--guide-samples-per-attempt``; ``guide``: the guidance flow's hint writer)
    on its byte tokenizer."""
    options = {} if args.warmup_direct_fraction is None else {"direct_fraction": args.warmup_direct_fraction}
    if args.environment == "guidance":
        options = {"guide": guide, "hints": args.guide_samples_per_attempt}
        if args.warmup_wrong_hint_fraction is not None:
            options["wrong_hint_fraction"] = args.warmup_wrong_hint_fraction
    return ENVIRONMENTS[args.environment](TOKENIZER, max_operand=args.max_operand, **options)


class _Largest(random.Random):
    """Draws the top of every ``randint`` range and 1.0 from ``random``: the longest question the trainer's tasks
    can pose, demonstrated with the tool."""

    def randint(self, a: int, b: int) -> int:
        return b

    def random(self) -> float:
        return 1.0


def longest_demonstration(args) -> int:
    """Tokens of the longest warm-up demonstration of the trainer's ``--environment`` (both operands
    ``--max-operand``; the guidance flow's policy and guide alike), so the trainer can check
    ``--max-total-tokens`` before any collective."""
    env = make_environment(args)
    views = [env, env.guide_task()] if isinstance(env, GuidanceEnvironment) else [env]
    return max(len(view.pose(_Largest())) + sum(len(ids) for ids, _ in view.demonstration()) for view in views)


def warmup_batch(make: Callable[[], Environment], rng: random.Random, rows: int, max_tokens: int) -> dict:
    """``rows`` demonstration episodes of fresh environments from ``make``, as one warm-up batch whose loss covers
    the actions only (prompts and observations are given, as in RL); a ValueError when one is longer than
    ``max_tokens`` (an episode could not hold it either)."""
    documents, trained = [], []
    for _ in range(rows):
        env = make()
        ids = env.reset(rng.randrange(2 ** 31))
        flags = [0.0] * len(ids)
        for segment, is_action in env.demonstration():
            ids, flags = ids + segment, flags + [float(is_action)] * len(segment)
        if len(ids) > max_tokens:
            raise ValueError(f"a {type(env).__name__} demonstration of {len(ids)} tokens does not fit in "
                             f"{max_tokens} tokens (--max-total-tokens)")
        documents.append(ids)
        trained.append(flags)
    return lm_batch(documents, trained)
