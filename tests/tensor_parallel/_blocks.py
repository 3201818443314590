"""A TP MLP and a TP attention block, written once for any TP group, plus their plain versions."""

import torch
import torch.nn.functional as F
from torch import nn

from megalite import topology
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, divide, get_rng_tracker


class ParallelMLP(nn.Module):
    def __init__(self, h, group, sequence_parallel=False, dropout=0.0):
        super().__init__()
        self.fc1 = ColumnParallelLinear(h, 4 * h, tp_group=group, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(4 * h, h, tp_group=group, sequence_parallel=sequence_parallel,
                                     skip_bias_add=True)
        self.dropout = dropout

    def forward(self, x):
        hidden = F.gelu(self.fc1(x))
        with get_rng_tracker().fork():
            hidden = F.dropout(hidden, self.dropout, self.training)
        out, bias = self.fc2(hidden)
        return F.dropout(out + bias, self.dropout, self.training)


class PlainMLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def attention(q, k, v, heads, groups, dropout=0.0, training=False):
    """Causal attention on ``[s, b, heads*d]`` queries and ``[s, b, groups*d]`` keys/values."""
    s, b = q.shape[:2]
    q = q.view(s, b, heads, -1).permute(1, 2, 0, 3)
    k, v = (t.view(s, b, groups, -1).permute(1, 2, 0, 3).repeat_interleave(heads // groups, 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = F.dropout(scores.masked_fill(mask, float("-inf")).softmax(-1), dropout, training)
    return (probs @ v).permute(2, 0, 1, 3).reshape(s, b, -1)


class ParallelAttention(nn.Module):
    """Grouped-query attention with query heads and key/value groups split across TP ranks."""

    def __init__(self, h, heads, groups, group, sequence_parallel=False, dropout=0.0):
        super().__init__()
        tp = topology.group_size(group)
        self.heads, self.groups = divide(heads, tp, "num_heads"), divide(groups, tp, "num_query_groups")
        kv = h // heads * groups
        kw = dict(tp_group=group, sequence_parallel=sequence_parallel)
        self.q, self.k, self.v = ColumnParallelLinear(h, h, **kw), ColumnParallelLinear(h, kv, **kw), \
            ColumnParallelLinear(h, kv, **kw)
        self.o = RowParallelLinear(h, h, **kw)
        self.dropout = dropout

    def forward(self, x):
        with get_rng_tracker().fork():
            ctx = attention(self.q(x), self.k(x), self.v(x), self.heads, self.groups, self.dropout, self.training)
        return self.o(ctx)


class PlainAttention(nn.Module):
    def __init__(self, h, heads, groups):
        super().__init__()
        kv = h // heads * groups
        self.q, self.k, self.v, self.o = nn.Linear(h, h), nn.Linear(h, kv), nn.Linear(h, kv), nn.Linear(h, h)
        self.heads, self.groups = heads, groups

    def forward(self, x):
        return self.o(attention(self.q(x), self.k(x), self.v(x), self.heads, self.groups))


def load_plain(plain, seed):
    """Give ``plain``'s Linear layers the weights a parallel block built after ``manual_seed(seed)`` has."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for layer in plain.children():
            layer.weight.normal_(0.0, 0.02)
            layer.bias.zero_()
