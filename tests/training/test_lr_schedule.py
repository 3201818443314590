import math

import pytest
import torch

from megalite.training.lr_schedule import LRScheduler


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def _run(style, iters=10, warmup=2, decay=8, max_lr=1.0, min_lr=0.1):
    opt = _optimizer()
    sched = LRScheduler(opt, max_lr, min_lr, warmup, decay, style)
    lrs = []
    for _ in range(iters):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    return lrs


def test_warmup_then_cosine_to_floor():
    lrs = _run("cosine")
    assert lrs[:2] == [0.5, 1.0]
    for i in range(3, 9):
        ratio = (i - 2) / 6
        assert lrs[i - 1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ratio)))
    assert lrs[7:] == [pytest.approx(0.1)] * 3


def test_linear_and_constant():
    lrs = _run("linear")
    assert lrs[2] == pytest.approx(1.0 - 0.9 / 6) and lrs[7] == pytest.approx(0.1)
    assert _run("constant")[2:] == [1.0] * 8


def test_state_dict_resumes_the_schedule():
    full = _run("cosine")
    opt = _optimizer()
    sched = LRScheduler(opt, 1.0, 0.1, 2, 8, "cosine")
    for _ in range(4):
        sched.step()
    resumed_opt = _optimizer()
    resumed = LRScheduler(resumed_opt, 1.0, 0.1, 2, 8, "cosine")
    resumed.load_state_dict(sched.state_dict())
    assert resumed_opt.param_groups[0]["lr"] == full[4]


@pytest.mark.parametrize("kwargs, message", [
    (dict(decay_style="exp"), "lr decay style 'exp' is not one of constant, linear, cosine"),
    (dict(warmup_iters=9), "warmup iterations 9 must be between 0 and decay iterations 8"),
    (dict(min_lr=2.0), "min lr 2.0 must be between 0 and max lr 1.0"),
])
def test_bad_settings(kwargs, message):
    settings = dict(max_lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=8, decay_style="cosine") | kwargs
    with pytest.raises(ValueError, match=message):
        LRScheduler(_optimizer(), **settings)
