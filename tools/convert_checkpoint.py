"""Convert checkpoints between Hugging Face (GPT-2, Llama; safetensors + config.json), Megatron-LM and megalite.

    python tools/convert_checkpoint.py --from hf --to megalite --input HF_DIR --output OUT_DIR
    python tools/convert_checkpoint.py --from megalite --to hf --input CKPT_DIR --output HF_DIR
    python tools/convert_checkpoint.py --from megatron --to megalite --input MEGATRON_SAVE_DIR --output OUT_DIR
    python tools/convert_checkpoint.py --from megalite --to megatron --input CKPT_DIR --output MEGATRON_SAVE_DIR

Megatron-LM checkpoints are the torch_dist format (``--ckpt-format torch_dist``), read and written as
Megatron-LM's save directory (``latest_checkpointed_iteration.txt`` and ``iter_XXXXXXX/``); model weights only.

A megalite checkpoint is written as whole global tensors; loading it under any tensor-, pipeline-
or data-parallel layout splits them (fused QKV and SwiGLU gate/up included), so no target layout
is needed.  The output directory must not exist or be empty; nothing is overwritten.
"""

from __future__ import annotations

import sys

from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf
from megalite.checkpoint.megatron_convert import convert_megalite_to_megatron, convert_megatron_to_megalite
from megalite.cli import run_cli
from megalite.flags import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", choices=("hf", "megalite", "megatron"), required=True)
    parser.add_argument("--to", dest="target", choices=("hf", "megalite", "megatron"), required=True)
    parser.add_argument("--input", required=True,
                        help="Hugging Face model directory, megalite checkpoint or Megatron-LM save directory")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="to hf: above this size the safetensors output is split into "
                             "model-0000k-of-0000n.safetensors files with an index (default 5GB)")
    parser.add_argument("--megatron-tensor-parallel-size", type=int, default=1,
                        help="to megatron: the tensor-parallel size of the Megatron run that loads it (its "
                             "vocabulary is padded to --make-vocab-size-divisible-by x this; default 1)")
    args = parser.parse_args(argv)
    if args.source == args.target:
        parser.error(f"--from and --to are both {args.source!r}; nothing to convert")
    if "megalite" not in (args.source, args.target):
        parser.error(f"--from {args.source} --to {args.target}: one side must be megalite (convert in two steps)")
    if args.megatron_tensor_parallel_size < 1:
        parser.error("--megatron-tensor-parallel-size must be a positive integer")
    if args.source == "hf":
        convert_hf_to_megalite(args.input, args.output)
    elif args.source == "megatron":
        convert_megatron_to_megalite(args.input, args.output)
    elif args.target == "megatron":
        convert_megalite_to_megatron(args.input, args.output, args.megatron_tensor_parallel_size)
    else:
        convert_megalite_to_hf(args.input, args.output, args.max_shard_size)
    print(f"wrote {args.target} checkpoint to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
