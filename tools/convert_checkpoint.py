"""Convert checkpoints between Hugging Face (GPT-2, Llama, DeepSeek-V3; safetensors + config.json) and megalite.

    python tools/convert_checkpoint.py --from hf --to megalite --input HF_DIR --output OUT_DIR
    python tools/convert_checkpoint.py --from megalite --to hf --input CKPT_DIR --output HF_DIR
    python tools/convert_checkpoint.py --from megatron-legacy --to megalite --allow-pickle --input SAVE --output OUT_DIR

A megalite checkpoint is written as whole global tensors; loading it under any tensor-, pipeline-
or data-parallel layout splits them (fused QKV and SwiGLU gate/up included), so no target layout
is needed.  The output directory must not exist or be empty; nothing is overwritten.
"""

from __future__ import annotations

import sys

from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf
from megalite.checkpoint.megatron_legacy import convert_megatron_legacy
from megalite.cli import run_cli
from megalite.flags import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", choices=("hf", "megalite", "megatron-legacy"),
                        required=True)
    parser.add_argument("--to", dest="target", choices=("hf", "megalite"), required=True)
    parser.add_argument("--input", required=True, help="Hugging Face model directory or megalite checkpoint")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="to hf: above this size the safetensors output is split into "
                             "model-0000k-of-0000n.safetensors files with an index (default 5GB)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="megatron-legacy: unpickle the model_optim_rng.pt files (pickles can run code; "
                             "only for files you trust)")
    parser.add_argument("--vocab-size", type=int,
                        help="megatron-legacy: the real vocabulary size, when Megatron's saved args lack it")
    args = parser.parse_args(argv)
    if args.source == args.target:
        parser.error(f"--from and --to are both {args.source!r}; nothing to convert")
    if args.source == "megatron-legacy":
        if args.target != "megalite":
            parser.error("--from megatron-legacy converts only --to megalite")
        legacy = convert_megatron_legacy(args.input, args.output, allow_pickle=args.allow_pickle,
                                         vocab_size=args.vocab_size)
        if legacy.optimizer_note:
            print(f"the Megatron optimizer state is not converted ({legacy.optimizer_note}): a run that loads this "
                  "checkpoint starts with fresh Adam moments")
    elif args.source == "hf":
        convert_hf_to_megalite(args.input, args.output)
    else:
        convert_megalite_to_hf(args.input, args.output, args.max_shard_size)
    print(f"wrote {args.target} checkpoint to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
