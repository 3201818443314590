"""The inference engine on one GPU beside transformers' generate, same model, workload and dtype, in one run.

    python benchmarks/gpu_inference.py [--requests 256] [--batches 32,64,128] [--max-num-seqs 128]
    python benchmarks/gpu_inference.py --device cpu --tiny --requests 8 --batches 8    # a smoke run of the script

Model: a Llama-style decoder with random weights (h=2048, 16 layers, 16 heads in 8 KV groups, SwiGLU 5632,
vocab 32000: 0.9B parameters), built with transformers and converted to megalite, both run in bf16 (``--tiny``:
2 layers, h=64, fp32 on CPU, to check the script without a GPU).
Workload (benchmarks/inference.py's, seeded, at this vocabulary): greedy requests with prompts of 16-256 tokens and 16-128 output
tokens each.  transformers runs padded static batches at each size of ``--batches`` (every row decodes as many
tokens as its batch's longest; only the tokens a request asked for count) and is compared at its best size;
the engine takes all requests at once (continuous batching over its paged KV cache), in the ``--modes`` given:
``eager`` (``EngineConfig(cuda_graphs=False)``: every step through the paged step's bucketed attention),
``static`` (decode-only steps at static shapes, run eagerly), ``graphs`` (the default on CUDA: those steps
replayed as CUDA graphs, one per batch and context bucket, captured during the warm-up pass) and
``graphs-triton`` (the same with ``decode_attention="triton"``).  A mode that fails is reported and the
others go on.  Times are wall seconds after a warm-up pass of each (a quarter of the requests; all of them with
graphs, which captures them), with the GPU synchronised.  Prints output tokens/s for each, each mode's ratio to
transformers at its best batch and to the eager engine, the share of requests whose greedy tokens agree (bf16
argmax ties on random weights make some differ), and the whole run's seconds.

First it times the attention of one decode step over the paged KV cache on each path (the eager paged step,
the static step's gather + SDPA and, on CUDA, its Triton kernel) at this model's shape: the first 128 requests
halfway through their outputs, 16 layers' calls (each path's per-step setup included).
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from megalite.inference import LLM, EngineConfig, SamplingParams, triton_attention  # noqa: E402
from megalite.inference.paged_cache import KVPool, PagedStep, StepPlan  # noqa: E402
from megalite.inference.static_decode import (COLUMNS, StaticDecode, StaticDecodeCache, bucket,  # noqa: E402
                                              buckets, pack_decode)

VOCAB = 32000
FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=8)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MAX_CONTEXT, BLOCK = 1024, 16


def build(directory: str, shape: dict, device: str, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=False,
                                      **shape)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(os.path.join(directory, "hf"))
    convert_hf_to_megalite(os.path.join(directory, "hf"), os.path.join(directory, "ckpt"))
    return model.to(device, dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def attention_paths(work, shape: dict, device: str, dtype: torch.dtype, rows: int = 128, iters: int = 10) -> None:
    """Median ms of one decode step's attention (every layer's call) on the eager and the static path."""
    layers, heads, groups = shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    contexts = [len(p) + m // 2 for p, m in work[:rows]]
    tables, used = [], 0
    for c in contexts:
        tables.append(list(range(used, used + -(-c // BLOCK))))
        used += len(tables[-1])
    pool = KVPool([1], used + 1, BLOCK, groups, d, dtype, device)  # + the scratch block
    g = torch.Generator(device).manual_seed(0)
    for cache in (pool.keys[1], pool.values[1]):
        cache.copy_(torch.randn(cache.shape, generator=g, device=device))
    n = len(contexts)
    plan = StepPlan(token_ids=[0] * n, positions=[c - 1 for c in contexts], starts=[c - 1 for c in contexts],
                    lengths=[1] * n, block_tables=tables, sample_rows=list(range(n)))
    q = torch.randn(n, 1, heads, d, generator=g, device=device).to(dtype)
    k, v = (torch.randn(n, 1, groups, d, generator=g, device=device).to(dtype) for _ in range(2))
    blocks = bucket(buckets(-(-MAX_CONTEXT // BLOCK)), max(contexts) // BLOCK + 1)

    def eager():
        step = PagedStep(pool, plan, device)
        return [step.attend(1, q, k, v, 0.0, None) for _ in range(layers)][-1]

    def static(attention):
        def step():
            packed = pack_decode(plan, BLOCK, used, n, blocks).to(device)
            cache = StaticDecodeCache(pool, packed[:, COLUMNS:], packed[:, 2], packed[:, 3], None, attention)
            return [cache.attend(1, q, k, v, 0.0, None) for _ in range(layers)][-1]
        return step

    paths = [("eager paged step (buckets, batched matmuls)", eager),
             (f"static gather + SDPA with a length mask ({blocks * BLOCK} keys)", static("sdpa"))]
    if device == "cuda" and triton_attention.available():
        paths.append(("static Triton kernel (blocks in place)", static("triton")))
    print(f"attention of one decode step ({n} sequences, contexts {min(contexts)}-{max(contexts)}, {layers} layers, "
          f"{dtype}), median of {iters}:", flush=True)
    first = None
    with torch.inference_mode():
        for name, fn in paths:
            try:
                fn()
                seconds = statistics.median(timed(fn, device)[0] for _ in range(iters))
                out = fn().float()
            except Exception as error:  # report it and go on: one GPU run should measure what works
                print(f"  {name}: FAILED: {type(error).__name__}: {error}", flush=True)
                continue
            first = first or (seconds, out)
            print(f"  {name}: {seconds * 1e3:.2f} ms ({first[0] / seconds:.2f}x of the eager path; max |difference| "
                  f"{(out - first[1]).abs().max().item():.2e})", flush=True)


def run_engine(model, work, blocks: int, max_num_seqs: int, mode: str, device: str):
    """(seconds of the timed pass, each request's tokens, graphs captured) of the engine in ``mode``."""
    config = EngineConfig(block_size=BLOCK, num_blocks=blocks, max_num_seqs=max_num_seqs,
                          cuda_graphs=mode.startswith("graphs"),
                          decode_attention="triton" if mode.endswith("triton") else "sdpa")
    llm = LLM.from_model(model, engine_config=config)
    if mode == "static":
        llm.engine.static_decode = StaticDecode.for_engine(llm.engine, graphs=False)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in work]

    def engine(requests=len(work)):
        return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in work[:requests]], params[:requests])]

    # warm-up: allocator and cuBLAS plans (a quarter of the requests), or the whole workload to capture every
    # (batch, context) bucket's graph that the timed pass replays
    warm, _ = timed(lambda: engine(len(work) if config.cuda_graphs else max(1, len(work) // 4)), device)
    seconds, out = timed(engine, device)
    static = llm.engine.static_decode
    captured = len(static.graphs) if static is not None and static.graphs is not None else 0
    return seconds, out, captured, warm


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batches", default="32,64,128")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--modes", default="eager,static,graphs,graphs-triton", help="engine modes to run (see above)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a 2-layer h=64 model (a smoke run on CPU)")
    args = parser.parse_args()
    begin = time.perf_counter()
    require("transformers", "test", "the transformers side of this benchmark")
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU (or --device cpu --tiny for a smoke run)", file=sys.stderr)
        sys.exit(2)
    modes = args.modes.split(",")
    if any(m not in ("eager", "static", "graphs", "graphs-triton") for m in modes):
        print(f"error: --modes takes eager, static, graphs and graphs-triton, got {args.modes!r}", file=sys.stderr)
        sys.exit(2)
    if device == "cpu" and any(m.startswith("graphs") for m in modes):
        print("note: no CUDA graphs on CPU; the graphs modes are skipped", flush=True)
        modes = [m for m in modes if not m.startswith("graphs")]
    shape = TINY if args.tiny else FULL
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    work = workload(args.requests, vocab=VOCAB)
    asked = sum(m for _, m in work)
    try:
        attention_paths(work, shape, device, dtype)
    except Exception as error:  # report it and go on: one GPU run should measure what works
        print(f"attention paths FAILED: {type(error).__name__}: {error}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = build(tmp, shape, device, dtype)
        model = load_model(os.path.join(tmp, "ckpt"), device).to(dtype).eval()
    best = None
    for batch in (int(b) for b in args.batches.split(",")):
        run_hf_static(hf, work[:batch], batch, device)  # warm-up at this size
        (seconds, _), outs = run_hf_static(hf, work, batch, device)
        print(f"transformers generate, batch {batch}: {seconds:.2f} s, {asked / seconds:,.0f} output tokens/s",
              flush=True)
        if best is None or seconds < best[0]:
            best = (seconds, batch, outs)
    del hf
    blocks = sum(-(-(len(p) + m) // BLOCK) for p, m in work) + 64
    engines = {}
    for mode in modes:  # graphs last: a failed capture can leave the device unusable for what follows
        try:
            seconds, out, captured, warm = run_engine(model, work, blocks, args.max_num_seqs, mode, device)
        except Exception as error:
            print(f"megalite engine, {mode}: FAILED: {type(error).__name__}: {error}", flush=True)
            continue
        engines[mode] = (seconds, out)
        graphs = f"; {captured} graphs captured in the warm-up pass ({warm:.2f} s)" if captured else ""
        print(f"megalite engine, {mode}: {seconds:.2f} s, {asked / seconds:,.0f} output tokens/s{graphs}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    where = f"{torch.cuda.get_device_name()}" if device == "cuda" else "CPU"
    for mode, (seconds, out) in engines.items():
        agree = sum(a == b for a, b in zip(out, best[2])) / len(work)
        print(f"engine ({mode}) / transformers at its best batch ({best[1]}): {best[0] / seconds:.2f}x output "
              f"tokens/s; greedy outputs agree on {agree:.0%} of requests")
    if "eager" in engines:
        for mode, (seconds, out) in engines.items():
            if mode != "eager":
                agree = sum(a == b for a, b in zip(out, engines["eager"][1])) / len(work)
                print(f"engine {mode} / eager: {engines['eager'][0] / seconds:.2f}x; greedy outputs agree on "
                      f"{agree:.0%} of requests")
    print(f"({where}, {dtype}, torch {torch.__version__}; the whole run {time.perf_counter() - begin:.0f} s)")


if __name__ == "__main__":
    main()
