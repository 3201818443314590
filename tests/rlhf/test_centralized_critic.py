"""The centralized critic equals a local critic (an MLP and the GPT CriticModel), and with prefetch it runs while the
training step runs."""

import time

import pytest
import torch
import torch.distributed as dist

from megalite.rlhf import CriticModel
from megalite.rlhf.centralized_critic import CentralizedModel, Prefetcher
from megalite.testing import run_distributed
from tests.rlhf.common import config, padded_prompts

CRITIC_SECONDS = 1.0


def _critic():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _serve(critic, slow):
    def run(per_rank):
        if slow:
            time.sleep(CRITIC_SECONDS)
        sizes = [x.shape[0] for x in per_rank]
        with torch.no_grad():
            return list(critic(torch.cat(per_rank)).split(sizes))
    return run


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2 + rank, 4, generator=g) for _ in range(3)]


def _rank(owner, slow):
    rank = dist.get_rank()
    local = _critic()
    central = CentralizedModel(_serve(local, slow) if rank == owner else None, owner=owner)
    steps, received = [], []
    for batch, values in Prefetcher(central, _batches(rank), depth=1):
        start = time.monotonic()
        time.sleep(CRITIC_SECONDS if slow else 0.0)
        steps.append((start, time.monotonic()))
        received.append((batch, values))
    central.close()
    with torch.no_grad():
        for batch, values in received:
            torch.testing.assert_close(values, local(batch), rtol=0, atol=1e-6)
    return steps, central.intervals


@pytest.mark.parametrize("owner", [0, 1])
def test_centralized_values_equal_local(owner):
    results = run_distributed(_rank, 2, owner, False, timeout=120)
    assert len(results[owner][1]) == 3 and results[1 - owner][1] == []


def test_prefetch_overlaps_critic_with_training_step():
    steps, critic = run_distributed(_rank, 2, 0, True, timeout=120)[0]
    # Batch i+1's critic work was issued before step i and must run during it.
    for i in range(2):
        step_start, step_end = steps[i]
        critic_start, critic_end = critic[i + 1]
        assert critic_start < step_end and step_start < critic_end, (steps, critic)


def _serve_gpt_critic(critic):
    """One critic run on every rank's left-padded batch, concatenated; each rank gets its own rows back."""
    def run(per_rank):
        sizes = [ids.shape[0] for ids, _ in per_rank]
        with torch.no_grad():
            values = critic(torch.cat([ids for ids, _ in per_rank]), torch.cat([mask for _, mask in per_rank]))
        return list(values.split(sizes))
    return run


def _gpt_critic_rank(owner):
    rank = dist.get_rank()
    central = CentralizedModel(_serve_gpt_critic(CriticModel(config())) if rank == owner else None, owner=owner)
    assert (central.model_fn is None) == (rank != owner)
    ids, mask = padded_prompts(seed=20 + rank, b=2 + rank, p=6)
    values = central((ids, mask))
    central.close()
    with torch.no_grad():
        local = CriticModel(config())(ids, mask)
    assert values.shape == ids.shape
    torch.testing.assert_close(values, local, rtol=0, atol=1e-5)
    return len(central.intervals)


def test_centralized_gpt_critic_equals_local_critic_on_padded_batches():
    runs = run_distributed(_gpt_critic_rank, 3, 2, timeout=180)
    assert runs == [0, 0, 1]


def _bad_owner():
    CentralizedModel(None, owner=5)


def test_bad_owner_raises():
    with pytest.raises(AssertionError, match="owner rank 5 is outside the world of 2"):
        run_distributed(_bad_owner, 2, timeout=60)
