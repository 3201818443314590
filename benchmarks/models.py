"""A training step (forward + backward, fp32) of each dense Hugging Face family: megalite vs transformers' own class;
and (``--part convert``) the streaming conversion of a synthetic ~1B Qwen3 checkpoint both ways.

    python benchmarks/models.py [--families llama,qwen2,qwen3,mistral] [--hidden 512] [--layers 2]
                                [--seq-length 256] [--batch 4] [--repeats 5] [--threads 1]
    python benchmarks/models.py --part convert [--hidden 2048] [--layers 16] [--max-shard-size 500MB]

Each family's model is built with transformers (random weights, a GEMM-bound size), converted to megalite,
and both run the same batch: transformers' ``ForCausalLM(input_ids, labels=...)`` loss, megalite's
``GPTModel(input_ids, labels=...)`` per-token loss averaged, then ``backward()``.  Their first losses must
agree (1e-5 relative), so both compute the same function.  The two run in alternating rounds (drift of a
shared machine falls on both) and each keeps its fastest step by CPU time; printed: tokens per CPU second of
each and the time ratio megalite / transformers (below 1: megalite is faster).  Mistral runs with a sliding
window of half the sequence, so its row measures windowed attention.

``--part convert`` writes a Qwen3-1.7B-shaped checkpoint (random bf16 weights, vocabulary 151936, tied embeddings,
``--layers`` layers: 16 give 1.1B parameters) as 2 GB safetensors shards, then runs ``tools/convert_checkpoint.py``
HF -> megalite and megalite -> HF in child processes; printed: each one's wall time and peak resident set
(the child's ``VmHWM``), beside the model's size, its largest layer and the peak of the same tool converting a 1-layer model
(the interpreter, torch and the tool's imports).
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


def build(family: str, hidden: int, layers: int, seq: int, vocab: int):
    """The transformers model of ``family`` at the benchmark size (Qwen3: head dim 64 at hidden/heads 64)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                  num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                  max_position_embeddings=max(seq, 1024), attention_dropout=0.0)
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        return transformers.LlamaForCausalLM(config)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=64))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=seq // 2))


def write_qwen3(path: str, hidden: int, layers: int, vocab: int = 151936) -> tuple[int, int]:
    """A synthetic Qwen3 checkpoint (Qwen3-1.7B's shapes: head dim 128, kv heads half the heads, ffn 3 x hidden,
    tied embeddings) of ``layers`` layers; returns (total bytes, largest layer's bytes)."""
    import transformers

    from megalite.checkpoint.hf import write_hf_tensors

    heads, ffn = hidden // 128, 3 * hidden
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads // 2, head_dim=128, max_position_embeddings=4096,
                                      tie_word_embeddings=True, dtype="bfloat16")
    kv = heads // 2 * 128
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
             "self_attn.q_norm.weight": (128,), "self_attn.k_norm.weight": (128,),
             "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
             "mlp.down_proj.weight": (hidden, ffn)}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              **{f"model.layers.{i}.{name}": shape for i in range(layers) for name, shape in layer.items()}}
    os.makedirs(path)
    generator = torch.Generator().manual_seed(0)
    write_hf_tensors(path, ((name, torch.randn(shape, generator=generator).bfloat16())
                            for name, shape in shapes.items()), 2 * 10**9)
    config.save_pretrained(path)
    nbytes = {name: 2 * torch.Size(shape).numel() for name, shape in shapes.items()}
    return sum(nbytes.values()), max(nbytes["model.embed_tokens.weight"],
                                     sum(2 * torch.Size(shape).numel() for shape in layer.values()))


_MEASURED = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open("/proc/self/status") as f:
        print(next(line.split()[1] for line in f if line.startswith("VmHWM:")), file=sys.stderr)
