"""examples/pretrain_gpt.py with injected faults, for the launch tests (run under torchrun).

``MEGALITE_TEST_FAULTS`` lists ``attempt:rank:iteration:action`` entries separated by ``;``: in
supervisor attempt ``attempt`` (``MEGALITE_RESTART_ATTEMPT``, 0 without a supervisor), global rank
``rank`` does ``action`` during the forward of the ``iteration``-th iteration of this launch:
``kill`` (SIGKILL itself), ``kill-launcher`` (SIGKILL its parent, the torchrun agent, then go on
after a minute, so an orphan would outlive the test's 10 s), ``stall`` (sleep for an hour) or ``hang``
(sleep for an hour, but die at once on SIGTERM: the launcher's stop ends it without the 20 s a stalled
rank takes, for a test that only checks the other ranks).  With ``MEGALITE_TEST_PID_DIR`` each rank writes its pid to
``attempt<a>_rank<r>`` there first.
"""

import os
import signal
import sys
import time

import torch

from megalite.cli import run_cli
from megalite.training import gpt, pretrain


class FaultyForwardStep:
    def __init__(self, argv):
        self.micro = int(argv[argv.index("--micro-batch-size") + 1])
        self.global_batch = int(argv[argv.index("--global-batch-size") + 1])
        self.calls = 0
        attempt = os.environ.get("MEGALITE_RESTART_ATTEMPT", "0")
        rank = os.environ["RANK"]
        self.faults = {}
        for entry in filter(None, os.environ.get("MEGALITE_TEST_FAULTS", "").split(";")):
            a, r, iteration, action = entry.split(":")
            if a == attempt and r == rank:
                self.faults[int(iteration)] = action
        pid_dir = os.environ.get("MEGALITE_TEST_PID_DIR")
        if pid_dir:
            with open(os.path.join(pid_dir, f"attempt{attempt}_rank{rank}"), "w") as f:
                f.write(str(os.getpid()))

    def __call__(self, data_iterator, model):
        from megalite import topology

        per_iteration = self.global_batch // (self.micro * topology.current().dp.size)
        self.calls += 1
        if (self.calls - 1) % per_iteration == 0:
            action = self.faults.get((self.calls - 1) // per_iteration + 1)
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "kill-launcher":
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(60)
            elif action in ("stall", "hang"):
                if action == "hang":
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(3600)
        return gpt.forward_step(data_iterator, model)


def main():
    argv = sys.argv[1:]
    pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, FaultyForwardStep(argv), argv=argv)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(run_cli(main))
