"""The RL trainer's built-in task: single-digit additions "a+b=" with a checkable answer, in byte tokens.

The trainer warms the actor up on "a+b=c<eod>" documents (:func:`pretrain_batch`) just long enough to learn
the format and some of the sums, then samples answers to :func:`problem` prompts and scores them with
``megalite.rlhf.rewards.arithmetic_reward`` (or any ``--reward-fn``).
"""

from __future__ import annotations

import random

import torch

from megalite.data.synthetic import arithmetic_answer
from megalite.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def problem(rng: random.Random, max_operand: int) -> str:
    """A prompt "a+b=" with 0 <= a, b <= ``max_operand``."""
    return f"{rng.randint(0, max_operand)}+{rng.randint(0, max_operand)}="


def prompt_width(max_operand: int) -> int:
    """Tokens of the longest prompt (every prompt is left-padded to it)."""
    return len(f"{max_operand}+{max_operand}=")


def response_text(response_ids: list[int]) -> str:
    """The response up to (without) end-of-document."""
    if TOKENIZER.eod in response_ids:
        response_ids = response_ids[:response_ids.index(TOKENIZER.eod)]
    return TOKENIZER.detokenize(response_ids)


def pretrain_batch(rng: random.Random, rows_per_rank: int, max_operand: int) -> dict:
    """Right-padded "a+b=c<eod>" sequences; the loss covers the answer and end-of-document."""
    rows, answer_starts = [], []
    for _ in range(rows_per_rank):
        prompt = problem(rng, max_operand)
        rows.append(TOKENIZER.tokenize(prompt + arithmetic_answer(prompt)) + [TOKENIZER.eod])
        answer_starts.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [TOKENIZER.pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.zeros(len(rows), width - 1)
    for i, (row, start) in enumerate(zip(rows, answer_starts)):
        loss_mask[i, start - 1:len(row) - 1] = 1
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
