"""A training step (forward + backward, fp32) of each dense Hugging Face family: megalite vs transformers' own class.

    python benchmarks/models.py [--families llama,qwen2,qwen3,mistral] [--hidden 512] [--layers 2]
                                [--seq-length 256] [--batch 4] [--repeats 5] [--threads 1]

Each family's model is built with transformers (random weights, a GEMM-bound size), converted to megalite,
and both run the same batch: transformers' ``ForCausalLM(input_ids, labels=...)`` loss, megalite's
``GPTModel(input_ids, labels=...)`` per-token loss averaged, then ``backward()``.  Their first losses must
agree (1e-5 relative), so both compute the same function.  The two run in alternating rounds (drift of a
shared machine falls on both) and each keeps its fastest step; printed: tokens/s of each and the time ratio
megalite / transformers (below 1: megalite is faster).
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
    return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))


def timed(step) -> float:
    """Wall seconds of one call of ``step``."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="llama,qwen2,qwen3,mistral")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
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
