"""A learned reward model: Bradley-Terry training on preference pairs, and scoring for RL.

The model is a :class:`CriticModel` (GPT + scalar head); a sequence's reward is
the head's output at its last real token.  Training batches interleave pairs
as rows ``[chosen_0, rejected_0, chosen_1, ...]`` so a pair never straddles
micro-batches; the loss ``-log sigmoid(r_chosen - r_rejected)`` is summed and
divided by the global number of pairs, so micro-batching and DP do not change it.
Preference data is JSON lines ``{"prompt", "chosen", "rejected"}``.
"""

from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F

from megalite.checkpoint import load_sharded
from megalite.checkpoint.reader import CheckpointReader
from megalite.data.synthetic import arithmetic_answer
from megalite.rlhf.critic import CriticModel


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``values [b, s]`` at each row's last position whose ``attention_mask`` is 1 (left or right padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * (attention_mask > 0)).argmax(dim=1)
    return values.gather(1, last[:, None]).squeeze(1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, normalizer: float) -> tuple[torch.Tensor, dict]:
    """``sum(-log sigmoid(chosen - rejected)) / normalizer`` and the pairs ordered correctly."""
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).sum() / normalizer
    return loss, {"bt_loss": loss.detach(), "accuracy": float((margin > 0).float().mean())}


class BradleyTerryObjective:
    """The :class:`TrainingBackend` objective of a reward model over interleaved pair rows."""

    mode = "token-mean"

    def normalizer_mask(self, batch: dict) -> torch.Tensor:
        """One 1 per pair, so the normalizer is the global number of pairs."""
        return torch.ones(batch["input_ids"].shape[0] // 2, device=batch["input_ids"].device)

    def forward(self, chunk, mb: dict) -> torch.Tensor:
        if mb["input_ids"].shape[0] % 2:
            raise ValueError(f"a reward-model micro-batch holds whole pairs, got {mb['input_ids'].shape[0]} rows")
        return chunk(mb["input_ids"], mb["attention_mask"])

    def loss(self, values, mb: dict, normalizer: float, chunk):
        scores = last_token_scores(values, mb["attention_mask"])
        return bradley_terry_loss(scores[0::2], scores[1::2], normalizer)


def read_preferences(path: str) -> list[dict]:
    """The pairs of a JSONL file; one ValueError naming the line for a malformed record."""
    pairs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None
            missing = [k for k in ("prompt", "chosen", "rejected") if not isinstance(record.get(k), str)]
            if missing:
                raise ValueError(f"{path}:{number}: record lacks string field(s) {missing}")
            pairs.append(record)
    if not pairs:
        raise ValueError(f"{path} holds no preference pairs")
    return pairs


def write_arithmetic_preferences(path: str, count: int, seed: int = 0, max_operand: int = 9) -> None:
    """A synthetic preference set: "a+b=" prompts, the right answer chosen over a wrong one."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            prompt = f"{rng.randint(0, max_operand)}+{rng.randint(0, max_operand)}="
            answer = int(arithmetic_answer(prompt))
            wrong = answer + rng.choice([d for d in range(-3, 4) if d and answer + d >= 0])
            f.write(json.dumps({"prompt": prompt, "chosen": str(answer), "rejected": str(wrong)}) + "\n")


def check_reward_model(path: str, vocab_size: int):
    """The GPTConfig of a reward-model checkpoint, after checking it matches the policy's ``vocab_size``."""
    config = CheckpointReader(path).config
    if config is None:
        raise ValueError(f"reward model checkpoint {path} stores no GPTConfig")
    if config.vocab_size != vocab_size:
        raise ValueError(f"reward model {path} has a vocabulary of {config.vocab_size} tokens, the policy's "
                         f"tokenizer {vocab_size}")
    return config


class RewardModelScorer:
    """``scorer(prompt, response) -> float`` from a reward-model checkpoint, as an unsharded model.

    ``tokenize`` maps text to ids and ``eod`` ends every response; the checkpoint's
    vocabulary must equal ``vocab_size`` (the tokenizer the policy uses).  Inside a
    parallel run pass a one-rank ``tp_group`` (e.g. from ``dist.new_subgroups(1)``),
    since the default is the current topology's TP group.
    """

    def __init__(self, path: str, tokenize, eod: int, vocab_size: int, tp_group=None, device="cpu"):
        config = check_reward_model(path, vocab_size)
        self.model = CriticModel(config, tp_group=tp_group).to(device)
        load_sharded(path, [self.model], tp_group=tp_group)
        self.model.eval()
        self.tokenize, self.eod, self.device = tokenize, eod, device

    @torch.no_grad()
    def __call__(self, prompt: str, response: str) -> float:
        ids = torch.tensor([self.tokenize(prompt + response) + [self.eod]], device=self.device)
        values = self.model(ids, torch.ones_like(ids))
        return float(values[0, -1])
