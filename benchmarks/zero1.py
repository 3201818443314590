"""megalite ZeRO-1 (distributed optimizer) vs torch's ZeroRedundancyOptimizer, same ranks, one run.

Same ~50M-parameter MLP stack and loop as benchmarks/ddp.py at dp=4; prints step times, their
ratio, optimizer state per rank and its fraction of plain DDP's (8 bytes/param of Adam moments).

    python benchmarks/zero1.py [--data-parallel-size 4] [--steps 6] [--width 2048] [--layers 12]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp import main  # noqa: E402

if __name__ == "__main__":
    main(zero=True)
