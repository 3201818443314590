"""LoRA step memory vs full fine-tuning, megalite beside PEFT on the same model, one run.

Builds one megalite Llama-style model, converts it to Hugging Face (the peer runs the same weights),
and runs one training step (forward, backward, AdamW step) four ways: megalite full fine-tuning,
megalite LoRA, transformers full fine-tuning, PEFT LoRA (same rank, alpha and target layers).  Step
memory is counted, not sampled (RSS on a shared machine is noise): weights + gradients + AdamW state
+ the tensors autograd saves for backward (each storage once).  Prints each side's bytes, step time,
and LoRA/full per side, then megalite's ratio over PEFT's.

    python benchmarks/lora_memory.py [--hidden 256] [--layers 4] [--seq-length 256] [--batch 4] [--rank 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from extras import require  # noqa: E402

from megalite.checkpoint.hf import megalite_to_hf, write_hf_tensors  # noqa: E402
from megalite.lora import LoRAConfig, apply_lora  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def step_memory(model, trainable, loss_fn) -> tuple[dict, float]:
    """Counted bytes of one AdamW step over ``trainable``, and its wall time."""
    storages, saved = set(), [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in storages:
            storages.add(key)
            saved[0] += t.untyped_storage().nbytes()
        return t

    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    weights = {p.data_ptr(): p for p in [*model.parameters(), *trainable]}.values()
    parts = {"weights": _nbytes(weights), "grads": _nbytes(p.grad for p in trainable),
             "optimizer": _nbytes(state), "activations": saved[0]}
    parts["total"] = sum(parts.values())
    return parts, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    require("peft", "test", "the PEFT comparison")
    require("transformers", "hf", "the PEFT comparison")
    import peft
    import transformers

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.hidden // 64, ffn_hidden_size=4 * args.hidden,
                       max_position_embeddings=args.seq_length, position_embedding_type="rope",
                       normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                       make_vocab_size_divisible_by=1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_length + 1))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    lora_config = LoRAConfig(rank=args.rank, alpha=2 * args.rank)
    hf_config, hf_tensors = megalite_to_hf(config, dict(GPTModel(config).state_dict()))
    with tempfile.TemporaryDirectory() as directory:
        write_hf_tensors(directory, hf_tensors, 1 << 40)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(hf_config, f)

        def hf_model():
            return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).train()

        results = {}
        model = GPTModel(config).train()
        results["megalite full"] = step_memory(model, list(model.parameters()),
                                               lambda: model(input_ids=ids, labels=labels).mean())
        model = GPTModel(config).train()
        lora = apply_lora(model, lora_config)
        results["megalite LoRA"] = step_memory(model, list(lora.parameters()),
                                               lambda: model(input_ids=ids, labels=labels).mean())
        hf = hf_model()
        results["transformers full"] = step_memory(hf, list(hf.parameters()),
                                                   lambda: hf(input_ids=ids, labels=labels).loss)
        hf = peft.get_peft_model(hf_model(), peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                             target_modules=PEFT_TARGETS)).train()
        results["PEFT LoRA"] = step_memory(hf, [p for p in hf.parameters() if p.requires_grad],
                                           lambda: hf(input_ids=ids, labels=labels).loss)
    mib = 1 << 20
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq_length}, "
          f"batch {args.batch}, LoRA rank {args.rank} on all seven projections; fp32, CPU")
    print(f"{'side':18} {'weights':>9} {'grads':>9} {'AdamW':>9} {'saved act':>10} {'total':>9} {'step':>8}")
    for name, (parts, seconds) in results.items():
        print(f"{name:18} " + " ".join(f"{parts[k] / mib:8.2f}M" for k in ("weights", "grads", "optimizer"))
              + f" {parts['activations'] / mib:9.2f}M {parts['total'] / mib:8.2f}M {seconds * 1000:6.0f}ms")
    ours = results["megalite LoRA"][0]["total"] / results["megalite full"][0]["total"]
    theirs = results["PEFT LoRA"][0]["total"] / results["transformers full"][0]["total"]
    print(f"LoRA/full step memory: megalite {ours:.3f}, PEFT {theirs:.3f}; megalite LoRA / PEFT LoRA bytes "
          f"{results['megalite LoRA'][0]['total'] / results['PEFT LoRA'][0]['total']:.3f}")


if __name__ == "__main__":
    main()
