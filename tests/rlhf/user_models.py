"""A plain torch language model (no megalite layers) and factories the TrainingService workers import by name."""

import torch
import torch.distributed as dist
from torch import nn

VOCAB, HIDDEN = 40, 32


class TinyLM(nn.Module):
    """Embeddings, two residual MLP blocks mixing each token with its predecessor (causal), a norm and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2 * HIDDEN, HIDDEN), nn.GELU()) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
            x = x + block(torch.cat([x, previous], dim=-1))
        return self.head(self.norm(x))


def tiny_lm() -> nn.Module:
    return TinyLM()


def fails_on_worker_1() -> nn.Module:
    """The model, except on worker 1, where (say) its weights file is missing."""
    if dist.get_rank() == 1:
        raise FileNotFoundError("weights.pt is not on this machine")
    return TinyLM()
