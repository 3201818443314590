"""Shared pieces of the training tests: a tiny run's flags and the rank function that runs pretrain()."""

import json
import os
import signal

from megalite.testing import run_distributed

VOCAB = 64


def tiny_argv(data_prefix, workdir, *extra):
    """Flags of a tiny fp32, dropout-free GPT run that logs every iteration to workdir/metrics.jsonl."""
    return ["--data-path", data_prefix, "--vocab-size", str(VOCAB), "--split", "90,10,0",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "5e-3", "--lr-warmup-iters", "2",
            "--lr-decay-style", "cosine", "--min-lr", "5e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "8", "--log-interval", "1", "--eval-interval", "0",
            "--metrics-file", str(workdir / "metrics.jsonl"), *extra]


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def pretrain_on_rank(argv, sigterm_in_iteration=None):
    from megalite.training import gpt, pretrain

    forward_step = gpt.forward_step
    if sigterm_in_iteration is not None:
        forward_step = _SigtermDuring(sigterm_in_iteration, argv)
    return pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, forward_step, argv=argv)


class _SigtermDuring:
    """A GPT forward step that sends SIGTERM to rank 0 during a given iteration."""

    def __init__(self, iteration, argv):
        self.iteration = iteration
        self.micro = int(argv[argv.index("--micro-batch-size") + 1])
        self.global_batch = int(argv[argv.index("--global-batch-size") + 1])
        self.calls = 0

    def __call__(self, data_iterator, model):
        import torch.distributed as dist
        from megalite import topology
        from megalite.training import gpt

        per_iteration = self.global_batch // (self.micro * topology.current().dp.size)
        self.calls += 1
        if self.calls == (self.iteration - 1) * per_iteration + 1 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return gpt.forward_step(data_iterator, model)


def train(data, workdir, world_size, *extra, iters=20, sigterm_in_iteration=None, timeout=180, backend="gloo"):
    """Run pretrain() on ``world_size`` ranks; return (rank 0's last iteration, the logged metrics records).

    gloo by default, so a one-rank reference and a multi-rank run share the CPU even on a machine with one GPU.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    argv = tiny_argv(data, workdir, "--train-iters", str(iters), *extra)
    results = run_distributed(pretrain_on_rank, world_size, argv, sigterm_in_iteration, timeout=timeout,
                              backend=backend)
    return results[0], read_metrics(workdir / "metrics.jsonl")
