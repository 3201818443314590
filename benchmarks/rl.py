"""RL placement benchmark: the same GRPO workload colocated, disaggregated 2+2 and async (S=1), one run.

Runs examples/rlhf_ppo.py three times on 4 CPU ranks (torch.distributed.run) and prints
samples/s with the per-iteration time split (generation or waiting for rollouts, log-probs,
training, weight sync) and the ratio to colocated; then syncs the example's model once from a
TP2 trainer to two rollout ranks and prints the bytes every rank moved beside the analytic amount
(each rollout rank receives its shard once, vocabulary padding excluded; each trainer rank sends
the tensors it uniquely owns once per rollout replica it serves).

    python benchmarks/rl.py [--iters 20] [--global-batch-size 32] [--n-samples-per-prompt 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.data.tokenizer import ByteTokenizer  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

MODES = {"colocated": ["--tensor-model-parallel-size", "2"],
         "disaggregated 2+2": ["--tensor-model-parallel-size", "2", "--rollout-world-size", "2"],
         "async S=1 (2+2)": ["--tensor-model-parallel-size", "2", "--rollout-world-size", "2", "--max-staleness", "1"]}
SPLIT = ("time_generate_s", "time_log_probs_s", "time_train_s", "time_sync_s")


def run_mode(extra, args, directory, port) -> list[dict]:
    metrics = os.path.join(directory, f"{port}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(port),
           os.path.join(ROOT, "examples", "rlhf_ppo.py"), "--advantage-estimator", "grpo", "--use-kl-loss",
           "--n-samples-per-prompt", str(args.n_samples_per_prompt), "--global-batch-size",
           str(args.global_batch_size), "--train-iters", str(args.iters), "--pretrain-iters", "40",
           "--metrics-file", metrics, "--tensorboard-dir", "", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def _sync_rank(hidden, layers):
    """TP2 trainer (ranks 0, 1) -> two tp1 rollout replicas (ranks 2, 3): bytes moved and the analytic amount."""
    import torch.distributed as dist

    from megalite.rlhf.weight_sync import ROLLOUT, TRAINER, SyncRole, WeightSync

    tokenizer = ByteTokenizer()
    config = GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       max_position_embeddings=16, make_vocab_size_divisible_by=8)
    groups = [dist.new_group([0, 1]), dist.new_group([2]), dist.new_group([3])]
    me = dist.get_rank()
    tp_group, tp_rank, tp = (groups[0], me, 2) if me < 2 else (groups[me - 1], 0, 1)
    model = GPTModel(config, tp_group=tp_group)
    role = SyncRole(TRAINER, 0, tp_rank, tp) if me < 2 else SyncRole(ROLLOUT, me - 2, 0, 1)
    sync = WeightSync(model, role)
    sync.sync()
    unique = 0
    for name, param in model.named_parameters():
        rows = param.shape[0]
        if "word_embeddings" in name or "output_layer" in name:
            rows = max(0, min(rows, config.vocab_size - tp_rank * rows))
        if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
            unique += param[:rows].numel() * param.element_size()
    analytic = unique * 2 if me < 2 else unique
    return {"rank": me, "side": role.side, "bytes": sync.bytes_sent + sync.bytes_received, "analytic": analytic}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--n-samples-per-prompt", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the averages")
    args = p.parse_args()
    samples = args.global_batch_size * args.n_samples_per_prompt
    print(f"GRPO, {args.global_batch_size} prompts x {args.n_samples_per_prompt} samples per iteration, "
          f"{args.iters} iterations on 4 CPU ranks ({torch.get_num_threads()} threads each unless OMP says otherwise)")
    print(f"{'mode':<20}{'samples/s':>10}{'ratio':>7}" + "".join(f"{k[5:-2]:>11}" for k in SPLIT)
          + f"{'iter s':>9}{'final reward':>14}")
    base = None
    with tempfile.TemporaryDirectory() as directory:
        for port, (mode, extra) in enumerate(MODES.items(), start=29700):
            records = run_mode(extra, args, directory, port)[args.warmup:]
            iteration = sum(r["time_iteration_s"] for r in records) / len(records)
            rate = samples / iteration
            base = base or rate
            split = [sum(r.get(k, 0.0) for r in records) / len(records) for k in SPLIT]
            reward = sum(r["reward"] for r in records[-5:]) / min(5, len(records))
            print(f"{mode:<20}{rate:>10.1f}{rate / base:>7.2f}" + "".join(f"{v:>11.3f}" for v in split)
                  + f"{iteration:>9.3f}{reward:>14.3f}")
    print("\nweight sync, example model (hidden 64, 2 layers), TP2 trainer -> 2 x tp1 rollout replicas:")
    print(f"{'rank':>5}{'side':>9}{'bytes':>12}{'analytic':>12}{'ratio':>7}")
    for r in run_distributed(_sync_rank, 4, 64, 2, timeout=300):
        print(f"{r['rank']:>5}{r['side']:>9}{r['bytes']:>12}{r['analytic']:>12}{r['bytes'] / r['analytic']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
