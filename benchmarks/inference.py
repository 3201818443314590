"""Inference engine vs transformers generate (padded static batches), transformers continuous batching, and
megalite's old static-batch generate (run from the commit before the engine), side by side in one run.

    python benchmarks/inference.py [--requests 64] [--batches 16,32,64] [--repeats 2] [--old-commit 3b80930]
                                   [--no-hf-continuous]

Workload: ``--requests`` greedy requests with prompt lengths 16-256 and output lengths 16-128 (seeded) on a
~20M-parameter Llama-style model with random weights (built with transformers, converted to megalite).
The engine runs twice in the main comparison: as configured by default (no speculation), and with n-gram
prompt lookup proposing 4 tokens (greedy output identical; random weights make greedy text repetitive, which
favours lookup, so that row says what speculation buys here, not on a trained model).
Times are wall and CPU seconds (the machine is shared; the ratios use CPU time, and wall time too).
The static-batch baselines run at every size in ``--batches``; each is compared at its best size.  Every
system of the main comparison runs ``--repeats`` times, in rounds that run each system once (so drift of
the machine's speed falls on all alike), and keeps its fastest run (CPU time).
Output tokens/s counts the tokens each request asked for (a static batch decodes until its longest row is
done, but only requested tokens count).  Then: prefix sharing (16 prompts x n=8: prefill tokens computed
with sharing over those without) and speculative decoding (accepted tokens per target forward and speedup,
n-gram lookup on a repetitive workload, a draft model made of the target's first layers on random prompts,
and the model's own multi-token prediction layer on a small byte-level model trained briefly with MTP on the
project's synthetic corpus; ``--mtp-only`` runs that row alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from extras import require  # noqa: E402
from megalite.checkpoint.hf import convert_hf_to_megalite  # noqa: E402
from megalite.inference import LLM, EngineConfig, SamplingParams  # noqa: E402

VOCAB = 14000

OLD_RUNNER = r"""
import json, sys, time, torch
from megalite.checkpoint import load_model
from megalite.rlhf.generation import SamplingConfig, generate
ckpt, work, batch = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
torch.set_num_threads(1)
model = load_model(ckpt)
start, cpu = time.perf_counter(), time.process_time()
outs = []
for i in range(0, len(work), batch):
    group = work[i:i + batch]
    p = max(len(w[0]) for w in group)
    ids = torch.tensor([[0] * (p - len(w[0])) + w[0] for w in group])
    mask = torch.tensor([[0] * (p - len(w[0])) + [1] * len(w[0]) for w in group])
    out = generate(model, ids, mask, SamplingConfig(max_new_tokens=max(w[1] for w in group), greedy=True))
    outs += [out.tokens[j, p:p + w[1]].tolist() for j, w in enumerate(group)]
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "outputs": outs}))
"""


def build_model(directory: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(os.path.join(directory, "hf"))
    convert_hf_to_megalite(os.path.join(directory, "hf"), os.path.join(directory, "ckpt"))
    return model


def workload(n: int, seed: int = 0, vocab: int = VOCAB):
    """``n`` greedy requests (prompt ids, output tokens): prompts of 16-256 ids below ``vocab``, 16-128 outputs."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(16, 256))], rng.randint(16, 128)) for _ in range(n)]


class Clock:
    """Wall and CPU seconds (this process, all threads) of a block: on a shared, loaded machine the CPU time
    is the comparable number."""

    def __enter__(self):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.times = (time.perf_counter() - self.start, time.process_time() - self.cpu_start)


ENGINE = EngineConfig(block_size=16, num_blocks=2048)


def run_engine(ckpt, work, config=ENGINE, draft=None):
    llm = LLM(ckpt, engine_config=config, draft_model=draft)
    params = [SamplingParams(max_tokens=m, temperature=0) for _, m in work]
    with Clock() as clock:
        outputs = llm.generate([p for p, _ in work], params)
    return clock.times, [o.outputs[0].token_ids for o in outputs], llm.engine


def run_hf_static(model, work, batch, device="cpu"):
    """transformers ``generate`` over padded static batches of ``batch`` requests (on ``device``): (wall and CPU
    seconds, each request's requested tokens).  The tokens come back to the host, so a GPU has finished."""
    clock, outs = Clock().__enter__(), []
    for i in range(0, len(work), batch):
        group = work[i:i + batch]
        p = max(len(w[0]) for w in group)
        ids = torch.tensor([[0] * (p - len(w[0])) + w[0] for w in group], device=device)
        mask = torch.tensor([[0] * (p - len(w[0])) + [1] * len(w[0]) for w in group], device=device)
        new = max(w[1] for w in group)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=0, eos_token_id=None)
        outs += [out[j, p:p + w[1]].tolist() for j, w in enumerate(group)]
    clock.__exit__()
    return clock.times, outs


