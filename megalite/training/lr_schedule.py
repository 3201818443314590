"""Megatron-LM's learning-rate and weight-decay schedule, counted in samples as its training loop counts them.

Megatron-LM builds its ``OptimizerParamScheduler`` with every length in samples
(``--lr-decay-iters`` becomes ``lr_decay_iters * global_batch_size``) and, after
each successful optimizer step, advances it by the samples of one global batch.
So iteration ``i`` (1-based, no skipped updates) runs at step
``(i - 1) * global_batch_size``: with warmup the first iteration uses
``--lr-warmup-init`` (0 by default), and the floor ``--min-lr`` is first used by
the iteration after ``--lr-decay-iters``.  :func:`schedule_settings` is that
conversion (with Megatron's checks on the flags), :class:`LRScheduler` the
schedule itself; both give the same value as Megatron for every step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass
class LRScheduleConfig:
    """The schedule's flags (fields are named after Megatron-LM's flags; ``lr``, ``min_lr`` and
    ``weight_decay`` live in :class:`megalite.optim.OptimizerConfig`).

    An iteration-based run (``--train-iters``) gives lengths in iterations (``*_iters``), a
    sample-based one (``--train-samples``) in samples (``*_samples``); ``lr_warmup_fraction``
    is a fraction of the decay length in either (when no warmup length is given).  ``None`` decay lengths mean the whole run.
    ``WSD`` (warmup-stable-decay) holds ``lr`` until the last ``lr_wsd_decay_*`` of the decay
    length, then anneals with ``lr_wsd_decay_style``.  Weight decay goes from
    ``start_weight_decay`` to ``end_weight_decay`` over the run (``constant``: ``weight_decay``
    throughout).  On resume the checkpoint's schedule must equal this one, unless
    ``override_opt_param_scheduler`` (keep this run's) or ``use_checkpoint_opt_param_scheduler``
    (take the checkpoint's).
    """

    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False


@dataclass(frozen=True)
class ScheduleSettings:
    """Everything the schedule computes from, every length in samples (Megatron's scheduler arguments)."""

    init_lr: float
    max_lr: float
    min_lr: float
    lr_warmup_steps: float
    lr_decay_steps: int
    lr_decay_style: str
    wsd_decay_steps: int | None
    lr_wsd_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _choice(value, choices, flag):
    _require(value in choices, f"{flag} {value!r} is not one of {', '.join(choices)}")


def _lengths(config: LRScheduleConfig, global_batch_size: int, train_iters, train_samples):
    """(decay, warmup, wsd decay, weight-decay increment) in samples, as Megatron-LM derives them.

    An iteration-based run takes the ``*_iters`` flags (times the global batch), a sample-based
    one the ``*_samples`` flags; the other unit's flags must stay unset.  Megatron rejects
    ``lr_warmup_fraction`` together with a warmup length; here the length wins, so a script's
    default fraction yields to a warmup given on its command line.
    """
    c = config
    by_samples = train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    for name in ("lr_decay", "lr_warmup", "lr_wsd_decay"):
        value, unset = getattr(c, f"{name}_{other}"), 0 if name == "lr_warmup" else None
        _require(value == unset, f"--{name.replace('_', '-')}-{other} {value} needs "
                                 f"{'iteration' if by_samples else 'sample'}-based training; with "
                                 f"--train-{unit} use --{name.replace('_', '-')}-{unit}")
    scale = 1 if by_samples else global_batch_size
    run = train_samples if by_samples else train_iters * global_batch_size
    warmup, decay, wsd = (getattr(c, f"{name}_{unit}") for name in ("lr_warmup", "lr_decay", "lr_wsd_decay"))
    decay = run if decay is None else decay * scale
    wsd = None if wsd is None else wsd * scale
    warmup = warmup * scale
    if c.lr_warmup_fraction is not None and warmup == 0:
        _require(0.0 <= c.lr_warmup_fraction < 1.0,
                 f"--lr-warmup-fraction must be at least 0 and below 1, got {c.lr_warmup_fraction}")
        warmup = c.lr_warmup_fraction * decay
    return decay, warmup, wsd, run


def schedule_settings(config: LRScheduleConfig, *, lr: float, min_lr: float, weight_decay: float,
                      global_batch_size: int, train_iters: int | None = None,
                      train_samples: int | None = None) -> ScheduleSettings:
    """Megatron-LM's scheduler arguments for a run of ``train_iters`` iterations, or of
    ``train_samples`` samples (sample-based, when given), of ``global_batch_size`` samples each.

    Raises ValueError, naming the flags, on settings Megatron rejects.
    """
    c = config
    _choice(c.lr_decay_style, DECAY_STYLES, "--lr-decay-style")
    _choice(c.lr_wsd_decay_style, WSD_DECAY_STYLES, "--lr-wsd-decay-style")
    _choice(c.weight_decay_incr_style, WD_INCR_STYLES, "--weight-decay-incr-style")
    decay, warmup, wsd, incr = _lengths(c, global_batch_size, train_iters, train_samples)
    unit = "iters" if train_samples is None else "samples"
    _require(decay > 0, f"the lr decay length must be positive, got {decay} samples")
    _require(0 <= warmup < decay, f"the lr warmup ({warmup} samples) must be shorter than the lr decay "
                                  f"({decay} samples)")
    if c.lr_decay_style == "WSD":
        _require(wsd is not None, f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}")
    _require(wsd is None or 0 <= wsd <= decay,
             f"the WSD anneal ({wsd} samples) must be between 0 and the lr decay length ({decay} samples)")
    _require(0.0 <= min_lr <= lr, f"--min-lr {min_lr} must be between 0 and --lr {lr}")
    _require(0.0 <= c.lr_warmup_init <= lr, f"--lr-warmup-init {c.lr_warmup_init} must be between 0 and --lr {lr}")
    if c.weight_decay_incr_style == "constant":
        _require(c.start_weight_decay is None and c.end_weight_decay is None,
                 "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine; "
                 "a constant weight decay is --weight-decay")
        start_wd = end_wd = weight_decay
    else:
        start_wd, end_wd = c.start_weight_decay, c.end_weight_decay
        _require(start_wd is not None and end_wd is not None,
                 f"--weight-decay-incr-style {c.weight_decay_incr_style} needs --start-weight-decay and "
                 f"--end-weight-decay")
        _require(0.0 <= start_wd <= end_wd,
                 f"--start-weight-decay {start_wd} must be between 0 and --end-weight-decay {end_wd}")
    _require(not (c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler),
             "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive; pass one")
    return ScheduleSettings(init_lr=c.lr_warmup_init, max_lr=float(lr), min_lr=min_lr, lr_warmup_steps=warmup,
                            lr_decay_steps=decay, lr_decay_style=c.lr_decay_style, wsd_decay_steps=wsd,
                            lr_wsd_decay_style=c.lr_wsd_decay_style, start_wd=start_wd, end_wd=end_wd,
                            wd_incr_steps=incr, wd_incr_style=c.weight_decay_incr_style)


def _wsd_coeff(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    return 1.0 - math.sqrt(ratio)


def lr_at(s: ScheduleSettings, step: float) -> float:
    """The learning rate after ``step`` samples."""
    if s.lr_warmup_steps > 0 and step <= s.lr_warmup_steps:
        return s.init_lr + (s.max_lr - s.init_lr) * float(step) / float(s.lr_warmup_steps)
    if s.lr_decay_style == "constant":
        return s.max_lr
    if step > s.lr_decay_steps:
        return s.min_lr
    if s.lr_decay_style == "inverse-square-root":
        return max(s.min_lr, s.max_lr * max(s.lr_warmup_steps, 1) ** 0.5 / (max(step, 1) ** 0.5))
    if s.lr_decay_style == "WSD":
        anneal_start = s.lr_decay_steps - s.wsd_decay_steps
        coeff = 1.0 if step <= anneal_start else _wsd_coeff(
            s.lr_wsd_decay_style, float(step - anneal_start) / float(s.wsd_decay_steps))
    else:
        ratio = float(step - s.lr_warmup_steps) / float(s.lr_decay_steps - s.lr_warmup_steps)
        coeff = 1.0 - ratio if s.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return s.min_lr + coeff * (s.max_lr - s.min_lr)


def weight_decay_at(s: ScheduleSettings, step: float) -> float:
    """The weight decay after ``step`` samples (before a param group's ``wd_mult``)."""
    if step > s.wd_incr_steps or s.wd_incr_style == "constant":
        return s.end_wd
    ratio = float(step) / float(s.wd_incr_steps)
    coeff = ratio if s.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return s.start_wd + coeff * (s.end_wd - s.start_wd)


class LRScheduler:
    """Sets every param group's ``lr`` and ``weight_decay`` for the next optimizer step.

    A group's weight decay is the schedule's times its ``wd_mult`` (default 1; the optimizer's
    no-decay group has 0).  ``step(increment)`` advances by ``increment`` samples (one global
    batch per applied update); ``state_dict`` holds the samples so far and the settings.
    """

    def __init__(self, optimizer, settings: ScheduleSettings, *, override_opt_param_scheduler: bool = False,
                 use_checkpoint_opt_param_scheduler: bool = False):
        self.optimizer = optimizer
        self.settings = settings
        self.override = override_opt_param_scheduler
        self.use_checkpoint = use_checkpoint_opt_param_scheduler
        self.num_steps = 0
        self._apply()

    def get_lr(self) -> float:
        """Learning rate of the next optimizer step."""
        return lr_at(self.settings, self.num_steps)

    def get_wd(self) -> float:
        """Weight decay of the next optimizer step, before ``wd_mult``."""
        return weight_decay_at(self.settings, self.num_steps)

    def _apply(self) -> None:
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples (Megatron-LM: the global batch size, after an applied update)."""
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **dataclasses.asdict(self.settings)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step; the saved settings must equal these (Megatron-LM's default check)
        unless this scheduler overrides them or takes the checkpoint's."""
        names = [f.name for f in dataclasses.fields(ScheduleSettings)]
        _require(all(k in state for k in names), "the checkpoint's LR schedule state lacks its settings (it "
                                                 "predates sample-counted schedules), so it cannot be resumed exactly")
        saved = {k: state[k] for k in names}
        if self.use_checkpoint:
            self.settings = ScheduleSettings(**saved)
        elif not self.override:
            current = dataclasses.asdict(self.settings)
            differ = [f"{k} is {saved[k]!r} in the checkpoint but {current[k]!r} in this run"
                      for k in current if saved[k] != current[k]]
            _require(not differ, "the checkpoint's LR schedule differs (pass --override-opt-param-scheduler "
                                 "to keep this run's or --use-checkpoint-opt-param-scheduler to take the "
                                 "checkpoint's): " + "; ".join(differ))
        self.num_steps = state["num_steps"]
        self._apply()
