"""Post-training throughput: megalite's SFT and DPO beside TRL's SFTTrainer and DPOTrainer, one run.

One small Llama-style model is made with transformers (random weights, seeded) and converted with megalite's
converter, so both sides train the same weights; both read the same synthetic chat data (conversations for
SFT, preference pairs for DPO) rendered with the same tokenizer and TRL's ``qwen2_5_training`` chat template
(loss on assistant tokens only), with the same rows per step, sequence length, steps, learning rate and
thread count.

- SFT: megalite packs conversations into ``--seq-length`` rows with document-aware attention
  (``examples/sft.py``); TRL packs with its default best-fit-decreasing strategy, which makes its batches
  padding-free (flattened, positions restarting per conversation).  tokens/s counts real (non-padding) tokens.
- DPO: megalite packs each pair into one row (one forward, ``examples/dpo.py``): the shared prefix once, then
  chosen, then rejected (a prefix-sharing tree mask), in a ``--seq-length`` set to the shortest that holds every
  pair unshared, and cuts each batch after its last labelled token; TRL pads chosen and rejected to the longest
  in the batch and runs them as ``2 x batch`` rows.  Both run the frozen reference on the fly.

Both sides run in this process on one CPU thread.  Each step is timed in wall and CPU time (megalite: around
the trainer's ``train_step``; TRL: from one step end to the next) and the mean over the ``--steps`` after the
``--warmup`` is reported; on a shared machine the CPU time is the steadier figure.  The losses are checked where
they are comparable: DPO starts at log 2 on both sides (policy = reference), and TRL's first SFT loss is
recomputed by megalite's model on TRL's first batch.

    python benchmarks/post_training.py [--hidden 256] [--layers 4] [--seq-length 512] [--batch 4] [--steps 8]
        [--lora-rank 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import random
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from extras import require  # noqa: E402

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _words(n: int) -> str:
    return " ".join(NUMBERS[int(d)] for d in str(n))


def make_data(count: int, seed: int) -> tuple[list[list[dict]], list[dict]]:
    """``count`` conversations (a quarter multi-turn, lengths varying ~8x) and ``count`` preference pairs."""
    rng = random.Random(seed)
    system = {"role": "system", "content": "you are a careful calculator. answer in words."}
    conversations, pairs = [], []
    for _ in range(count):
        terms = [rng.randint(1, 999) for _ in range(rng.randint(2, 6))]
        question = f"add {', '.join(str(t) for t in terms)}."
        answer = f"the sum is {sum(terms)}, that is {_words(sum(terms))}."
        messages = [system, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.25:
            double = 2 * sum(terms)
            messages += [{"role": "user", "content": "and twice that?"},
                         {"role": "assistant", "content": f"twice is {double}, that is {_words(double)}."}]
        conversations.append(messages)
        wrong = sum(terms) + rng.choice([-10, -1, 1, 10])
        pairs.append({"prompt": [system, {"role": "user", "content": question}],
                      "chosen": [{"role": "assistant", "content": answer}],
                      "rejected": [{"role": "assistant", "content": f"the sum is {wrong}, that is {_words(wrong)}."}]})
    return conversations, pairs


def make_model(directory: pathlib.Path, args) -> tuple[str, str]:
    """A character-level tokenizer with TRL's Qwen 2.5 training template, and a random Llama of that
    vocabulary saved beside it (the Hugging Face directory), converted to megalite (the second path)."""
    import transformers

    from megalite.checkpoint.hf import convert_hf_to_megalite
    from tests.data.sft_fixtures import chat_tokenizer
    from tests.inference.chat_fixtures import trl_template

    tokenizer = chat_tokenizer(directory, "qwen2_5", trl_template("qwen2_5_training"))._tok
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = trl_template("qwen2_5_training")
    hf_dir = str(directory / "hf")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
        max_position_embeddings=args.seq_length, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    megalite_dir = str(directory / "megalite")
    convert_hf_to_megalite(hf_dir, megalite_dir)
    return hf_dir, megalite_dir


def run_megalite(script: str, data_flags: list[str], hf_dir: str, megalite_dir: str, workdir: pathlib.Path,
                 args, seq_length: int) -> tuple[list[tuple[float, float]], list[dict]]:
    """``examples/<script>.py``'s main() in this process, on one rank, with rows of ``seq_length`` tokens:
    ``(wall and CPU seconds of each training step, per-iteration metrics)``."""
    import runpy

    from megalite import topology
    from megalite.training.trainer import Trainer

    metrics = workdir / f"{script}.jsonl"
    argv = [*data_flags, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir,
            "--load", megalite_dir, "--finetune", "--use-checkpoint-args", "--seq-length", str(seq_length),
            "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
            "--train-iters", str(args.warmup + args.steps), "--lr", str(args.lr), "--lr-warmup-fraction", "0",
            "--lr-decay-style", "constant", "--weight-decay", "0", "--split", "100,0,0", "--eval-interval", "0",
            "--log-interval", "1", "--metrics-file", str(metrics), "--tensorboard-dir", ""]
    if args.lora_rank:
        argv += ["--lora-rank", str(args.lora_rank), "--lora-alpha", str(2 * args.lora_rank)]
    steps, train_step = [], Trainer.train_step

    def timed(self, *a, **k):
        wall, cpu = time.perf_counter(), time.process_time()
        out = train_step(self, *a, **k)
        steps.append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    Trainer.train_step = timed
    try:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            runpy.run_path(os.path.join(ROOT, "examples", f"{script}.py"))["main"](argv)
    finally:
        Trainer.train_step = train_step
        topology.destroy()
    with open(metrics) as f:
        return steps, [r for r in map(json.loads, f) if "loss" in r]


def megalite_sft_tokens(conversations, hf_dir: str, args) -> list[int]:
    """Real (non-padding) tokens of each global batch megalite's SFT run reads (its packing, in order)."""
    from megalite.data.sft import ChatRenderer, SFTDataset
    from megalite.data.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(hf_dir)
    renderer = ChatRenderer(tokenizer)
    dataset = SFTDataset([renderer.render(c) for c in conversations], args.seq_length, tokenizer.pad)
    rows = [int((dataset[i]["tokens"][:-1] != tokenizer.pad).sum()) for i in range(len(dataset.samples))]
    steps = args.warmup + args.steps
    return [sum(rows[(s * args.batch + j) % len(rows)] for j in range(args.batch)) for s in range(steps)]


