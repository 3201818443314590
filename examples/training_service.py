"""Train the GPT through a TrainingService (tp2 x dp2 workers, driven by asyncio) and compare with pretrain_gpt.py.

    python examples/training_service.py [--train-iters 3] [--backend ray]

A plain ``python`` process: it runs ``examples/pretrain_gpt.py`` on 4 ranks (torch.distributed.run) on the
default synthetic corpus, then starts a 4-worker service (``--backend local``: processes; ``--backend ray``:
Ray actors on a local Ray cluster the service starts, ``pip install megalite[ray]``) with the same
flags-derived GPTConfig and OptimizerConfig, feeds it the same global batches in the same order (each a
DP-contiguous slice per worker, as pretraining's sampler hands them out) and the same seed, and prints both
loss curves.  Exits non-zero if they differ (relative tolerance 1e-5).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megalite.cli import run_cli  # noqa: E402
from megalite.data.gpt_dataset import build_train_valid_test_datasets  # noqa: E402
from megalite.data.synthetic import build_default_data  # noqa: E402
from megalite.flags import ArgumentParser  # noqa: E402
from megalite.training.arguments import validate_args  # noqa: E402
from megalite.training.data_checks import check_data  # noqa: E402
from megalite.training.flags import gpt_config, optimizer_config, parse_args  # noqa: E402

# A small model; max positions cover seq_length + 1 because the service's language-model objective reads the
# whole sample (inputs tokens[:-1], labels tokens[1:] after its own shift), which is pretraining's computation.
# The service steps at the optimizer's fixed lr, so pretraining runs a constant lr with no warmup (the example's
# default --lr-warmup-fraction 0.1 would start it at lr 0, as Megatron's schedule does).
FLAGS = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
         "4", "--seq-length", "32", "--max-position-embeddings", "33", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--lr-decay-style", "constant", "--lr-warmup-fraction", "0",
         "--weight-decay", "0.0", "--clip-grad", "1.0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
         "--log-interval", "1", "--eval-interval", "1000", "--seed", "1234"]
WORLD = 4


def pretrain_losses(flags: list[str], directory: str) -> list[float]:
    metrics = os.path.join(directory, "pretrain.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port", str(port),
           os.path.join(ROOT, "examples", "pretrain_gpt.py"), *flags, "--metrics-file", metrics,
           "--save", os.path.join(directory, "pretrain_ckpt"), "--tensorboard-dir", ""]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1200)
    with open(metrics) as f:
        return [record["loss"] for record in map(json.loads, f) if "loss" in record]


def global_batches(args):
    """Pretraining's global batches in order: samples ``[i*G, (i+1)*G)`` of the train dataset."""
    data_prefix, _ = build_default_data(args.data_cache_path)
    train, _, _ = build_train_valid_test_datasets([data_prefix], args.split, args.seq_length, args.seed,
                                                  [args.train_iters * args.global_batch_size, 0, 0],
                                                  args.data_cache_path)
    for step in range(args.train_iters):
        tokens = torch.stack([torch.as_tensor(train[i]["tokens"]).long()
                              for i in range(step * args.global_batch_size, (step + 1) * args.global_batch_size)])
        yield {"input_ids": tokens, "attention_mask": torch.ones_like(tokens),
               "loss_mask": torch.ones(tokens.shape[0], tokens.shape[1] - 1)}


async def service_losses(args, directory: str, backend: str) -> list[float]:
    from megalite.rlhf import ParallelLayout, TrainingService

    prefix, args.tokenizer_model = build_default_data(args.data_cache_path)
    args.data_path = [prefix]
    check_data(args)  # sets the vocabulary size from the tokenizer, as pretraining does
    layout = ParallelLayout(tp=args.tensor_model_parallel_size, dp=args.data_parallel_size,
                            micro_batch_size=args.micro_batch_size)
    training = await TrainingService.options(procs=WORLD, with_gpus=False, backend=backend).as_service(
        model=gpt_config(args), optimizer=optimizer_config(args), loss_fn="language_model", parallel=layout,
        checkpoint_dir=os.path.join(directory, "service_ckpt"), seed=args.seed)
    try:
        calls = []
        for batch in global_batches(args):
            calls += [training.forward_backward(batch), training.optim_step()]  # queued, then awaited together
        results = await asyncio.gather(*calls)
        return [r["lm_loss"] for r in results[::2]]
    finally:
        await training.shutdown()


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--backend", choices=("local", "ray"), default="local", help="where the service's workers run")
    options = p.parse_args(argv)
    extra = ["--train-iters", str(options.train_iters)]
    flags = FLAGS + extra
    args = validate_args(parse_args(flags), WORLD)
    with tempfile.TemporaryDirectory() as directory:
        reference = pretrain_losses(flags, directory)
        served = asyncio.run(service_losses(args, directory, options.backend))
    print(f"iteration  pretrain_gpt.py  TrainingService ({options.backend})")
    for i, (a, b) in enumerate(zip(reference, served), 1):
        print(f"{i:9d}  {a:15.6f}  {b:15.6f}")
    same = len(reference) == len(served) == args.train_iters and all(
        abs(a - b) <= 1e-5 * max(abs(a), 1.0) for a, b in zip(reference, served))
    print("losses match" if same else "LOSSES DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
