"""One unwrap for every wrapper: DDP, FSDP-style and nested `.module` holders all peel to the model."""

import torch
from torch import nn

from megalite.distributed import DistributedDataParallel, unwrap
from megalite.models import GPTConfig, GPTModel


class _Holder(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_unwrap_peels_every_wrapper_and_keeps_a_bare_model():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
                               max_position_embeddings=8))
    assert unwrap(model) is model
    assert unwrap(DistributedDataParallel(model)) is model
    assert unwrap(_Holder(_Holder(model))) is model
    plain = nn.Linear(2, 2)
    assert unwrap(plain) is plain
