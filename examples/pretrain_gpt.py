"""Pretrain a small GPT with Megatron-style flags.

    torchrun --nproc_per_node 8 examples/pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2

With no --data-path it trains on megalite's cached synthetic corpus (rank 0
builds it once).  The defaults below give a model whose loss falls from ~4.9
to ~1.5 in 150 iterations, in about two minutes on 8 CPU ranks.  As in Megatron, nothing is saved or
loaded unless asked: ``--save checkpoints/gpt --load checkpoints/gpt`` makes a rerun resume (or say the run
is finished).  TensorBoard logs go to runs/.  At start it prints the planner's prediction for its own layout
(``megalite.plan``: memory per rank, step time, MFU) and after warm-up the measured figures beside it.
"""

import sys

from megalite.cli import run_cli
from megalite.training.megatron_compat import reject_not_implemented

DEFAULTS = {
    "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 64,
    "micro_batch_size": 4, "global_batch_size": 32, "train_iters": 150,
    "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_fraction": 0.1, "lr_decay_style": "cosine",
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "weight_decay": 0.01,
    "log_interval": 10, "eval_interval": 50, "eval_iters": 2,
    "tensorboard_dir": "runs/",
}


def main():
    reject_not_implemented(sys.argv[1:])  # before torch and the trainer load, which take seconds
    import torch

    from megalite.plan.predict import predict_run
    from megalite.training import gpt, pretrain

    torch.set_num_threads(1)
    pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, args_defaults=DEFAULTS,
             prepare_data_func=gpt.prepare_default_data, flops_per_token_func=gpt.flops_per_token,
             prediction_func=predict_run)


if __name__ == "__main__":
    sys.exit(run_cli(main))
