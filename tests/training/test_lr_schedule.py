"""The LR and weight-decay schedule equals Megatron-Core's OptimizerParamScheduler, driven as Megatron-LM's
training loop drives it, at every iteration; a resumed schedule continues exactly."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from megalite.distributed import DistributedDataParallel
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.training.lr_schedule import LRScheduleConfig, LRScheduler, schedule_settings
from tests.distributed.models import mlp

LR, MIN_LR, WD, GBS = 3e-3, 3e-4, 0.01, 8


def _optimizer():
    """Two groups, as Megatron's: decayed (wd_mult 1) and not decayed (wd_mult 0)."""
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "wd_mult": 1.0},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "wd_mult": 0.0}], lr=0.0)


def _megatron_flags(train_iters=None, train_samples=None, **flags):
    """Megatron-LM's flag namespace after its validate_args, for the scheduler's flags."""
    args = SimpleNamespace(**dataclasses.asdict(LRScheduleConfig()), lr=LR, min_lr=MIN_LR, weight_decay=WD,
                           global_batch_size=GBS, train_iters=train_iters, train_samples=train_samples)
    vars(args).update(flags)
    if args.weight_decay_incr_style == "constant":
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    return args


def _megatron_scheduler(optimizer, args):
    """megatron/training/training.py's get_optimizer_param_scheduler: every length in samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if args.train_iters:
        decay_iters = args.train_iters if args.lr_decay_iters is None else args.lr_decay_iters
        decay = decay_iters * args.global_batch_size
        incr = args.train_iters * args.global_batch_size
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * args.global_batch_size
        warmup = args.lr_warmup_iters * args.global_batch_size
    else:
        decay = args.train_samples if args.lr_decay_samples is None else args.lr_decay_samples
        incr, wsd, warmup = args.train_samples, args.lr_wsd_decay_samples, args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=incr, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False, wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


def _megalite_scheduler(optimizer, train_iters=None, train_samples=None, **flags):
    settings = schedule_settings(LRScheduleConfig(**flags), lr=LR, min_lr=MIN_LR, weight_decay=WD,
                                 global_batch_size=GBS, train_iters=train_iters, train_samples=train_samples)
    return LRScheduler(optimizer, settings)


def _groups(optimizer):
    return [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]


def _megalite_run(iters, scheduler, optimizer):
    """(lr, weight decay) of each group at each iteration's optimizer step."""
    seen = []
    for _ in range(iters):
        seen.append(_groups(optimizer))
        scheduler.step(GBS)
    return seen


CASES = {
    "constant": dict(lr_decay_style="constant", lr_warmup_iters=3),
    "linear": dict(lr_decay_style="linear", lr_warmup_iters=3, lr_decay_iters=15),
    "cosine": dict(lr_decay_style="cosine", lr_warmup_iters=3, lr_decay_iters=15),
    "cosine-no-warmup": dict(lr_decay_style="cosine"),
    "inverse-square-root": dict(lr_decay_style="inverse-square-root", lr_warmup_iters=3, lr_decay_iters=15),
    "inverse-square-root-no-warmup": dict(lr_decay_style="inverse-square-root"),
    "warmup-init": dict(lr_decay_style="cosine", lr_warmup_iters=4, lr_warmup_init=1e-4),
    "warmup-fraction": dict(lr_decay_style="linear", lr_warmup_fraction=0.15),
    "wd-linear": dict(lr_decay_style="cosine", lr_warmup_iters=2, weight_decay_incr_style="linear",
                      start_weight_decay=0.01, end_weight_decay=0.1),
    "wd-cosine": dict(lr_decay_style="linear", weight_decay_incr_style="cosine", start_weight_decay=0.0,
                      end_weight_decay=0.05),
    **{f"wsd-{style}": dict(lr_decay_style="WSD", lr_wsd_decay_style=style, lr_warmup_iters=2, lr_decay_iters=16,
                            lr_wsd_decay_iters=6) for style in ("exponential", "linear", "cosine", "minus_sqrt")},
    "samples-cosine": dict(train_samples=150, lr_decay_style="cosine", lr_warmup_samples=20, lr_decay_samples=110),
    "samples-wsd": dict(train_samples=150, lr_decay_style="WSD", lr_wsd_decay_style="cosine", lr_warmup_samples=12,
                        lr_wsd_decay_samples=50, weight_decay_incr_style="linear", start_weight_decay=0.0,
                        end_weight_decay=0.1),
    "samples-fraction": dict(train_samples=150, lr_decay_style="inverse-square-root", lr_warmup_fraction=0.1),
}


@pytest.mark.parametrize("name", CASES)
def test_every_iteration_equals_megatron(name):
    """Megatron-LM steps its scheduler by the global batch after each applied update, so iteration i runs at
    step (i-1)*GBS; both sides compute in the same float order, so the values are equal, not close."""
    pytest.importorskip("megatron.core.optimizer_param_scheduler")
    flags = dict(CASES[name])
    samples = flags.pop("train_samples", None)
    iters = 20 if samples is None else samples // GBS
    lengths = dict(train_iters=None, train_samples=samples) if samples else dict(train_iters=iters)
    megatron_opt = _optimizer()
    megatron = _megatron_scheduler(megatron_opt, _megatron_flags(**lengths, **flags))
    expected = []
    for _ in range(iters):
        expected.append(_groups(megatron_opt))
        megatron.step(increment=GBS)
    optimizer = _optimizer()
    assert _megalite_run(iters, _megalite_scheduler(optimizer, **lengths, **flags), optimizer) == expected
    lrs = [groups[0][0] for groups in expected]
    assert len(set(lrs)) > 2 and all(groups[1][1] == 0.0 for groups in expected)


