"""The inference engine on one GPU beside transformers' generate, same model, workload and dtype, in one run.

    python benchmarks/gpu_inference.py [--requests 256] [--batches 32,64,128] [--max-num-seqs 128]

Model: a Llama-style decoder with random weights (h=2048, 16 layers, 16 heads in 8 KV groups, SwiGLU 5632,
vocab 32000: 0.9B parameters), built with transformers and converted to megalite, both run in bf16.
Workload (benchmarks/inference.py's, seeded, at this vocabulary): greedy requests with prompts of 16-256 tokens and 16-128 output
tokens each.  transformers runs padded static batches at each size of ``--batches`` (every row decodes as many
tokens as its batch's longest; only the tokens a request asked for count) and is compared at its best size;
the engine takes all requests at once (continuous batching over its paged KV cache).  Times are wall seconds
after one warm-up pass of each, with the GPU synchronised.  Prints output tokens/s for each and the ratio, and
the share of requests whose greedy tokens agree (bf16 argmax ties on random weights make a few differ).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from extras import require  # noqa: E402
from inference import run_hf_static, workload  # noqa: E402
from megalite.checkpoint import load_model  # noqa: E402
from megalite.checkpoint.hf import convert_hf_to_megalite  # noqa: E402
from megalite.inference import LLM, EngineConfig, SamplingParams  # noqa: E402

VOCAB = 32000


def build(directory: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(os.path.join(directory, "hf"))
    convert_hf_to_megalite(os.path.join(directory, "hf"), os.path.join(directory, "ckpt"))
    return model.to("cuda", torch.bfloat16).eval()


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batches", default="32,64,128")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    args = parser.parse_args()
    require("transformers", "test", "the transformers side of this benchmark")
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    work = workload(args.requests, vocab=VOCAB)
    asked = sum(m for _, m in work)
    with tempfile.TemporaryDirectory() as tmp:
        hf = build(tmp)
        model = load_model(os.path.join(tmp, "ckpt"), "cuda").to(torch.bfloat16).eval()
    blocks = sum(-(-(len(p) + m) // 16) for p, m in work) + 64
    llm = LLM.from_model(model, engine_config=EngineConfig(block_size=16, num_blocks=blocks,
                                                           max_num_seqs=args.max_num_seqs))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in work]

    def engine():
        return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in work], params)]

    engine()  # warm-up: allocator, cuBLAS and cuDNN plans
    engine_s, engine_out = timed(engine)
    print(f"megalite engine: {engine_s:.2f} s, {asked / engine_s:,.0f} output tokens/s", flush=True)
    best = None
    for batch in (int(b) for b in args.batches.split(",")):
        run_hf_static(hf, work[:batch], batch, "cuda")  # warm-up at this size
        (seconds, _), outs = run_hf_static(hf, work, batch, "cuda")
        print(f"transformers generate, batch {batch}: {seconds:.2f} s, {asked / seconds:,.0f} output tokens/s",
              flush=True)
        if best is None or seconds < best[0]:
            best = (seconds, batch, outs)
    agree = sum(a == b for a, b in zip(engine_out, best[2])) / len(work)
    print(f"engine / transformers at its best batch ({best[1]}): {best[0] / engine_s:.2f}x output tokens/s; "
          f"greedy outputs agree on {agree:.0%} of requests ({torch.cuda.get_device_name()}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
