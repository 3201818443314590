"""Megatron-Core's GPT training step at benchmarks/gpu_gpt.py's configuration, on one GPU.

    python benchmarks/megatron_core_gpt.py --micro-batch-size 8 --global-batch-size 32

Run by gpu_gpt.py beside megalite's pretrain_gpt.py; needs the ``megatron-core``
wheel (no Transformer Engine or apex: the local layer spec, whose attention is
Megatron's unfused DotProductAttention).  The step is what Megatron-LM's
training loop does: Float16Module, Megatron DDP with fp32 gradient
accumulation, the no-pipelining forward-backward schedule over the
micro-batches, and Megatron's mixed-precision Adam with fp32 main weights and
gradient clipping.  Tokens are random (throughput does not depend on them).
If a micro-batch does not fit in memory it halves the micro-batch (same global
batch) and says so.  Prints one JSON line last: tokens/s, the micro-batch used
and the version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gpt import MODEL  # noqa: E402


def build(seed: int):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=MODEL["num_layers"], hidden_size=MODEL["hidden_size"],
        num_attention_heads=MODEL["num_attention_heads"], hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, bf16=True, params_dtype=torch.bfloat16,
        bias_activation_fusion=True, bias_dropout_fusion=True, gradient_accumulation_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=MODEL["vocab_size"],
                     max_sequence_length=MODEL["seq_length"], share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    model.cuda(torch.cuda.current_device())
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=1e-5, weight_decay=0.01, bf16=True,
                        params_dtype=torch.bfloat16, use_distributed_optimizer=False, clip_grad=1.0),
        [model])
    return model, optimizer


def forward_step(data_iterator, model):
    tokens, labels, position_ids = next(data_iterator)
    per_token_loss = model(tokens, position_ids, None, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return per_token_loss, loss_func


def run(model, optimizer, micro_batch: int, global_batch: int, iters: int, warmup: int) -> float:
    """Mean seconds per iteration over ``iters`` timed iterations."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    s, vocab = MODEL["seq_length"], MODEL["vocab_size"]
    num_micro = global_batch // micro_batch
    batches = [(torch.randint(0, vocab, (micro_batch, s), device="cuda"),
                torch.randint(0, vocab, (micro_batch, s), device="cuda"),
                torch.arange(s, device="cuda").unsqueeze(0).expand(micro_batch, s)) for _ in range(num_micro)]
    forward_backward = get_forward_backward_func()
    seconds = 0.0
    for it in range(warmup + iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                         num_microbatches=num_micro, seq_length=s, micro_batch_size=micro_batch,
                         forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        torch.cuda.synchronize()
        if it >= warmup:
            seconds += time.perf_counter() - start
        print(f"iteration {it + 1}: {1000 * (time.perf_counter() - start):.1f} ms, grad norm {grad_norm:.3f}",
              flush=True)
    return seconds / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    import megatron.core

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    model, optimizer = build(seed=1234)
    micro_batch = args.micro_batch_size
    while True:
        try:
            seconds = run(model, optimizer, micro_batch, args.global_batch_size, args.iters, args.warmup)
            break
        except torch.cuda.OutOfMemoryError:
            if micro_batch == 1:
                raise
            print(f"micro-batch {micro_batch} does not fit in memory; trying {micro_batch // 2}", flush=True)
            micro_batch //= 2
            torch.cuda.empty_cache()
    tokens = args.global_batch_size * MODEL["seq_length"]
    print(json.dumps({"tokens_per_sec": tokens / seconds, "iter_ms": 1000 * seconds, "micro_batch_size": micro_batch,
                      "version": megatron.core.__version__}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
