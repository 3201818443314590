"""The shipped environments: a single-turn verifier task and a calculator-tool arithmetic task, and their warm-up.

:class:`VerifierEnvironment` asks one question and scores the one answer with a verifier (by default the RL
trainer's "a+b=" task and its exact-answer reward).  :class:`CalculatorEnvironment` asks a multiplication
"a*b=" the policy may work out with a calculator tool: an action ``<calc>EXPR</calc>`` is a tool call, which the
environment evaluates and answers with the observation ``<result>VALUE</result>`` (reward 0, the episode goes on);
any other action is the final answer, rewarded 1 when it is the product.  A tool call whose expression is not
plain integer arithmetic, or divides by zero, raises, and the episode driver ends that episode with its error
reward.  :func:`warmup_batch` turns an environment's demonstration episodes into the RL trainer's warm-up
batches (``--environment``).
"""

from __future__ import annotations

import ast
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


ENVIRONMENTS = {"verifier": VerifierEnvironment, "calculator": CalculatorEnvironment}
"""The RL trainer's ``--environment`` choices."""


def make_environment(args) -> Environment:
    """A fresh episode of the trainer's ``--environment`` (``--max-operand``, ``--warmup-direct-fraction``) on its
    byte tokenizer."""
    options = {} if args.warmup_direct_fraction is None else {"direct_fraction": args.warmup_direct_fraction}
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
    ``--max-operand``), so the trainer can check ``--max-total-tokens`` before any collective."""
    env = make_environment(args)
    return len(env.pose(_Largest())) + sum(len(ids) for ids, _ in env.demonstration())


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