def megalite_dpo_seq_length(pairs, hf_dir: str) -> int:
    """The shortest ``--seq-length`` that holds every pair packed without sharing (prompt twice, chosen, rejected);
    megalite's prefix-shared rows are cut to each batch's longest, as TRL pads to the longest of each batch."""
    from megalite.data.sft import ChatRenderer, conversation_from_record
    from megalite.data.tokenizer import HuggingFaceTokenizer

    renderer = ChatRenderer(HuggingFaceTokenizer(hf_dir))
    return max(sum(len(renderer.render(conversation_from_record({"prompt": p["prompt"], "completion": p[key]}))[0])
                   for key in ("chosen", "rejected")) for p in pairs) - 1


class StepClock:
    """A transformers TrainerCallback body: the wall and CPU time of each step end, and each step's logged loss."""

    def __init__(self):
        self.ends, self.losses = [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append((time.perf_counter(), time.process_time()))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _trl_trainer(kind: str, hf_dir: str, dataset, args, workdir: pathlib.Path):
    """TRL's SFTTrainer or DPOTrainer on the Hugging Face model, with a callback timing its steps and a record
    of the tokens in each batch."""
    import transformers
    import trl

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    common = dict(output_dir=str(workdir / kind), per_device_train_batch_size=args.batch, max_steps=args.warmup
                  + args.steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                  fp16=False, gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True, seed=0,
                  max_length=args.seq_length)
    clock = StepClock()
    callback = type("Clock", (transformers.TrainerCallback,), {
        "on_step_end": lambda self, *a, **k: clock.on_step_end(*a, **k),
        "on_log": lambda self, *a, **k: clock.on_log(*a, **k)})()
    batches = []

    def recording(base):
        class Recording(base):
            def compute_loss(self, model, inputs, *a, **k):
                batches.append({key: value.detach().clone() for key, value in inputs.items()
                                if torch.is_tensor(value)})
                return super().compute_loss(model, inputs, *a, **k)
        return Recording

    lora = {}
    if args.lora_rank:  # the same adapters: megalite's four fused layers are these seven projections
        import peft

        lora["peft_config"] = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, task_type="CAUSAL_LM",
                                              target_modules=PEFT_TARGETS)
    if kind == "sft":
        config = trl.SFTConfig(**common, packing=True, assistant_only_loss=True)
        trainer = recording(trl.SFTTrainer)(model=model, args=config, train_dataset=dataset,
                                            processing_class=tokenizer, callbacks=[callback], **lora)
    else:
        config = trl.DPOConfig(**common, beta=args.beta)
        trainer = recording(trl.DPOTrainer)(model=model, args=config, train_dataset=dataset,
                                            processing_class=tokenizer, callbacks=[callback], **lora)
    return trainer, clock, batches


def run_trl(kind: str, hf_dir: str, dataset, args, workdir: pathlib.Path):
    """``(wall and CPU seconds of each step after the first, per-step losses, recorded batches)`` of one TRL run."""
    trainer, clock, batches = _trl_trainer(kind, hf_dir, dataset, args, workdir)
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        trainer.train()
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(clock.ends, clock.ends[1:])]
    return steps, clock.losses, batches


@torch.no_grad()
def megalite_loss_on_trl_batch(megalite_dir: str, batch: dict) -> float:
    """megalite's model's loss on TRL's first (flattened, padding-free) SFT batch: the mean over the assistant
    tokens, with attention and positions restarting where TRL's ``position_ids`` restart."""
    from megalite.checkpoint import load_model

    model = load_model(megalite_dir).eval()
    ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    documents = torch.cumsum((positions == 0).long(), dim=-1)[:, :-1]
    per_token = model(ids[:, :-1], ids[:, 1:], position_ids=positions[:, :-1], document_ids=documents)
    mask = (labels[:, 1:] != -100).float()
    return float((per_token * mask).sum() / mask.sum())


