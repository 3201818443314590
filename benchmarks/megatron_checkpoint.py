"""Loading and converting a ~350M-parameter Megatron-LM torch_dist checkpoint: megalite beside Megatron-Core.

    python benchmarks/megatron_checkpoint.py [--hidden-size 1024 --num-layers 24] [--workdir DIR]

Megatron-Core writes a synthetic (random bf16 weights) GPT checkpoint from one rank, so the largest rank's
share is the whole checkpoint.  Each measured step then runs in a fresh process: Megatron-Core's own
``dist_checkpointing.load`` into its model; megalite's ``load_sharded`` of the same directory into a bf16
megalite model; and ``tools/convert_checkpoint.py --from megatron --to megalite``.  Each reports its
seconds and its peak resident memory above what the process held before the step (model included), as
a multiple of the checkpoint's size.  Prints one JSON line per step and the time ratios last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _measure(step) -> dict:
    """Seconds of ``step()`` and its peak RSS above the RSS before it (the kernel's peak is reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss_above_start_mib": (_rss_kib("VmHWM") - before) / 1024}


def _init_dist() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)


def _megatron_model(args, initialize: bool):
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.checkpoint.megatron_fixture import patch_cuda

    patch_cuda()
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.hidden_size // 64,
        ffn_hidden_size=4 * args.hidden_size, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=True, perform_initialization=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab_size, max_sequence_length=1024,
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    if initialize:
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.02)
    return model


def _megatron_args(args) -> dict:
    return {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
            "num_attention_heads": args.hidden_size // 64, "ffn_hidden_size": 4 * args.hidden_size,
            "max_position_embeddings": 1024, "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm", "norm_epsilon": 1e-5, "add_bias_linear": True,
            "untie_embeddings_and_output_weights": False, "padded_vocab_size": args.vocab_size,
            "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "world_size": 1, "ckpt_format": "torch_dist"}


def phase_make(args) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    _init_dist()
    model = _megatron_model(args, initialize=True)
    directory = os.path.join(args.save, "iter_0000001")
    os.makedirs(directory)
    state = {"args": argparse.Namespace(**_megatron_args(args)), "checkpoint_version": 3.0, "iteration": 1,
             "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, directory)
    with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    dist.destroy_process_group()
    return {"parameters": sum(p.numel() for p in model.parameters())}


def phase_megatron_load(args) -> dict:
    from megatron.core import dist_checkpointing

    _init_dist()
    model = _megatron_model(args, initialize=False)
    directory = os.path.join(args.save, "iter_0000001")

    def step():
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
        model.load_state_dict(loaded["model"])

    return _measure(step)


def phase_megalite_load(args) -> dict:
    import torch

    from megalite import checkpoint
    from megalite.models import GPTModel

    config = checkpoint.read_checkpoint_info(args.save)["config"]
    with torch.device("meta"):
        model = GPTModel(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    return _measure(lambda: checkpoint.load_sharded(args.save, [model]))


def phase_megalite_convert(args) -> dict:
    import megalite.models  # noqa: F401  (imported before the measured step, as the load phases' are)
    from megalite.checkpoint.megatron_convert import convert_megatron_to_megalite

    return _measure(lambda: convert_megatron_to_megalite(args.save, args.output))


def _run_phase(name: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--phase", name, "--save", args.save, "--output",
               args.output, "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
               "--vocab-size", str(args.vocab_size)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"phase {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(globals()[f"phase_{args.phase}"](args)))
        return
    workdir = tempfile.mkdtemp(dir=args.workdir)
    args.save, args.output = os.path.join(workdir, "megatron"), os.path.join(workdir, "megalite")
    try:
        made = _run_phase("make", args)
        size = sum(os.path.getsize(os.path.join(args.save, "iter_0000001", f))
                   for f in os.listdir(os.path.join(args.save, "iter_0000001")))
        print(json.dumps({"parameters": made["parameters"], "checkpoint_mib": size / 2**20}), flush=True)
        results = {}
        for name in ("megatron_load", "megalite_load", "megalite_convert"):
            results[name] = result = _run_phase(name, args)
            result["peak_rss_vs_checkpoint"] = result["peak_rss_above_start_mib"] * 2**20 / size
            print(json.dumps({"step": name, **result}), flush=True)
        base = results["megatron_load"]["seconds"]
        print(json.dumps({"load_time_ratio_megalite_vs_megatron": results["megalite_load"]["seconds"] / base,
                          "convert_time_ratio_megalite_vs_megatron_load": results["megalite_convert"]["seconds"] / base}))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
