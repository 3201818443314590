"""The one rule for which model-parallel copy of a parameter counts (norms, checkpoint writers, counts)."""

import contextlib
import io

import torch
from torch import nn

from megalite.optim.replicas import counts_on_this_rank
from megalite.testing import run_distributed


def _param(**attributes):
    param = nn.Parameter(torch.zeros(2))
    for key, value in attributes.items():
        setattr(param, key, value)
    return param


def test_each_family_of_copies_counts_once():
    replicated, split = _param(), _param(tensor_model_parallel=True)
    expert_replicated = _param(expert_parallel=True)
    expert_split = _param(expert_parallel=True, tensor_model_parallel=True)
    shared = _param(shared_embedding=True, tensor_model_parallel=True)
    # (tp_rank, expert_tp_rank, pp_rank) -> which of the five count there.
    table = {
        (0, 0, 0): [True, True, True, True, True],
        (1, 0, 0): [False, True, True, True, True],
        (0, 1, 0): [True, True, False, True, True],
        (1, 1, 1): [False, True, False, True, False],
    }
    for ranks, want in table.items():
        got = [counts_on_this_rank(p, *ranks) for p in (replicated, split, expert_replicated, expert_split, shared)]
        assert got == want, ranks


def _parameter_count_line(argv):
    from megalite.training import gpt, pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, argv=argv)
    return [line for line in out.getvalue().splitlines() if line.startswith("model: ")]


TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--eval-iters", "0",
        "--mock-data", "--vocab-size", "64"]


def test_trainer_counts_context_parallel_copies_once():
    """cp ranks hold identical weights: a cp2 job prints the single-rank count (it printed twice that)."""
    (single,) = run_distributed(_parameter_count_line, 1, TINY, timeout=240)
    assert single == ["model: 5,616 parameters"]
    cp2 = run_distributed(_parameter_count_line, 2, TINY + ["--context-parallel-size", "2"], timeout=240)
    assert cp2 == [single, []]
