"""Fixtures shared by every test package: the tiny indexed dataset the training-loop tests train on; the imports
run_distributed's fork server does once for every rank; how pytest-xdist shares the tests among its workers; the
check that a session leaves no process behind."""

import os
import sys
import uuid

import numpy as np
import pytest

from megalite import testing
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from tests import leftover_processes
from tests.training.helpers import VOCAB

# Inherited by every process this session's tests start (tests/leftover_processes.py).
SESSION = os.environ[leftover_processes.VARIABLE] = uuid.uuid4().hex

# What the multi-rank test modules import, imported once by run_distributed's fork server instead of by every rank
# of every run (transformers and its GPT-2 model, or Megatron-Core, take a rank over a second of CPU each).
testing.preload("pytest", "megalite.models", "megalite.moe", "megalite.pipeline", "megalite.training.gpt",
                "megalite.checkpoint.hf", "megalite.inference", "megalite.rlhf.trainer", "transformers",
                "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama", "megatron.core")

# The tests that must not overlap each other when pytest-xdist runs the suite on several workers (tools/test.sh's
# `-n 2 --dist loadscope`): node id prefixes, run on one worker, one after another (beside the other worker's tests).
SERIAL = (
    "tests/training/test_launch_faults.py::",  # torchrun faults with heartbeats and exits timed in seconds
    "tests/rlhf/test_service_ray.py::",  # Ray clusters
    "tests/rlhf/test_service_faults.py::",  # Ray clusters, a seconds bound; run_once scenarios the campaign replays
    "tests/faults/test_campaign.py::",  # the fault campaign, with the tests whose tests/run_once.py scenarios it shares
    "tests/rlhf/test_service.py::test_hung_worker_times_out",  # such a scenario: a 3 s timeout
    "tests/checkpoint/test_load_paths.py::test_the_trainer_resumes_from_an_iteration_directory",  # such a scenario
    "tests/pipeline/test_timeline.py::test_measured_bubble_fraction",  # measured sleeps
)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope`` a scope is a whole module (its module-scoped fixtures, a Megatron-Core run or a
    ForkedCommands batch, built once, on one worker) and the :data:`SERIAL` tests are one more, handed out first: the
    longest scope (minutes), it would otherwise leave the other worker idle at the end.  pytest-xdist's own
    ``loadgroup`` marks do not group under pytest 9 (its node ids are no longer strings it can suffix)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndSerial(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "serial" if nodeid.startswith(SERIAL) else nodeid.split("::")[0]

        def _assign_work_unit(self, node) -> None:
            if "serial" in self.workqueue:
                self.workqueue.move_to_end("serial", last=False)
            super()._assign_work_unit(node)

    return ModulesAndSerial(config, log)


def pytest_collection_modifyitems(items):
    """Each :data:`SERIAL` prefix names a test that exists (a renamed one would silently lose its place there),
    checked in each test module collected."""
    modules = {item.nodeid.split("::")[0]: item.module for item in items if getattr(item, "module", None)}
    missing = [prefix for prefix in SERIAL for path, _, name in [prefix.partition("::")]
               if path in modules and not any(attr.startswith(name) for attr in vars(modules[path]))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py's SERIAL names no test: {', '.join(missing)}")


def write_arithmetic_documents(prefix: str, count: int, seed: int, vocab: int, lengths: tuple[int, int],
                               eod: int | None = None) -> str:
    """An indexed dataset of ``count`` arithmetic sequences mod ``vocab`` (start, step and length drawn in that
    order from ``RandomState(seed)``, length in ``[lengths)``), each followed by ``eod`` when given."""
    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(count):
            start, step = rng.randint(0, vocab), rng.randint(1, 4)
            document = (start + step * np.arange(rng.randint(*lengths))) % vocab
            builder.add_document(document if eod is None else np.append(document, eod))
    return prefix


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """After the session: a process one of its tests started that was orphaned (outlives its parent, so nothing
    stops it) fails the session, named, and is killed."""
    yield
    if sys.platform.startswith("linux"):
        left = leftover_processes.stop_orphans(SESSION, os.getpid())
        assert not left, f"processes the tests started were left running (now killed): {left}"


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small indexed dataset of token ids below VOCAB: arithmetic sequences, some structure to learn."""
    return write_arithmetic_documents(str(tmp_path_factory.mktemp("data") / "tiny"), 200, 0, VOCAB, (8, 40))
