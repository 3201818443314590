"""Planning speed (issue 40): Llama 3 405B on 16,384 H100s over the planner's full search space.

Times ``megalite.plan.search.plan`` in process (after the imports) and prints how many layouts it
considered and the top one.  The bound is 10 s on the project's 2-core machine.  There is no peer to
run beside it: Megatron-LM and torchtitan estimate the memory of one given layout and do not search.
"""

from __future__ import annotations

import time

from megalite.hardware import load_hardware
from megalite.plan.__main__ import preset_config
from megalite.plan.search import plan


def main() -> None:
    config, hw = preset_config("llama3-405b"), load_hardware("h100")
    for run in range(3):
        start = time.perf_counter()
        result = plan(config, 16384, hw, seq_length=8192, global_batch_size=2048)
        elapsed = time.perf_counter() - start
        best = result.ranked[0]
        print(f"run {run}: {elapsed:.2f} s, {result.considered} layouts considered, {len(result.ranked)} fit; "
              f"best {best.tokens_per_s_per_gpu:.0f} tokens/s/GPU, MFU {best.mfu:.1%}: {' '.join(best.layout.flags())}")


if __name__ == "__main__":
    main()
