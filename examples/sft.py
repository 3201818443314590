"""Supervised fine-tuning on chat data, through the same trainer, layouts and checkpoints as pretraining.

    torchrun --nproc_per_node 4 examples/sft.py --tensor-model-parallel-size 2 --context-parallel-size 2 \
        --sft-data chats.jsonl --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR \
        --load checkpoints/base --finetune --save checkpoints/sft --split 95,5,0 --eval-interval 50

Each jsonl line holds ``messages`` (system/user/assistant/tool) or ``prompt``/``completion``; the loss is on
assistant tokens only, and conversations are packed into ``--seq-length`` with attention and positions kept
per conversation (see megalite.data.sft).  The tokenizer's chat template (or ``--chat-template FILE``) must
mark assistant output with ``{% generation %}``; TRL ships such ``*_training.jinja`` templates.

Large sets: ``tools/preprocess_data.py --chat --input chats.jsonl --output-prefix data/chats ...`` renders once
into Megatron indexed files (tokens and loss mask) and ``--sft-data data/chats`` reads them, giving the same
samples; or keep the jsonl and pass ``--data-cache-path DIR``, where the rendering is cached for the next run.

LoRA takes pretraining's flags: ``--lora-rank 8 [--lora-alpha 16 --lora-dropout 0.05 --lora-target-modules
linear_qkv,linear_proj]`` with ``--load BASE --finetune`` trains adapters only (the base stays frozen), and
``--save`` then holds the adapters only; ``tools/convert_checkpoint.py --from megalite --to peft`` exports them.
"""

import sys

import torch

from megalite.cli import run_cli
from megalite.training import gpt, pretrain, sft

DEFAULTS = {"lr": 1e-4, "min_lr": 1e-5, "lr_warmup_fraction": 0.03, "lr_decay_style": "cosine",
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "log_interval": 10, "split": "95,5,0"}


def main(argv=None):
    pretrain(sft.sft_datasets_provider, gpt.model_provider, gpt.forward_step, args_defaults=DEFAULTS,
                    extra_args_provider=sft.add_sft_flags, argv=argv, prepare_data_func=sft.prepare_sft_data,
                    flops_per_token_func=gpt.flops_per_token)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(run_cli(main))
