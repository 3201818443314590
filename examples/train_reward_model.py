"""Train a Bradley-Terry reward model on preference pairs with tensor, pipeline and data parallelism.

    torchrun --nproc_per_node 4 examples/train_reward_model.py --save checkpoints/rm   # TP2 x DP2
    python examples/train_reward_model.py --tensor-model-parallel-size 1 --save checkpoints/rm

The data is JSON lines of {"prompt", "chosen", "rejected"} (``--data-path``);
without one, a synthetic arithmetic set (the right answer to "a+b=" preferred
to a wrong one) is written by ``tools/make_preference_data.py``'s function
into ``--save``.  The last ``--held-out-pairs`` pairs are held out; their
accuracy (the chosen response scored higher) is printed before and after
training and logged to ``--metrics-file``.  The model is a GPT with a scalar
head (megalite.rlhf.CriticModel) and is saved as a megalite checkpoint, which
loads under any layout; ``examples/rlhf_ppo.py --reward-model DIR`` uses it.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint import save_sharded
from megalite.cli import run_cli
from megalite.data.tokenizer import ByteTokenizer
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.flags import ArgumentParser
from megalite.models import GPTConfig
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.pipeline import build_chunks
from megalite.rlhf import CriticModel, TrainingBackend, pipeline_values
from megalite.rlhf.flags import REWARD_MODEL_FLAGS
from megalite.rlhf.reward_model import (BradleyTerryObjective, last_token_scores, read_preferences,
                                        write_arithmetic_preferences)
from megalite.training.flags import FLAGS

TOKENIZER = ByteTokenizer()


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    FLAGS.add_to(p, ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--seed", "--hidden-size",
                     "--num-layers", "--num-attention-heads", "--train-iters", "--global-batch-size",
                     "--micro-batch-size", "--lr", "--save", "--metrics-file"],
                 defaults={"--tensor-model-parallel-size": 2, "--seed": 1234, "--hidden-size": 64, "--num-layers": 2,
                           "--train-iters": 400, "--global-batch-size": 64, "--micro-batch-size": 16, "--lr": 1e-3},
                 helps={"--global-batch-size": "pairs per step over all data-parallel ranks",
                        "--micro-batch-size": "pairs per forward on one rank",
                        "--save": "save the reward model here", "--train-iters": "training steps"},
                 required=["--save"])
    REWARD_MODEL_FLAGS.add_to(p)
    return p.parse_args(argv)


def validate(args, world_size: int) -> None:
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by tensor-model-parallel-size "
                         f"{args.tensor_model_parallel_size} x pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size}")
    dp = world_size // model_parallel
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {dp}")


def rows(pairs: list[dict]) -> dict:
    """Interleaved chosen/rejected rows, right-padded: ``input_ids``/``attention_mask`` ``[2 * pairs, s]``."""
    texts = [TOKENIZER.tokenize(p["prompt"] + r) + [TOKENIZER.eod] for p in pairs for r in (p["chosen"], p["rejected"])]
    width = max(len(t) for t in texts)
    ids = torch.tensor([t + [TOKENIZER.pad] * (width - len(t)) for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])
    return {"input_ids": ids, "attention_mask": mask}


def held_out_scores(chunk, pairs, args, device) -> torch.Tensor:
    """Scores ``[2 * pairs]`` (chosen, rejected interleaved) of every pair, on every rank."""
    batch = {k: v.to(device) for k, v in rows(pairs).items()}
    step = 2 * args.micro_batch_size
    micro_batches = [{k: v[i:i + step] for k, v in batch.items()} for i in range(0, len(batch["input_ids"]), step)]
    values = pipeline_values(chunk, micro_batches).to(device)
    return last_token_scores(values, batch["attention_mask"])


def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    validate(args, world_size)
    torch.set_num_threads(1)
    owns_process_group = not dist.is_initialized()
    topo = topology.initialize(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)
    device = topology.device()
    data_path = args.data_path or os.path.join(args.save, "preferences.jsonl")
    if args.data_path is None and topo.global_rank == 0:
        os.makedirs(args.save, exist_ok=True)
        write_arithmetic_preferences(data_path, args.synthetic_pairs, seed=args.seed)
    dist.barrier()
    pairs = read_preferences(data_path)
    if len(pairs) <= args.held_out_pairs:
        raise ValueError(f"{data_path} has {len(pairs)} pairs, not more than --held-out-pairs {args.held_out_pairs}")
    train, held_out = pairs[:-args.held_out_pairs], pairs[-args.held_out_pairs:]
    torch.manual_seed(args.seed)
    config = GPTConfig(vocab_size=TOKENIZER.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, max_position_embeddings=16,
                       make_vocab_size_divisible_by=8, seed=args.seed)
    [model] = build_chunks(lambda **where: CriticModel(config, **where), config.num_layers, topo.pp.group)
    model.to(device)
    chunk = DistributedDataParallel(model, DDPConfig(), topo.dp.group, topo.expert_dp.group)
    optimizer = get_optimizer(OptimizerConfig(lr=args.lr, weight_decay=0.0, clip_grad=1.0), [chunk])
    backend = TrainingBackend(chunk, optimizer, BradleyTerryObjective(), 2 * args.micro_batch_size, topo)

    def accuracy() -> float:
        scores = held_out_scores(chunk, held_out, args, device)
        return float((scores[0::2] > scores[1::2]).float().mean())

    records = [{"iteration": 0, "heldout_accuracy": accuracy()}]
    per_rank = args.global_batch_size // topo.dp.size
    for step in range(1, args.train_iters + 1):
        start = ((step - 1) * args.global_batch_size + topo.dp.rank * per_rank) % (len(train) - per_rank)
        batch = {k: v.to(device) for k, v in rows(train[start:start + per_rank]).items()}
        metrics = backend.forward_backward(batch)
        backend.optim_step()
        if step % 25 == 0 or step == args.train_iters:
            records.append({"iteration": step, **metrics, "heldout_accuracy": accuracy()})
            if topo.global_rank == 0:
                print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in records[-1].items()), flush=True)
    save_sharded(args.save, args.train_iters, [chunk])
    if topo.global_rank == 0:
        print(f"held-out accuracy {records[0]['heldout_accuracy']:.3f} -> {records[-1]['heldout_accuracy']:.3f}; "
              f"saved to {args.save}", flush=True)
        if args.metrics_file:
            with open(args.metrics_file, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    if owns_process_group:
        topology.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
