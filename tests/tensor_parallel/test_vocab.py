import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalite import topology
from megalite.tensor_parallel import (VocabParallelEmbedding, pad_vocab_size, vocab_parallel_cross_entropy,
                                      vocab_parallel_entropy, vocab_parallel_log_probs)
from megalite.testing import run_distributed
from megalite.topology import device

from ._util import assert_all_small, block, master, max_err

V, H, S, B = 16, 8, 4, 3


def _embedding_case(group, reduce_scatter, errors):
    tp, r = topology.group_size(group), topology.group_rank(group)
    torch.manual_seed(5)
    emb = VocabParallelEmbedding(V, H, tp_group=group, reduce_scatter_embeddings=reduce_scatter, device=device())
    ref = nn.Embedding(V, H)
    with torch.no_grad():
        ref.weight.copy_(master((V, H), 5))
    ids = torch.randint(0, V, (S, B))
    ids[0, 0], ids[-1, -1] = 0, V - 1
    dy = torch.randn(S, B, H)
    y_ref = ref(ids)
    y_ref.backward(dy)
    y = emb(ids.to(device()))
    want, dy_local = (block(y_ref, 0, r, tp), block(dy, 0, r, tp)) if reduce_scatter else (y_ref, dy)
    y.backward(dy_local.to(device()))
    name = f"embedding reduce_scatter={reduce_scatter}"
    errors[name + " out"] = max_err(y, want)
    errors[name + " dw"] = max_err(emb.weight.grad, block(ref.weight.grad, 0, r, tp))
    errors[name + " range"] = float((emb.vocab_start_index, emb.vocab_end_index) != (r * V // tp, (r + 1) * V // tp))


def _loss_cases(group, errors):
    tp, r = topology.group_size(group), topology.group_rank(group)
    logits = torch.randn(S, B, V) * 3
    target = torch.randint(0, V, (S, B))
    target[0, 0], target[-1, -1] = 0, V - 1
    dy = torch.randn(S, B)

    def run(name, fn, ref_fn, dtype=torch.float32):
        full = logits.to(dtype).float().detach().clone().requires_grad_()
        want = ref_fn(full)
        want.backward(dy)
        shard = block(logits.to(dtype), -1, r, tp).clone().to(device()).requires_grad_()
        got = fn(shard)
        got.backward(dy.to(device()))
        errors[name + " dtype"] = float(got.dtype != torch.float32 or shard.grad.dtype != dtype)
        errors[name + " out"] = max_err(got, want)
        want_grad = block(full.grad, -1, r, tp)
        if dtype == torch.float32:
            errors[name + " grad"] = max_err(shard.grad, want_grad)
        else:
            # The gradient is rounded to the logits dtype once: within one bf16 rounding of fp32.
            bound = 2 ** -8 * want_grad.abs().max().item()
            errors[name + " grad"] = float(not max_err(shard.grad.float(), want_grad) <= bound)

    for smoothing in (0.0, 0.1):
        run(f"ce smoothing={smoothing}",
            lambda x: vocab_parallel_cross_entropy(x, target.to(device()), smoothing, tp_group=group),
            lambda x: F.cross_entropy(x.reshape(-1, V), target.reshape(-1), reduction="none",
                                      label_smoothing=smoothing).view(S, B))
    run("log_probs", lambda x: vocab_parallel_log_probs(x, target.to(device()), tp_group=group),
        lambda x: F.log_softmax(x, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1))
    run("entropy", lambda x: vocab_parallel_entropy(x, tp_group=group),
        lambda x: -(F.softmax(x, -1) * F.log_softmax(x, -1)).sum(-1))
    run("ce bf16", lambda x: vocab_parallel_cross_entropy(x, target.to(device()), tp_group=group),
        lambda x: F.cross_entropy(x.reshape(-1, V), target.reshape(-1), reduction="none").view(S, B),
        dtype=torch.bfloat16)


def _vocab_parity(tp):
    topology.initialize(tp=tp)
    group = topology.current().tp.group
    errors = {}
    _embedding_case(group, False, errors)
    _embedding_case(group, True, errors)
    _loss_cases(group, errors)
    return errors


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parity(tp):
    assert_all_small(run_distributed(_vocab_parity, tp, tp, timeout=180), 2 * 3 + 5 * 3)


def test_entropy_ignores_masked_logits():
    logits = torch.randn(3, 8, requires_grad=True)
    masked = logits.masked_fill(torch.arange(8) >= 6, float("-inf"))
    got = vocab_parallel_entropy(masked)
    got.sum().backward()
    grad, logits.grad = logits.grad.clone(), None
    want = torch.distributions.Categorical(logits=logits[:, :6]).entropy()
    want.sum().backward()
    assert max_err(got, want) <= 1e-6
    assert max_err(grad[:, :6], logits.grad[:, :6]) <= 1e-6
    assert torch.equal(grad[:, 6:], torch.zeros(3, 2))


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 8) == 51200
    assert pad_vocab_size(1024, 128, 8) == 1024
    assert pad_vocab_size(10, 1, 4) == 12
