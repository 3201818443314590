"""--rampup-batch-size gives Megatron-Core's batch size at every iteration, and the trainer runs those batches.

The peer is megatron.core.num_microbatches_calculator's RampupBatchsizeNumMicroBatchesCalculator, driven as
Megatron-LM's training loop drives it (core_v0.16.1 megatron/training/training.py: ``update_num_microbatches``
with the consumed samples before each iteration, ``consumed_train_samples`` and the scheduler advanced by
``num_microbatches * micro_batch_size * dp`` after it, ``update_train_iters`` walking the ramp).
"""

import contextlib
import io

import pytest

from megalite.data.sampler import MicroBatchSampler
from megalite.testing import run_distributed
from megalite.training.arguments import validate_args
from megalite.training.batch_ramp import BatchSizeRamp
from megalite.training.flags import parse_args
from tests.training.helpers import read_metrics

# (start, increment, ramp samples, global batch, micro batch, dp)
RAMPS = [(16, 16, 5859375 // 10000, 1536, 1, 16), (2, 2, 8, 6, 1, 2), (4, 4, 100, 32, 2, 2), (3, 3, 7, 12, 3, 1),
         (8, 8, 1000, 64, 4, 2)]


def _megatron_calculator(start, increment, samples, global_batch, micro, dp):
    calculator = pytest.importorskip("megatron.core.num_microbatches_calculator")
    return calculator.RampupBatchsizeNumMicroBatchesCalculator(global_batch, micro, dp, False, 1, start, increment,
                                                              samples)


def _megatron_train_iters(calculator, ramp_samples, global_batch, train_samples):
    """Megatron-LM's update_train_iters for a sample-based run with a ramp, on the calculator."""
    iterations, consumed = 0, 0
    while consumed <= ramp_samples and consumed <= train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    calculator.update(0, consistency_check=False)
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch
    return iterations


@pytest.mark.parametrize("start,increment,samples,global_batch,micro,dp", RAMPS)
def test_each_iteration_equals_megatron_calculator(start, increment, samples, global_batch, micro, dp):
    calculator = _megatron_calculator(start, increment, samples, global_batch, micro, dp)
    ramp = BatchSizeRamp(start, increment, samples, global_batch)
    consumed, seen = 0, set()
    while consumed <= 2 * samples:
        calculator.update(consumed, consistency_check=True)
        batch = ramp.batch_size(consumed)
        assert batch == calculator.get_current_global_batch_size(), consumed
        assert batch // (micro * dp) == calculator.get(), consumed
        seen.add(batch)
        consumed += batch
    assert seen <= set(ramp.batch_sizes()) and {start, global_batch} <= seen
    for probe in range(0, 2 * samples + 3):  # every consumed count, not only those the loop reaches
        calculator.update(probe, consistency_check=False)
        assert ramp.batch_size(probe) == calculator.get_current_global_batch_size(), probe
    for train_samples in (start, samples // 2 + 1, samples, samples + 1, 3 * samples + global_batch + 1):
        expected = _megatron_train_iters(calculator, samples, global_batch, train_samples)
        assert ramp.train_iters(train_samples) == expected, train_samples


def test_sampler_follows_the_ramp_on_every_dp_rank():
    ramp = BatchSizeRamp(2, 2, 8, 6)
    sizes, consumed = [], 0
    while consumed + ramp.batch_size(consumed) <= 30:
        sizes.append(ramp.batch_size(consumed))
        consumed += sizes[-1]
    assert sizes == [2, 2, 4, 6, 6, 6]
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    for resume_at in (0, 3):
        per_rank = [list(MicroBatchSampler(30, starts[resume_at], 1, 6, r, 2, batch_size_at=ramp.batch_size))
                    for r in range(2)]
        assert len(MicroBatchSampler(30, starts[resume_at], 1, 6, 0, 2, batch_size_at=ramp.batch_size)) == \
            len(per_rank[0]) == sum(sizes[resume_at:]) // 2
        position = 0
        for start, size in zip(starts[resume_at:], sizes[resume_at:]):
            steps = size // 2  # micro-batches of one sample on each of two ranks
            union = [i for r in range(2) for batch in per_rank[r][position:position + steps] for i in batch]
            assert union == list(range(start, start + size))
            position += steps


@pytest.mark.parametrize("extra,message", [
    (["--train-iters", "10"], "--rampup-batch-size needs sample-based training (--train-samples), as in Megatron-LM"),
    (["--train-samples", "40", "--micro-batch-size", "2", "--global-batch-size", "8"],
     "--rampup-batch-size 2 2 8: every global batch of the ramp must be divisible by micro batch size 2 * "
     "data-parallel size 2 = 4"),
    (["--train-samples", "40", "--global-batch-size", "2"],
     "--rampup-batch-size 2 2 8: the start batch size must be below --global-batch-size 2"),
    (["--train-samples", "40", "--rampup-batch-size", "2", "4", "8", "--global-batch-size", "8"],
     "--rampup-batch-size 2 4 8: --global-batch-size 8 minus the start batch size (6) is not divisible by the "
     "increment"),
    (["--train-samples", "40", "--rampup-batch-size", "2", "2", "0"],
     "--rampup-batch-size 2 2 0: the start batch size, increment and ramp-up samples must be positive"),
])
def test_bad_ramps_name_the_problem(extra, message):
    argv = ["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "6", *extra]
    with pytest.raises(ValueError) as info:
        validate_args(parse_args(argv), world_size=2)
    assert str(info.value) == message


def _pretrain(argv):
    from megalite.training import gpt, pretrain

    calls = []

    def counting_forward_step(data_iterator, model):
        calls.append(1)
        return gpt.forward_step(data_iterator, model)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, counting_forward_step, argv=argv)
    return len(calls), out.getvalue()


@pytest.mark.slow
def test_trainer_runs_the_ramp(tmp_path):
    """Two DP ranks: each iteration's batch, consumed samples and LR equal Megatron-LM's; each rank runs
    batch / (micro batch * dp) micro-batches; a checkpoint is saved when the batch grows, and a run resumed
    from the mid-ramp one continues exactly."""
    from megalite.optim import OptimizerConfig

    megatron_scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    lr, min_lr, warmup, train_samples = 1e-3, 1e-4, 4, 30
    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--mock-data", "--vocab-size", "64", "--split", "100,0,0", "--micro-batch-size", "1",
            "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "8", "--train-samples", str(train_samples),
            "--lr", str(lr), "--min-lr", str(min_lr), "--lr-decay-style", "cosine", "--lr-warmup-samples",
            str(warmup), "--log-interval", "1", "--eval-interval", "0", "--save", str(tmp_path / "ckpt"),
            "--metrics-file", str(tmp_path / "metrics.jsonl")]
    (calls, out), (calls1, _) = run_distributed(_pretrain, 2, argv, timeout=180)
    records = read_metrics(tmp_path / "metrics.jsonl")

    calculator = _megatron_calculator(2, 2, 8, 6, 1, 2)
    assert len(records) == _megatron_train_iters(calculator, 8, 6, train_samples) == 6
    group = {"params": [], "lr": 0.0, "weight_decay": 0.0}
    scheduler = megatron_scheduler.OptimizerParamScheduler(
        _OneGroup(group), init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=train_samples, lr_decay_style="cosine", start_wd=OptimizerConfig.weight_decay,
        end_wd=OptimizerConfig.weight_decay, wd_incr_steps=train_samples, wd_incr_style="constant")
    consumed, expected = 0, []
    for iteration in range(1, 7):
        calculator.update(consumed, consistency_check=True)
        batch = calculator.get() * 1 * 2
        used_lr = group["lr"]
        scheduler.step(increment=batch)
        consumed += batch
        expected.append((iteration, batch, consumed, used_lr))
    got = [(r["iteration"], r["global_batch_size"], r["consumed_samples"], r["lr"]) for r in records]
    assert got == expected
    assert [b for _, b, _, _ in got] == [2, 2, 4, 6, 6, 6]
    assert calls == calls1 == sum(b for _, b, _, _ in got) // 2
    assert "ramping up batch size from 2 to 4" in out and "ramping up batch size from 4 to 6" in out
    saved = [line for line in out.splitlines() if line.startswith("saved checkpoint at iteration")]
    assert [line.split()[4] for line in saved] == ["2", "3", "6"]

    resumed_argv = [word for word in argv if word not in (str(tmp_path / "ckpt"), str(tmp_path / "metrics.jsonl"))]
    resumed_argv = [word for word in resumed_argv if word not in ("--save", "--metrics-file")] + [
        "--load", str(tmp_path / "ckpt" / "iter_0000002"), "--metrics-file", str(tmp_path / "resumed.jsonl")]
    run_distributed(_pretrain, 2, resumed_argv, timeout=180)
    resumed = read_metrics(tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in resumed] == [3, 4, 5, 6]
    for mine, full in zip(resumed, records[2:]):
        for key in ("global_batch_size", "consumed_samples", "lr", "loss", "grad_norm"):
            assert mine[key] == full[key], (mine["iteration"], key)


class _OneGroup:
    """The optimizer interface OptimizerParamScheduler reads: its param groups."""

    def __init__(self, group):
        self.param_groups = [group]
