"""Scoring rollouts: the reward function on this rank, DAPO's overlong shaping, and the function a scoring server
runs for every rank (the reward, then the teacher's outputs), which decodes token tensors into text itself.

``REWARD_MODEL`` and ``TEACHER`` are these models' names in the placement plan.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from megalite.rlhf.arithmetic import TOKENIZER, response_text
from megalite.rlhf.reward_model import RewardModelScorer
from megalite.rlhf.rewards import overlong_penalty

REWARD_MODEL, TEACHER = "reward model", "teacher"


def reward_function(args, build: bool, single_group, device):
    """The ``(prompt, response) -> float`` reward on this rank (None where ``build`` is False).

    A reward model runs unsharded, in ``single_group`` (a one-rank group).
    """
    if not build:
        return None
    if not args.reward_model:
        return args.reward
    return RewardModelScorer(args.reward_model, TOKENIZER.tokenize, TOKENIZER.eod, TOKENIZER.vocab_size,
                             single_group, device)


def score_batches(reward, per_rank: list) -> list:
    """Scores every rank's (prompts, responses)."""
    return [torch.tensor([reward(p, r) for p, r in zip(prompts, responses)], dtype=torch.float32)
            for prompts, responses in per_rank]


def served_scores(reward, teacher, width: int, placement):
    """The owner's function for every rank's rollouts ``ids``/``attention mask`` ``[N, P + n]``: reward scores
    ``[N]`` (the text is decoded here, so only token tensors travel), then the teacher's outputs, if any.
    It runs on the owner's serving thread, so the reward model and teacher move in per request
    (``placement.using``)."""
    def run(ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        prompts = [TOKENIZER.detokenize(row) for row in ids[:, :width].tolist()]
        responses = [response_text([t for t, m in zip(row, keep) if m])
                     for row, keep in zip(ids[:, width:].tolist(), mask[:, width:].tolist())]
        with placement.using(REWARD_MODEL) if isinstance(reward, RewardModelScorer) else nullcontext():
            scores = score_batches(reward, [(prompts, responses)])[0].to(ids.device)
        if teacher is None:
            return (scores,)
        with placement.using(TEACHER):
            return (scores,) + teacher(ids, mask)
    return run


def shaped_scores(scores: torch.Tensor, response_mask: torch.Tensor, args) -> torch.Tensor:
    """The reward plus DAPO's overlong penalty (when ``--overlong-buffer-len`` > 0)."""
    if not args.overlong_buffer_len:
        return scores
    lengths = response_mask.sum(dim=1)
    return scores + overlong_penalty(lengths, args.max_new_tokens, args.overlong_buffer_len,
                                     args.overlong_penalty_factor).to(scores.device)
