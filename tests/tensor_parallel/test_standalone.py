"""Use in someone else's model: only megalite.tensor_parallel, megalite.topology, megalite.collectives and
megalite.batch_invariant (torch-only numerics the layers switch to under its mode), the user's own group."""

import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import megalite.tensor_parallel as tpl
from megalite.testing import run_distributed

V, H, S, B = 16, 8, 4, 2


class TinyLM(nn.Module):
    """A plain user model: embedding, one TP MLP, an untied vocab-parallel head."""

    def __init__(self, group):
        super().__init__()
        self.embed = tpl.VocabParallelEmbedding(V, H, tp_group=group)
        self.up = tpl.ColumnParallelLinear(H, 4 * H, tp_group=group)
        self.down = tpl.RowParallelLinear(4 * H, H, tp_group=group)
        self.head = tpl.ColumnParallelLinear(H, V, bias=False, tp_group=group)
        self.group = group

    def forward(self, ids, labels):
        x = self.embed(ids)
        x = x + self.down(F.gelu(self.up(x)))
        return tpl.vocab_parallel_cross_entropy(self.head(x), labels, tp_group=self.group).mean()


def _train(group, steps=2):
    torch.manual_seed(0)
    model = TinyLM(group)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids, labels = torch.randint(0, V, (S, B), generator=gen), torch.randint(0, V, (S, B), generator=gen)
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels)
        loss.backward()
        with torch.no_grad():  # plain SGD (torch.optim's first step pays a multi-second import)
            for param in model.parameters():
                param -= 0.5 * param.grad
        losses.append(loss.item())
    return model, losses


def _full(param, group):
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach().clone()
    parts = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _standalone():
    group = dist.group.WORLD
    model, losses = _train(group)
    ref_model, ref_losses = _train(None)
    ref = dict(ref_model.named_parameters())
    errors = {name: (_full(p, group) - ref[name].detach()).abs().max().item() for name, p in model.named_parameters()}
    errors.update({f"loss {i}": abs(a - b) for i, (a, b) in enumerate(zip(losses, ref_losses))})
    torch.manual_seed(0)
    initial = dict(TinyLM(None).named_parameters())
    moved = max((ref[name] - initial[name]).abs().max().item() for name in ref)
    errors["weights moved"] = float(not moved > 1e-3)
    return errors


def test_trains_two_steps_in_a_plain_module_like_one_process():
    for rank, errors in enumerate(run_distributed(_standalone, 4, timeout=180)):
        assert len(errors) == 6 + 2 + 1, errors
        assert all(v <= 1e-5 for v in errors.values()), (rank, errors)


def test_imports_only_topology_and_collectives_from_megalite():
    code = ("import sys, megalite.tensor_parallel; "
            "print(sorted(m for m in sys.modules if m.startswith('megalite')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    allowed = ("megalite", "megalite.topology", "megalite.collectives", "megalite.batch_invariant")
    assert all(m in allowed or m.startswith("megalite.tensor_parallel") for m in loaded), loaded
