"""Convert checkpoints between Hugging Face (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3; safetensors), Megatron-LM and megalite.

    python tools/convert_checkpoint.py --from hf --to megalite --input HF_DIR --output OUT_DIR
    python tools/convert_checkpoint.py --from megalite --to hf --input CKPT_DIR --output HF_DIR
    python tools/convert_checkpoint.py --from megatron --to megalite --input MEGATRON_SAVE_DIR --output OUT_DIR
    python tools/convert_checkpoint.py --from megalite --to megatron --input CKPT_DIR --output MEGATRON_SAVE_DIR
    python tools/convert_checkpoint.py --from megatron-legacy --to megalite --allow-pickle --input SAVE --output OUT_DIR
    python tools/convert_checkpoint.py --from megalite --to peft --input ADAPTER_CKPT_DIR --output PEFT_DIR

``--from megatron`` / ``--to megatron`` is Megatron-LM's torch_dist format (``--ckpt-format torch_dist``), read
and written as Megatron-LM's save directory (``latest_checkpointed_iteration.txt`` and ``iter_XXXXXXX/``): from
it the weights, the Adam state (the distributed optimizer's 'dp_reshardable' buckets too) and the LR schedule
(the converted run resumes), to it the weights only; ``--from megatron-legacy`` reads the older
``mp_rank_XX/model_optim_rng.pt`` pickles (weights, the Adam state, a distributed optimizer's from its
``distrib_optim.pt`` files, and the LR schedule), only with ``--allow-pickle``.  ``--to peft`` writes a ``--lora-rank``
run's adapter checkpoint in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``) for the
base's ``--to hf`` conversion.

A megalite checkpoint is written as whole global tensors; loading it under any tensor-, pipeline-, expert-
or data-parallel layout splits them (fused QKV and SwiGLU gate/up included), so no target layout
is needed.  Conversions stream: to or from Hugging Face, memory holds about the largest layer plus one
output shard (``--max-shard-size``), not the model.  The output directory must not exist or be empty; nothing is overwritten.
"""

from __future__ import annotations

import sys

from megalite.checkpoint import read_checkpoint_info
from megalite.checkpoint.hf import convert_hf_to_megalite, convert_megalite_to_hf
from megalite.checkpoint.memory import return_freed_tensors
from megalite.checkpoint.megatron_convert import convert_megalite_to_megatron, convert_megatron_to_megalite
from megalite.checkpoint.megatron_optim import optimizer_warning
from megalite.checkpoint.megatron_legacy import convert_megatron_legacy
from megalite.cli import run_cli
from megalite.flags import ArgumentParser
from megalite.lora.peft import convert_adapters_to_peft


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", choices=("hf", "megalite", "megatron", "megatron-legacy"),
                        required=True)
    parser.add_argument("--to", dest="target", choices=("hf", "megalite", "megatron", "peft"), required=True)
    parser.add_argument("--input", required=True,
                        help="Hugging Face model directory, megalite checkpoint (an adapter checkpoint for --to "
                             "peft) or Megatron-LM save directory")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="to hf: above this size the safetensors output is split into "
                             "model-0000k-of-0000n.safetensors files with an index (default 5GB)")
    parser.add_argument("--megatron-tensor-parallel-size", type=int, default=1,
                        help="to megatron: the tensor-parallel size of the Megatron run that loads it (its "
                             "vocabulary is padded to --make-vocab-size-divisible-by x this; default 1)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="megatron-legacy: unpickle the model_optim_rng.pt files (pickles can run code; "
                             "only for files you trust)")
    parser.add_argument("--vocab-size", type=int,
                        help="megatron-legacy: the real vocabulary size, when Megatron's saved args lack it")
    args = parser.parse_args(argv)
    return_freed_tensors()  # the conversions stream: keep the resident set at about one layer
    if args.source == args.target:
        parser.error(f"--from and --to are both {args.source!r}; nothing to convert")
    if "megalite" not in (args.source, args.target):
        parser.error(f"--from {args.source} --to {args.target}: one side must be megalite (convert in two steps)")
    if args.megatron_tensor_parallel_size < 1:
        parser.error("--megatron-tensor-parallel-size must be a positive integer")
    if args.source == "megalite" and args.target != "peft" and read_checkpoint_info(args.input)["state"].get("lora"):
        raise ValueError(f"{args.input} holds LoRA adapters, not a model: write them with --to peft (and convert "
                         f"the base model they were trained on with --to {args.target})")
    if args.source == "megatron-legacy":
        legacy = convert_megatron_legacy(args.input, args.output, allow_pickle=args.allow_pickle,
                                         vocab_size=args.vocab_size)
        if legacy.optimizer_note:
            print(optimizer_warning(legacy.optimizer_note))
    elif args.source == "hf":
        convert_hf_to_megalite(args.input, args.output)
    elif args.source == "megatron":
        reader = convert_megatron_to_megalite(args.input, args.output)
        if reader.optimizer_note:
            print(optimizer_warning(reader.optimizer_note))
    elif args.target == "peft":
        convert_adapters_to_peft(args.input, args.output)
    elif args.target == "megatron":
        convert_megalite_to_megatron(args.input, args.output, args.megatron_tensor_parallel_size)
    else:
        convert_megalite_to_hf(args.input, args.output, args.max_shard_size)
    print(f"wrote {args.target} checkpoint to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
