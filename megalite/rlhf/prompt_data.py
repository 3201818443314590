"""RL prompts from a jsonl file (``--prompt-data``): the records' ``prompt`` and ``answer`` fields, a held-out split.

The records are read with ``megalite.rlhf.math_task.read_answers`` (the shipped math task's file or a user's own
jsonl with ``prompt`` and ``answer``); the last ``--held-out-prompts`` records are kept out of training and answered
greedily at each ``--eval-interval``.  Responses are scored against the records' answers by
``megalite.rlhf.verifiers.answer_reward``.  Where every training record also has a ``completion`` (the math task's
worked solution), the actor's warm-up is supervised fine-tuning on them: loss on the completion and
end-of-document only, so RL starts from an SFT'd policy.
"""

from __future__ import annotations

import random

from megalite.rlhf.arithmetic import TOKENIZER, lm_batch
from megalite.rlhf.math_task import read_answers
from megalite.rlhf.verifiers import answer_reward


class PromptData:
    """The records of ``path`` split into training and ``held_out`` evaluation prompts; ValueError (naming the
    file) for a malformed file or a split that leaves either side empty."""

    def __init__(self, path: str, held_out: int):
        records = read_answers(path)
        if not 0 <= held_out < len(records):
            raise ValueError(f"--held-out-prompts {held_out} must be in [0, {len(records)}): {path} holds "
                             f"{len(records)} records")
        self.train, self.held_out = records[:len(records) - held_out], records[len(records) - held_out:]
        self.width = max(len(TOKENIZER.tokenize(r["prompt"])) for r in records)
        """Tokens of the longest prompt (every prompt is left-padded to it)."""
        self.reward = answer_reward(records)
        self.has_completions = all(isinstance(r.get("completion"), str) for r in self.train)

    def draw(self, rng: random.Random, count: int) -> list[str]:
        """``count`` training prompts drawn with replacement."""
        return [rng.choice(self.train)["prompt"] for _ in range(count)]

    def eval_prompts(self, rank: int, size: int) -> list[str]:
        """Data-parallel rank ``rank``'s share of the held-out prompts."""
        return [r["prompt"] for r in self.held_out[rank::size]]

    def demonstration(self, record: dict) -> tuple[list[int], list[int]]:
        """``prompt + completion + <eod>`` as tokens, and the completion-and-eod part's length."""
        prompt = TOKENIZER.tokenize(record["prompt"])
        answer = TOKENIZER.tokenize(record["completion"]) + [TOKENIZER.eod]
        return prompt + answer, len(answer)

    def longest_answer(self) -> int:
        """Tokens of the longest completion plus end-of-document."""
        return max(self.demonstration(r)[1] for r in self.train)

    def warmup_batch(self, rng: random.Random, rows: int) -> dict:
        """``rows`` training demonstrations right-padded into one batch (``arithmetic.lm_batch``), loss on the
        completion and end-of-document."""
        tokens, trained = [], []
        for record in (rng.choice(self.train) for _ in range(rows)):
            ids, answer = self.demonstration(record)
            tokens.append(ids)
            trained.append([0.0] * (len(ids) - answer) + [1.0] * answer)
        return lm_batch(tokens, trained)
