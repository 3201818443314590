"""torchtitan's Llama 3 trained on one device, the peer run of benchmarks/gpu_gpt.py --torchtitan.

    python benchmarks/torchtitan_gpt.py [--compile] [--micro-batch-size 8] [--global-batch-size 32]

Builds torchtitan's own Llama 3 ``Transformer`` (pip ``torchtitan`` 0.2.2, the newest release whose imports
the lent GPU machine's torch 2.11 has: RMSNorm, SwiGLU with its hidden size rule, RoPE, untied output, SDPA
causal attention, its default) at the shape given, applies torchtitan's own ``apply_fsdp`` on a one-device
mesh (FSDP degree 1: no all-gather to do, but its mixed-precision policy, bf16 parameters and fp32 gradient
reduction) and, with ``--compile``, its ``apply_compile`` (each transformer block compiled; its loss too, as
its ``compile.components`` default does).  The step is torchtitan's train step: gradient accumulation over
micro-batches of its summed cross-entropy normalised by the tokens of the global batch, gradient clipping at
1.0 and its default optimizer, AdamW (lr 8e-4, eps 1e-8, weight decay 0.1) with the fused implementation.
Random tokens, as megalite's --mock-data.  Prints one JSON line last: tokens/s (the mean of the timed
iterations after the warm-up) and the iteration time.

The model modules are imported without the ``torchtitan.models.llama3`` package's ``__init__``, which
registers torchtitan's trainer (its Hugging Face dataset loaders); ``datasets`` is only needed to load
data, so where it is not installed an empty stand-in takes its name.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types

import torch
import torch.distributed as dist


def import_torchtitan():
    """torchtitan's Llama 3 model, its FSDP and compile functions and its loss, without its trainer's registry."""
    if importlib.util.find_spec("datasets") is None:
        stand_in = types.ModuleType("datasets")
        stand_in.Dataset = stand_in.load_dataset = None
        stand_in.distributed = types.ModuleType("datasets.distributed")
        stand_in.distributed.split_dataset_by_node = None
        sys.modules.update({"datasets": stand_in, "datasets.distributed": stand_in.distributed})
    import torchtitan.models

    package = types.ModuleType("torchtitan.models.llama3")
    package.__path__ = [os.path.join(os.path.dirname(torchtitan.models.__file__), "llama3")]
    sys.modules.setdefault("torchtitan.models.llama3", package)
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama3.infra.parallelize import apply_compile, apply_fsdp
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    return types.SimpleNamespace(loss=cross_entropy_loss, Compile=Compile, apply_compile=apply_compile,
                                 apply_fsdp=apply_fsdp, Args=TransformerModelArgs, Transformer=Transformer)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=6, help="timed iterations after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block, as torchtitan's compile")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    titan = import_torchtitan()
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    config = titan.Args(dim=args.hidden_size, n_layers=args.num_layers, n_heads=args.num_attention_heads,
                        vocab_size=args.vocab_size, max_seq_len=args.seq_length)
    with torch.device("meta"):
        model = titan.Transformer(config)
    if args.compile:
        titan.apply_compile(model, titan.Compile(enable=True))
    titan.apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    ffn_hidden = model.layers["0"].feed_forward.w1.weight.shape[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  fused=device.type == "cuda", foreach=None if device.type == "cuda" else False)
    loss_fn = torch.compile(titan.loss) if args.compile else titan.loss
    steps = args.global_batch_size // args.micro_batch_size
    tokens_in_batch = args.global_batch_size * args.seq_length
    generator = torch.Generator().manual_seed(1234)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, losses = [], []
    for _ in range(args.warmup + args.iters):
        synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        total = 0.0
        for _ in range(steps):
            tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                                   generator=generator).to(device)
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / tokens_in_batch
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=device.type == "cuda")
        optimizer.step()
        losses.append(float(total))
        synchronize()
        times.append(time.perf_counter() - start)
    timed = times[args.warmup:]
    iter_s = sum(timed) / len(timed)
    dist.destroy_process_group()
    import torchtitan

    print(json.dumps({"tokens_per_sec": tokens_in_batch / iter_s, "iter_ms": iter_s * 1e3, "losses": losses,
                      "compile": args.compile, "micro_batch_size": args.micro_batch_size,
                      "ffn_hidden_size": ffn_hidden,
                      "version": getattr(torchtitan, "__version__", "0.2.2")}))


if __name__ == "__main__":
    main()