def test_first_iteration_runs_at_the_warmup_start_and_the_floor_follows_the_decay():
    optimizer = _optimizer()
    lrs = [lr for (lr, _), _ in _megalite_run(12, _megalite_scheduler(optimizer, train_iters=12, lr_warmup_iters=2,
                                                                      lr_decay_iters=10), optimizer)]
    assert lrs[0] == 0.0 and lrs[2] == LR
    assert lrs[9] > MIN_LR and lrs[10] == lrs[11] == MIN_LR


def _resumable(**flags):
    optimizer = _optimizer()
    return optimizer, _megalite_scheduler(optimizer, train_iters=20, **flags)


@pytest.mark.parametrize("name", ["cosine", "warmup-fraction", "wsd-minus_sqrt", "wd-linear"])
def test_resume_continues_exactly(name):
    full = _megalite_run(20, *reversed(_resumable(**CASES[name])))
    optimizer, first = _resumable(**CASES[name])
    head = _megalite_run(10, first, optimizer)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["num_steps"] == 10 * GBS
    optimizer, second = _resumable(**CASES[name])
    second.load_state_dict(state)
    assert head + _megalite_run(10, second, optimizer) == full


def test_resume_with_other_settings_needs_a_choice():
    _, saved = _resumable(lr_decay_style="cosine", lr_warmup_iters=3)
    saved.step(5 * GBS)
    state = saved.state_dict()
    optimizer, other = _resumable(lr_decay_style="linear", lr_warmup_iters=3)
    with pytest.raises(ValueError, match="lr_decay_style is 'cosine' in the checkpoint but 'linear' in this run"):
        other.load_state_dict(state)
    settings = other.settings
    kept = LRScheduler(optimizer, settings, override_opt_param_scheduler=True)
    kept.load_state_dict(state)
    assert kept.settings == settings and kept.num_steps == 5 * GBS
    taken = LRScheduler(optimizer, settings, use_checkpoint_opt_param_scheduler=True)
    taken.load_state_dict(state)
    assert taken.settings == saved.settings and _groups(optimizer) == _groups(saved.optimizer)
    with pytest.raises(ValueError, match="lacks its settings"):
        kept.load_state_dict({"num_steps": 5})


def test_scheduled_weight_decay_reaches_decayed_params_only():
    """get_optimizer's no-decay group (biases, norms) has wd_mult 0; the decayed group gets the schedule's value."""
    model = mlp()
    optimizer = get_optimizer(OptimizerConfig(lr=LR, weight_decay=WD), [DistributedDataParallel(model)])
    scheduler = _megalite_scheduler(optimizer, train_iters=4, lr_decay_style="constant", lr_warmup_iters=0,
                                    weight_decay_incr_style="linear", start_weight_decay=0.1, end_weight_decay=0.3)
    scheduler.step(2 * GBS)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1 + 0.5 * (0.3 - 0.1), 0.0]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert optimizer.step()[0]
    for name, param in model.named_parameters():
        shrink = 1.0 if param.ndim == 1 else 1.0 - LR * 0.2
        torch.testing.assert_close(param, before[name] * shrink, rtol=1e-6, atol=0)


@pytest.mark.parametrize("flags, lengths, message", [
    (dict(lr_decay_style="step"), {}, "--lr-decay-style 'step' is not one of constant, linear, cosine"),
    (dict(lr_warmup_iters=20), {}, r"the lr warmup \(160 samples\) must be shorter than the lr decay \(160 samples\)"),
    (dict(lr_decay_samples=100), {}, "--lr-decay-samples 100 needs sample-based training"),
    (dict(lr_warmup_iters=2), dict(train_iters=None, train_samples=160), "--lr-warmup-iters 2 needs iteration-based"),
    (dict(lr_decay_style="WSD"), {}, "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (dict(lr_warmup_init=1.0), {}, f"--lr-warmup-init 1.0 must be between 0 and --lr {LR}"),
    (dict(start_weight_decay=0.1), {}, "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style"),
    (dict(weight_decay_incr_style="linear", start_weight_decay=0.1), {}, "needs --start-weight-decay and "
                                                                         "--end-weight-decay"),
    (dict(weight_decay_incr_style="linear", start_weight_decay=0.2, end_weight_decay=0.1), {},
     "--start-weight-decay 0.2 must be between 0 and --end-weight-decay 0.1"),
    (dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True), {}, "are exclusive"),
])
def test_bad_settings(flags, lengths, message):
    with pytest.raises(ValueError, match=message):
        _megalite_scheduler(_optimizer(), **(dict(train_iters=20) | lengths), **flags)


def test_trainer_logs_megatrons_lr_at_every_iteration(tiny_data, tmp_path):
    """pretrain() steps the schedule as Megatron-LM's loop does: the logged lr (the one each update used)
    equals the Megatron scheduler's at that iteration."""
    pytest.importorskip("megatron.core.optimizer_param_scheduler")
    from tests.training.helpers import train

    flags = dict(lr_decay_style="WSD", lr_wsd_decay_style="cosine", lr_wsd_decay_iters=3, lr_warmup_iters=2,
                 lr_warmup_init=1e-4)
    argv = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    _, records = train(tiny_data, tmp_path, 1, *argv, iters=7)
    optimizer = _optimizer()
    megatron = _megatron_scheduler(optimizer, _megatron_flags(train_iters=7, lr=5e-3, min_lr=5e-4, **flags))
    expected = []
    for _ in range(7):
        expected.append(optimizer.param_groups[0]["lr"])
        megatron.step(increment=GBS)
    assert [r["lr"] for r in records] == expected
