"""Preference optimisation (DPO, IPO, SimPO on chat pairs; KTO on unpaired data), through the same trainer as
pretraining and SFT.

    torchrun --nproc_per_node 2 examples/dpo.py --tensor-model-parallel-size 2 \
        --pref-data pairs.jsonl --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR \
        --load checkpoints/sft --finetune --save checkpoints/dpo --pref-loss dpo --beta 0.1

Each jsonl line holds ``prompt``, ``chosen`` and ``rejected``.  A pair's two sequences are packed into one
sample and go through one forward; the reference is the loaded model, frozen (see
megalite.rlhf.preference_training).  Reward accuracy and margin are logged with the loss.

``--pref-loss kto`` takes TRL's unpaired form instead: ``prompt``, ``completion`` and ``label`` (true for a
desirable completion) per line, weighted by ``--kto-desirable-weight``/``--kto-undesirable-weight``; its KL
reference point ``kl`` and the desirable and undesirable rewards are logged (micro-batches of 2 or more).

With pretraining's ``--lora-rank`` flags only adapters train, and the reference is the loaded base itself with
the adapters disabled (no second copy of the model); ``--save`` holds the adapters only, exported to PEFT's
format by ``tools/convert_checkpoint.py --from megalite --to peft``.
"""

import sys

import torch

from megalite.cli import run_cli
from megalite.rlhf.preference_training import PreferenceTraining, add_preference_flags
from megalite.training import gpt, pretrain

DEFAULTS = {"lr": 5e-6, "min_lr": 5e-7, "lr_warmup_fraction": 0.1, "lr_decay_style": "cosine",
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "log_interval": 10, "split": "95,5,0"}


def main(argv=None):
    run = PreferenceTraining()
    pretrain(run.datasets, gpt.model_provider, run.forward_step, args_defaults=DEFAULTS,
             extra_args_provider=add_preference_flags, argv=argv, prepare_data_func=run.prepare_data)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(run_cli(main))