"""
"""Runs a script and prints its peak resident set (KiB) last on stderr: the child's own, which ``ru_maxrss`` is not
(Linux carries it over ``execve`` from the parent, here the process that wrote the synthetic checkpoint)."""


def run_tool(*args: str) -> tuple[float, int]:
    """(wall seconds, peak resident bytes) of ``tools/convert_checkpoint.py args`` in a child process."""
    import subprocess

    start = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", _MEASURED, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                            *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.perf_counter() - start
    if child.returncode:
        raise SystemExit(f"error: convert_checkpoint.py {' '.join(args)} exited with {child.returncode}: "
                         f"{child.stderr.strip()}")
    return seconds, int(child.stderr.split()[-1]) * 1024


def convert_part(args) -> None:
    """Time and peak RSS of the streaming conversion of a synthetic Qwen3 checkpoint both ways."""
    require("transformers", "hf", "this benchmark (its config class writes the synthetic checkpoint's config.json)")
    gib = 2 ** 30
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        total, layer = write_qwen3(os.path.join(tmp, "hf"), args.hidden, args.layers)
        write_qwen3(os.path.join(tmp, "tiny"), 256, 1, vocab=1024)
        print(f"Qwen3 {args.layers} layers, hidden {args.hidden}: {total / 2 / 1e9:.2f}B parameters, "
              f"{total / gib:.2f} GiB bf16; largest layer {layer / gib:.2f} GiB; output shards {args.max_shard_size}")
        _, base = run_tool("--from", "hf", "--to", "megalite", "--input", os.path.join(tmp, "tiny"),
                           "--output", os.path.join(tmp, "tiny.m"))
        print(f"{'direction':16} {'seconds':>8} {'peak RSS GiB':>13} {'over a 1-layer model GiB':>25}")
        for name, source, target, extra in (("HF -> megalite", "hf", "m", ()),
                                            ("megalite -> HF", "m", "back", ("--max-shard-size", args.max_shard_size))):
            frm, to = ("hf", "megalite") if source == "hf" else ("megalite", "hf")
            seconds, peak = run_tool("--from", frm, "--to", to, "--input", os.path.join(tmp, source),
                                     "--output", os.path.join(tmp, target), *extra)
            print(f"{name:16} {seconds:8.1f} {peak / gib:13.2f} {(peak - base) / gib:25.2f}")


def timed(step) -> float:
    """CPU seconds of one call of ``step`` (this process's, every thread's): on a shared machine the wall time
    also counts the time other jobs held the cores."""
    start = time.process_time()
    step()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("step", "convert"), default="step")
    parser.add_argument("--families", default="llama,qwen2,qwen3,mistral")
    parser.add_argument("--hidden", type=int, help="default 512 (step), 2048 (convert)")
    parser.add_argument("--layers", type=int, help="default 2 (step), 16 (convert)")
    parser.add_argument("--max-shard-size", default="500MB", help="convert: the megalite -> HF output shards")
    parser.add_argument("--tmp", help="convert: the folder to write the checkpoints in (default: the system's)")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.part == "convert":
        args.hidden, args.layers = args.hidden or 2048, args.layers or 16
        return convert_part(args)
    args.hidden, args.layers = args.hidden or 512, args.layers or 2
    require("transformers", "hf", "this benchmark (transformers' model classes are its baseline)")
    from megalite.checkpoint import load_model
    from megalite.checkpoint.hf import convert_hf_to_megalite

    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_length + 1), generator=torch.Generator().manual_seed(1))
    tokens = args.batch * args.seq_length
    print(f"{args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq_length} tokens, fp32, "
          f"{args.threads} thread(s); best of {args.repeats} steps each")
    print(f"{'family':8} {'transformers tok/s':>19} {'megalite tok/s':>15} {'ratio (time)':>13}")
    for family in args.families.split(","):
        hf = build(family, args.hidden, args.layers, args.seq_length, args.vocab).train()
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(os.path.join(tmp, "hf"))
            convert_hf_to_megalite(os.path.join(tmp, "hf"), os.path.join(tmp, "ckpt"))
            ours = load_model(os.path.join(tmp, "ckpt")).train()

        def hf_step():
            hf.zero_grad(set_to_none=True)
            loss = hf(ids[:, :-1], labels=ids[:, :-1]).loss
            loss.backward()
            return loss

        def our_step():
            ours.zero_grad(set_to_none=True)
            # transformers' labels=ids shifts inside: position i predicts token i+1 of the same row
            loss = ours(ids[:, :-2], labels=ids[:, 1:-1]).mean()
            loss.backward()
            return loss

        hf_loss, our_loss = hf_step().item(), our_step().item()
        if abs(hf_loss - our_loss) > 1e-5 * abs(hf_loss):
            raise SystemExit(f"error: {family}: losses differ (transformers {hf_loss}, megalite {our_loss})")
        hf_times, our_times = [], []
        for _ in range(args.repeats):
            hf_times.append(timed(hf_step))
            our_times.append(timed(our_step))
        hf_best, our_best = min(hf_times), min(our_times)
        our_tokens = args.batch * (args.seq_length - 1)
        print(f"{family:8} {tokens / hf_best:19.0f} {our_tokens / our_best:15.0f} "
              f"{(our_best / our_tokens) / (hf_best / tokens):13.2f}")


if __name__ == "__main__":
    main()