def _mean(values) -> float:
    return sum(values) / len(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="rows (SFT) or pairs (DPO) per step, on both sides")
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters (alpha 2 x rank) on every projection instead of every weight: "
                             "megalite's --lora-rank, TRL with a PEFT LoraConfig (DPO's reference is then the base "
                             "with the adapters disabled on both sides)")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.lora_rank < 0:
        parser.error("--warmup and --steps must be at least 1, --lora-rank at least 0")
    torch.set_num_threads(1)
    require("trl", "test", "the TRL comparison")
    if args.lora_rank:
        require("peft", "test", "the LoRA comparison")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    conversations, pairs = make_data(args.conversations, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        hf_dir, megalite_dir = make_model(workdir, args)
        with open(workdir / "chats.jsonl", "w") as f:
            f.writelines(json.dumps({"messages": m}) + "\n" for m in conversations)
        with open(workdir / "pairs.jsonl", "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in pairs)
        results = {}

        def record(task, side, steps, amounts, loss):
            """Mean wall and CPU seconds per timed step, and the amount (tokens or pairs) per timed step."""
            timed = steps[-args.steps:]
            results[task, side] = (_mean([w for w, _ in timed]), _mean([c for _, c in timed]),
                                   _mean(amounts[-args.steps:]), loss)

        steps, ours = run_megalite("sft", ["--sft-data", str(workdir / "chats.jsonl")], hf_dir, megalite_dir, workdir,
                                   args, args.seq_length)
        record("sft", "megalite", steps, megalite_sft_tokens(conversations, hf_dir, args), ours[0]["loss"])
        steps, losses, batches = run_trl("sft", hf_dir, datasets.Dataset.from_list(
            [{"messages": m} for m in conversations]), args, workdir)
        record("sft", "TRL", steps, [int(b["input_ids"].numel()) for b in batches], losses[0])
        trl_first_by_megalite = megalite_loss_on_trl_batch(megalite_dir, batches[0])

        dpo_seq = megalite_dpo_seq_length(pairs, hf_dir)
        steps, ours = run_megalite("dpo", ["--pref-data", str(workdir / "pairs.jsonl"), "--beta", str(args.beta)],
                                   hf_dir, megalite_dir, workdir, args, dpo_seq)
        record("dpo", "megalite", steps, [args.batch] * len(steps), ours[0]["loss"])
        steps, losses, _ = run_trl("dpo", hf_dir, datasets.Dataset.from_list(pairs), args, workdir)
        record("dpo", "TRL", steps, [args.batch] * len(steps), losses[0])

    params = 4 * args.hidden * args.hidden * 3 // 2 + 3 * args.hidden * int(2.75 * args.hidden)
    print(f"model: Llama-style, hidden {args.hidden}, {args.layers} layers (~{params * args.layers / 1e6:.1f}M "
          f"parameters in the layers), character vocabulary; seq {args.seq_length}, {args.batch} rows/pairs per "
          f"step, {args.warmup} warm-up + {args.steps} timed steps; fp32, one CPU thread per side; "
          + (f"LoRA rank {args.lora_rank} on every projection" if args.lora_rank else "every weight trained"))
    print(f"{'':13} {'wall/step':>10} {'CPU/step':>9} {'per wall s':>11} {'per CPU s':>10} {'first loss':>11}")
    for (task, side), (wall, cpu, amount, loss) in results.items():
        print(f"{task} {side:9} {wall * 1000:8.0f}ms {cpu * 1000:7.0f}ms {amount / wall:11.2f} {amount / cpu:10.2f} "
              f"{loss:11.4f}")
    print(f"(SFT: real tokens; DPO: pairs, megalite's rows the shared prefix once, cut to each batch's longest, "
          f"at most {dpo_seq} tokens)")
    rows = args.batch * args.seq_length
    print(f"SFT rows filled with real tokens: megalite {results['sft', 'megalite'][2] / rows:.1%} (packed in file "
          f"order), TRL {results['sft', 'TRL'][2] / rows:.1%} (best-fit decreasing)")
    print(f"SFT: TRL's first loss {results['sft', 'TRL'][3]:.4f}; megalite's model on TRL's first batch "
          f"{trl_first_by_megalite:.4f}")
    print(f"DPO: first losses {results['dpo', 'megalite'][3]:.4f} (megalite), {results['dpo', 'TRL'][3]:.4f} (TRL); "
          f"log 2 = {math.log(2):.4f}")
    for task, unit in (("sft", "tokens/s"), ("dpo", "pairs/s")):
        ours, theirs = results[task, "megalite"], results[task, "TRL"]
        print(f"megalite / TRL, {task.upper()} {unit}: {(ours[2] / ours[0]) / (theirs[2] / theirs[0]):.2f}x by wall "
              f"time, {(ours[2] / ours[1]) / (theirs[2] / theirs[1]):.2f}x by CPU time")


if __name__ == "__main__":
    main()
