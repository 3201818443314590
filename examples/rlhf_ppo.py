"""RL (PPO, GRPO, RLOO, REINFORCE++) on single-digit additions with a tensor/pipeline/data-parallel GPT.

    torchrun --nproc_per_node 4 examples/rlhf_ppo.py             # TP2 x DP2, PPO with a critic (GAE)
    torchrun --nproc_per_node 4 examples/rlhf_ppo.py --advantage-estimator grpo --n-samples-per-prompt 4 \\
        --global-batch-size 32 --use-kl-loss                      # GRPO
    python examples/rlhf_ppo.py --tensor-model-parallel-size 1    # one process

A thin script over ``megalite.rlhf.trainer.RLTrainer``: it first pretrains a small GPT on "a+b=c<eod>" problems
just long enough to learn the format and some of the sums (or loads it with ``--load``), then runs RL: the actor
samples ``--n-samples-per-prompt`` answers to each "a+b=" prompt, a reward function (``--reward-fn
module:function``, default the arithmetic rule, or ``--reward-model DIR``) scores them, the KL to the frozen
reference model goes into the per-token reward or, with ``--use-kl-loss``, into the loss, and
``--advantage-estimator`` turns rewards into advantages (gae trains a GPT critic).  DAPO's pieces:
``--clip-ratio-low/--clip-ratio-high``, ``--dynamic-sampling`` and ``--overlong-buffer-len`` shaping.

``--max-staleness S`` generates the rollouts of up to S later iterations ahead of the update that trains on the
current one (truncated importance sampling, ``--rollout-is-cap``, corrects a stale rollout's loss).
``--rollout-world-size`` generates on ranks of their own, synced with the trainers' weights after each update.
``--use-scoring-server`` runs the reward (and with ``--distill-coef`` / ``--teacher-reward-coef`` a teacher GPT,
``--teacher-topk K``) on one rank.  ``--offload-frozen-models`` / ``--offload-optimizer`` park models and optimizer
state in host memory outside their phase (rank 0 prints the placement plan).  ``--environment calculator`` (or
``verifier``) plays multi-turn episodes of ``megalite.rlhf.env_tasks`` instead: a*b with a ``<calc>EXPR</calc>``
tool, the reward given by the environment, ``--max-turns`` / ``--max-total-tokens`` per episode;
``--environment guidance`` trains a second model, a guide whose hint comes between the policy's attempt and its
revision (``megalite.rlhf.guidance``).  Each iteration is printed and
written to ``--metrics-file`` (JSON lines) and TensorBoard.  ``--help`` lists every option.
"""

from __future__ import annotations

import sys

from megalite.cli import run_cli
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args


def main(argv=None) -> int:
    return RLTrainer(parse_args(argv, description=__doc__.splitlines()[0])).train()


if __name__ == "__main__":
    sys.exit(run_cli(main))