def run_hf_continuous(model, work):
    """transformers' generate_batch (one max_new_tokens for all: the longest asked; tokens/s counts what it made).

    Its KV pool and step budget are given the engine's sizes (16-token pages, room for every request at once,
    2048 tokens per step): left to size themselves from free memory on CPU, they exhausted this 24 GiB machine.
    """
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(m for _, m in work)
    config = transformers.GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0)
    pages = sum(-(-(len(p) + longest) // 16) for p, _ in work)
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=pages, max_batch_tokens=2048,
                                        max_requests_per_batch=len(work))
    with Clock() as clock, torch.no_grad():
        out = model.generate_batch([p for p, _ in work], generation_config=config,
                                   continuous_batching_config=batching)
    return clock.times, sum(len(o.generated_tokens) for o in out.values())


def run_old(ckpt, work, batch, commit, tmp):
    """megalite's static generate at ``commit`` in a fresh process (that commit's package, this extension)."""
    old = os.path.join(tmp, "old")
    path = os.path.join(tmp, "work.json")
    if not os.path.isdir(old):
        os.makedirs(old)
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "megalite"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
        for ext in glob.glob(os.path.join(ROOT, "megalite", "_C*.so")):
            shutil.copy(ext, os.path.join(old, "megalite"))
        with open(path, "w") as f:
            json.dump(work, f)
    env = {**os.environ, "PYTHONPATH": old, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", OLD_RUNNER, ckpt, path, str(batch)], env=env, check=True,
                         capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return (result["seconds"], result["cpu"]), result["outputs"]


def draft_from_target(ckpt, num_layers):
    """A smaller megalite GPT: the target's embedding, first ``num_layers`` layers, final norm and output layer."""
    from dataclasses import replace

    from megalite.checkpoint import load_model
    from megalite.models import GPTModel

    target = load_model(ckpt)
    draft = GPTModel(replace(target.config, num_layers=num_layers))
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.eval()


def mtp_model_trained_briefly(steps: int = 150, seq: int = 96, batch: int = 12):
    """A byte-level 4-layer model with one MTP depth, trained ``steps`` steps (AdamW) on the synthetic corpus
    (templated stories and arithmetic); returns it in eval mode and the held-out documents."""
    from megalite.data.synthetic import generate_corpus
    from megalite.models import GPTConfig, GPTModel

    docs = [d.encode() for d in generate_corpus(2000, seed=7)]
    stream = [b for d in docs[:-16] for b in d + b"\n"]
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=256, num_layers=4, hidden_size=128, num_attention_heads=4,
                               max_position_embeddings=512, position_embedding_type="rope", normalization="RMSNorm",
                               activation="swiglu", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                               mtp_num_layers=1, mtp_loss_scaling_factor=0.3, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(0)
    for _ in range(steps):
        starts = [rng.randrange(len(stream) - seq - 1) for _ in range(batch)]
        tokens = torch.tensor([stream[i:i + seq + 1] for i in starts])
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        optimizer.step()
    return model.eval(), model.mtp.last_losses, docs[-16:]


def bench_mtp_speculation():
    """Accepted tokens per target forward, speed and identical greedy output of speculative="mtp" (k=1)."""
    with Clock() as training:
        model, mtp_losses, held_out = mtp_model_trained_briefly()
    prompts = [list(d[:32]) for d in held_out]
    params = SamplingParams(max_tokens=96, temperature=0)
    results = {}
    for name, config in (("plain", EngineConfig(block_size=16, num_blocks=512)),
                         ("mtp", EngineConfig(block_size=16, num_blocks=512, speculative="mtp",
                                              num_speculative_tokens=1))):
        llm = LLM.from_model(model, engine_config=config)
        with Clock() as clock:
            outputs = llm.generate(prompts, params)
        results[name] = clock.times, [o.outputs[0].token_ids for o in outputs], llm.engine.stats
    (t_plain, plain_out, _), (t_mtp, mtp_out, stats) = results["plain"], results["mtp"]
    per_forward = stats["tokens_from_decoding"] / max(stats["target_forwards_decoding"], 1)
    print(f"speculative, the model's MTP layer (byte-level 4 layers, trained {training.times[0]:.0f}s with MTP, "
          f"last MTP loss {float(mtp_losses[0]):.2f}), held-out prompts: {per_forward:.2f} tokens per target "
          f"forward, CPU {t_plain[1]:.2f}s -> {t_mtp[1]:.2f}s ({t_plain[1] / t_mtp[1]:.2f}x; wall {t_plain[0]:.2f}s "
          f"-> {t_mtp[0]:.2f}s); outputs identical: {plain_out == mtp_out}", flush=True)


def bench_decode_attention(sequences=64, repeats=20):
    """One layer's decode attention at the workload's shapes (6 heads in 2 KV groups of 64, contexts 100-350,
    16-token blocks scattered over a 2048-block pool): the extension's paged-attention kernel beside the
    engine's plain-torch path (gather the blocks, batched matmuls, softmax).  Best of ``repeats``, CPU seconds."""
    from unittest import mock

    from megalite import kernels
    from megalite.inference.paged_cache import KVPool, PagedStep, StepPlan

    if not kernels.paged_attention_fused(torch.zeros(1)):
        print("decode attention: the extension is not built; nothing to compare")
        return
    rng = random.Random(2)
    torch.manual_seed(2)
    pool = KVPool([1], 2048, 16, 2, 64, torch.float32, "cpu")
    for cache in (pool.keys[1], pool.values[1]):
        cache.normal_()
    free = list(range(2048))
    rng.shuffle(free)
    plan = StepPlan()
    for _ in range(sequences):
        context = rng.randint(100, 350)
        blocks = -(-context // 16)
        plan.block_tables.append([free.pop() for _ in range(blocks)])
        plan.starts.append(context - 1)
        plan.lengths.append(1)
    q, k, v = torch.randn(sequences, 1, 6, 64), torch.randn(sequences, 1, 2, 64), torch.randn(sequences, 1, 2, 64)

    kernel_applies = kernels.paged_attention_fused

    def best(fused):
        with mock.patch.object(kernels, "paged_attention_fused", lambda *t: fused and kernel_applies(*t)):
            times, out = [], None
            for _ in range(repeats):
                start = time.process_time()
                out = PagedStep(pool, plan, "cpu").attend(1, q, k, v, 0.0, None)
                times.append(time.process_time() - start)
        return min(times), out

    (t_kernel, out_kernel), (t_gather, out_gather) = best(True), best(False)
    print(f"decode attention, {sequences} sequences, one layer: kernel {t_kernel * 1e3:.2f} ms, gather path "
          f"{t_gather * 1e3:.2f} ms ({t_gather / t_kernel:.2f}x); max difference "
          f"{(out_kernel - out_gather).abs().max().item():.1e}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batches", default="16,32,64",
                        help="static batch sizes for the padded baselines (each is compared at its best)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system; the fastest counts")
    parser.add_argument("--old-commit", default="3b80930")
    parser.add_argument("--no-hf-continuous", action="store_true",
                        help="skip transformers' generate_batch (about a minute on CPU at 64 requests)")
    parser.add_argument("--mtp-only", action="store_true", help="only the MTP speculation row (a few minutes: it trains its model)")
    args = parser.parse_args()
    if args.mtp_only:
        torch.set_num_threads(1)
        bench_mtp_speculation()
        return
    require("transformers", "hf", "this benchmark (transformers builds its model and is its baseline)")
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="megalite_inference_bench_")
    try:
        hf = build_model(tmp)
        ckpt = os.path.join(tmp, "ckpt")
        params = sum(p.numel() for p in hf.parameters())
        work = workload(args.requests)
        useful = sum(m for _, m in work)
        print(f"model: Llama-style, {params / 1e6:.1f}M parameters; {len(work)} requests, "
              f"{sum(len(p) for p, _ in work)} prompt tokens, {useful} output tokens; 1 thread")

        # The systems run in rounds, each once per round, so that the machine's drift over the minutes this takes
        # falls on all of them alike; each keeps its fastest run (CPU time).
        batches = [int(b) for b in args.batches.split(",")]
        baselines = {"transformers generate": lambda b: run_hf_static(hf, work, b),
                     f"megalite static generate at {args.old_commit}":
                         lambda b: run_old(ckpt, work, b, args.old_commit, tmp)}
        plain, ngram = "megalite engine", "megalite engine, n-gram speculation (k=4)"
        engines = {plain: ENGINE, ngram: dataclasses.replace(ENGINE, speculative="ngram", num_speculative_tokens=4)}
        engine_stats = {}

        def engine_run(name, config):
            times, outs, engine = run_engine(ckpt, work, config)
            engine_stats[name] = engine.stats
            return times, outs

        systems = [(name, None, functools.partial(engine_run, name, config)) for name, config in engines.items()]
        systems += [(name, batch, functools.partial(run, batch))
                    for name, run in baselines.items() for batch in batches]
        fastest = {}
        for round_ in range(args.repeats):
            for name, batch, run in systems:
                times, outs = run()
                print(f"round {round_ + 1}: {name}{'' if batch is None else f', batch {batch}'}: "
                      f"{times[1]:.2f} CPU s", flush=True)
                if (name, batch) not in fastest or times[1] < fastest[name, batch][0][1]:
                    fastest[name, batch] = (times, outs)
        t_engine, engine_out = fastest[plain, None]
        print(f"{'system':60s} {'wall s':>8s} {'CPU s':>8s} {'tok/CPU s':>9s} {'x (CPU)':>8s} {'x (wall)':>8s} "
              f"{'same':>6s}")

        def row(name, times, outs=None, tokens=useful):
            wall, cpu = times
            same = "" if outs is None else f"{sum(a == b for a, b in zip(engine_out, outs))}/{len(work)}"
            cpu_x, wall_x = (useful / t_engine[1]) / (tokens / cpu), (useful / t_engine[0]) / (tokens / wall)
            print(f"{name:60s} {wall:8.2f} {cpu:8.2f} {tokens / cpu:9.1f} {cpu_x:8.2f} {wall_x:8.2f} {same:>6s}",
                  flush=True)

        row(plain, t_engine)
        row(ngram, *fastest[ngram, None])
        spec = engine_stats[ngram]
        print(f"n-gram speculation: {spec['tokens_from_decoding'] / max(spec['target_forwards_decoding'], 1):.2f} "
              f"tokens per target forward; {spec['steps']} steps against {engine_stats[plain]['steps']} without")
        for name in baselines:
            for batch in batches:
                times, outs = fastest[name, batch]
                row(f"{name}, static batches of {batch}", times, outs)
        for name in baselines:
            batch = min(batches, key=lambda b: fastest[name, b][0][1])
            times = fastest[name, batch][0]
            for engine in engines:
                mine = fastest[engine, None][0]
                print(f"{engine} vs {name} at its best batch ({batch}): {times[1] / mine[1]:.2f}x CPU, "
                      f"{times[0] / mine[0]:.2f}x wall")
        print("(same: greedy outputs identical to the engine's, token for token)")

        bench_decode_attention()
        rng = random.Random(1)
        system = [rng.randrange(VOCAB) for _ in range(64)]
        shared = [system + [rng.randrange(VOCAB) for _ in range(rng.randint(8, 64))] for _ in range(16)]
        llm = LLM(ckpt, engine_config=EngineConfig(block_size=16, num_blocks=1024))
        llm.generate(shared, SamplingParams(n=8, max_tokens=16, temperature=1.0, seed=0))
        unshared = 8 * sum(len(p) for p in shared)
        computed = llm.engine.scheduler.prefill_tokens
        print(f"prefix sharing, 16 prompts x n=8: prefill tokens {computed} with sharing vs {unshared} without "
              f"= {computed / unshared:.4f} (target <= {1 / 8 + 0.05:.4f})", flush=True)

        spec_work = [((list(range(100 + 7 * i, 116 + 7 * i)) * 4)[:48], 96) for i in range(8)]
        for name, spec_config, draft, items in [
                ("n-gram lookup, repetitive prompts", EngineConfig(speculative="ngram", num_speculative_tokens=4),
                 None, spec_work),
                ("draft model (target's first 4 of 6 layers), random prompts",
                 EngineConfig(speculative="draft", num_speculative_tokens=3), draft_from_target(ckpt, 4),
                 workload(8, seed=5))]:
            t_plain, plain_out, _ = run_engine(ckpt, items)
            t_spec, spec_out, spec_engine = run_engine(ckpt, items, spec_config, draft)
            stats = spec_engine.stats
            per_forward = stats["tokens_from_decoding"] / max(stats["target_forwards_decoding"], 1)
            print(f"speculative, {name}: {per_forward:.2f} tokens per target forward, CPU {t_plain[1]:.2f}s -> "
                  f"{t_spec[1]:.2f}s ({t_plain[1] / t_spec[1]:.2f}x; wall {t_plain[0]:.2f}s -> {t_spec[0]:.2f}s); "
                  f"outputs identical: {plain_out == spec_out}", flush=True)
        bench_mtp_speculation()
        if not args.no_hf_continuous:
            try:
                t_cb, made = run_hf_continuous(hf, work)
                row("transformers generate_batch (continuous batching)", t_cb, tokens=made)
            except (ImportError, AttributeError, TypeError) as error:  # installed version lacks the API: say so
                print(f"transformers continuous batching unavailable: {type(error).__name__}: {error}")
        print(f"uptime: {os.popen('uptime').read().strip()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
