"""RL benchmarks: GRPO speed beside TRL's GRPOTrainer, and the same GRPO workload colocated, disaggregated 2+2 and
async (S=1).

``--part trl``: one process, one thread per side, the same model (megalite's GPT of ``--seed``, taught the answer
format for ``--format-steps`` steps, then converted to a Hugging Face GPT-2 for TRL with megalite's converter; the
script checks that both give the same logits), the same "a+b=" task, group size, completion length, learning rate,
reward rule, KL coefficient (k3 estimator, the reference model on both sides), fp32 without activation
recomputation (TRL's defaults bf16 and gradient checkpointing turned off) and one update per iteration:
examples/rlhf_ppo.py (in a subprocess, ``--load`` of that model) against ``trl.GRPOTrainer`` (HF ``generate`` for
rollouts), ``--rounds`` times in turns, with megalite also run with each sample as its own row in the trainer's
forwards (``--no-shared-prompt-rows``; by default a prompt's samples are one prefix-shared row).  Prints samples/s
of each side (its best round) per wall second and per CPU second of its process (the steadier figure on a loaded
machine) and the ratios, then the rollout generation alone: megalite's inference engine (the RL path: a prompt's
samples one request, its prompt prefilled once), the engine with a request per row, its static batched decoder
and HF ``generate``.  Needs ``trl`` and ``datasets`` (``pip install trl datasets``; not megalite dependencies).

``--part placement``: runs examples/rlhf_ppo.py three times on 4 CPU ranks (torch.distributed.run) and prints
samples/s with the per-iteration time split (generation or waiting for rollouts, log-probs,
training, weight sync) and the ratio to colocated; then syncs the example's model once from a
TP2 trainer to two rollout ranks and prints the bytes every rank moved beside the analytic amount
(each rollout rank receives its shard once, vocabulary padding excluded; each trainer rank sends
the tensors it uniquely owns once per rollout replica it serves).

    python benchmarks/rl.py [--part all|trl|placement] [--iters 20] [--global-batch-size 32] \
        [--n-samples-per-prompt 4] [--max-new-tokens 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.data.tokenizer import ByteTokenizer  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.checkpoint import save_sharded  # noqa: E402
from megalite.checkpoint.hf import convert_megalite_to_hf  # noqa: E402
from megalite.rlhf.arithmetic import TOKENIZER, pretrain_batch, problem, prompt_width  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

LR, KL_COEF = 5e-4, 0.04  # --part trl: both sides' learning rate and KL coefficient

MODES = {"colocated": ["--tensor-model-parallel-size", "2"],
         "disaggregated 2+2": ["--tensor-model-parallel-size", "2", "--rollout-world-size", "2"],
         "async S=1 (2+2)": ["--tensor-model-parallel-size", "2", "--rollout-world-size", "2", "--max-staleness", "1"]}
SPLIT = ("time_generate_s", "time_log_probs_s", "time_train_s", "time_sync_s")


def run_example(extra, args, directory, procs: int = 4, port: int = 29700) -> list[dict]:
    """examples/rlhf_ppo.py with GRPO and these flags on ``procs`` CPU ranks; its per-iteration metrics (its own
    file: the metrics logger appends, so a shared one would mix in the earlier runs' iterations)."""
    handle, metrics = tempfile.mkstemp(prefix=f"{port}-", suffix=".jsonl", dir=directory)
    os.close(handle)
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(port)]
    cmd = [sys.executable, *(launch if procs > 1 else []), os.path.join(ROOT, "examples", "rlhf_ppo.py"),
           "--advantage-estimator", "grpo", "--use-kl-loss", "--n-samples-per-prompt", str(args.n_samples_per_prompt),
           "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.iters),
           "--metrics-file", metrics, "--tensorboard-dir", "", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def _sync_rank(hidden, layers):
    """TP2 trainer (ranks 0, 1) -> two tp1 rollout replicas (ranks 2, 3): bytes moved and the analytic amount."""
    import torch.distributed as dist

    from megalite.rlhf.weight_sync import ROLLOUT, TRAINER, SyncRole, WeightSync

    tokenizer = ByteTokenizer()
    config = GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       max_position_embeddings=16, make_vocab_size_divisible_by=8)
    groups = [dist.new_group([0, 1]), dist.new_group([2]), dist.new_group([3])]
    me = dist.get_rank()
    tp_group, tp_rank, tp = (groups[0], me, 2) if me < 2 else (groups[me - 1], 0, 1)
    model = GPTModel(config, tp_group=tp_group)
    role = SyncRole(TRAINER, 0, tp_rank, tp) if me < 2 else SyncRole(ROLLOUT, me - 2, 0, 1)
    sync = WeightSync(model, role)
    sync.sync()
    unique = 0
    for name, param in model.named_parameters():
        rows = param.shape[0]
        if "word_embeddings" in name or "output_layer" in name:
            rows = max(0, min(rows, config.vocab_size - tp_rank * rows))
        if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
            unique += param[:rows].numel() * param.element_size()
    analytic = unique * 2 if me < 2 else unique
    return {"rank": me, "side": role.side, "bytes": sync.bytes_sent + sync.bytes_received, "analytic": analytic}


def gpt_config(args) -> GPTConfig:
    """The actor examples/rlhf_ppo.py builds for these flags (its weights depend only on the config's seed)."""
    return GPTConfig(vocab_size=TOKENIZER.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=4, max_position_embeddings=max(16, prompt_width(9) + args.max_new_tokens),
                     make_vocab_size_divisible_by=8, seed=args.seed)


def byte_tokenizer():
    """megalite's ByteTokenizer (ids 0..255 are bytes; eod 256, pad 257, bos 258) as a Hugging Face tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(256)}
    vocab.update({"<eod>": TOKENIZER.eod, "<pad>": TOKENIZER.pad, "<bos>": TOKENIZER.bos})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eod>", pad_token="<pad>",
                                   bos_token="<bos>")


def warmed_up_actor(args, directory: str) -> tuple[GPTModel, str]:
    """megalite's GPT for these flags, taught the "a+b=c<eod>" format as examples/rlhf_ppo.py's warm-up does
    (``--format-steps`` AdamW steps on 64 documents), so rewards vary from the first iteration; and its checkpoint."""
    torch.manual_seed(args.seed)
    model = GPTModel(gpt_config(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(args.seed)
    for _ in range(args.format_steps):
        batch = pretrain_batch(rng, 64, 9)
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1]
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:],
                                                      reduction="none")
        loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), save_sharded(os.path.join(directory, "warm"), 0, [model])


def hf_model(model: GPTModel, path: str, directory: str):
    """The checkpoint ``path`` of ``model`` converted to Hugging Face; checked to give megalite's logits."""
    import transformers

    convert_megalite_to_hf(path, os.path.join(directory, "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(directory, "hf"))
    for settings in (hf.config, hf.generation_config):  # no run tokenizer in the checkpoint: GPT-2's ids otherwise
        settings.bos_token_id, settings.eos_token_id = TOKENIZER.bos, TOKENIZER.eod
        settings.pad_token_id = TOKENIZER.pad
    ids = torch.tensor([TOKENIZER.tokenize("3+4=7")])
    with torch.no_grad():
        ours = model(ids, attention_mask=torch.ones_like(ids))[..., :TOKENIZER.vocab_size]
        theirs = hf(ids).logits[..., :TOKENIZER.vocab_size]
    gap = (ours - theirs).abs().max().item()
    if gap > 1e-4:
        raise RuntimeError(f"the converted model's logits differ from megalite's by {gap}")
    return hf


def trl_run(args, directory: str, hf) -> tuple[list[tuple[float, float]], list[float]]:
    """TRL's GRPOTrainer on the same model, prompts and settings; (wall, CPU) seconds and mean reward of each
    iteration."""
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from megalite.rlhf.rewards import arithmetic_reward

    rng = random.Random(args.seed)
    prompts = [problem(rng, 9) for _ in range(args.global_batch_size * args.iters)]
    times: list[tuple[float, float]] = []
    rewards: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            times.append((time.perf_counter() - self.start[0], time.process_time() - self.start[1]))

    def reward(prompts, completions, completion_ids, **_):
        """megalite's rule: the right answer followed by end-of-document."""
        scores = [arithmetic_reward(p, c) * (TOKENIZER.eod in ids) for p, c, ids in zip(prompts, completions,
                                                                                        completion_ids)]
        rewards.append(sum(scores) / len(scores))
        return scores

    config = GRPOConfig(output_dir=os.path.join(directory, "trl"), per_device_train_batch_size=args.global_batch_size
                        * args.n_samples_per_prompt, num_generations=args.n_samples_per_prompt,
                        max_completion_length=args.max_new_tokens, max_steps=args.iters, learning_rate=LR,
                        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, beta=KL_COEF,
                        temperature=1.0, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10 ** 6,
                        disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
                        bf16=False, gradient_checkpointing=False)  # fp32 without recomputation, as megalite runs
    trainer = GRPOTrainer(model=hf, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=byte_tokenizer(),
                          callbacks=[Clock()])
    trainer.train()
    return times, rewards


def megalite_run(args, directory: str, checkpoint: str,
                 extra=()) -> tuple[list[tuple[float, float]], list[float]]:
    """examples/rlhf_ppo.py, one process, the same settings and initial weights (and ``extra`` flags); (wall, CPU)
    seconds and mean reward of each iteration."""
    records = run_example([*extra, "--tensor-model-parallel-size", "1", "--kl-coef", str(KL_COEF), "--kl-estimator", "k3",
                           "--ppo-epochs", "1",
                           "--actor-lr", str(LR), "--load", checkpoint, "--max-new-tokens", str(args.max_new_tokens),
                           "--micro-batch-size", str(args.global_batch_size * args.n_samples_per_prompt),
                           "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
                           "--seed", str(args.seed)], args, directory, procs=1)
    return [(r["time_iteration_s"], r["time_iteration_cpu_s"]) for r in records], [r["reward"] for r in records]


UNSHARED = "megalite, unshared rows"
SIDES = (("megalite", megalite_run),
         (UNSHARED, lambda args, directory, checkpoint: megalite_run(args, directory, checkpoint,
                                                                    ["--no-shared-prompt-rows"])),
         ("trl", trl_run))
"""--part trl's sides, in turns: megalite (a prompt's samples one prefix-shared row in the trainer's forwards),
megalite with each sample its own row (``--no-shared-prompt-rows``), TRL."""


def compare_with_trl(args) -> None:
    samples = args.global_batch_size * args.n_samples_per_prompt
    print(f"GRPO vs TRL GRPOTrainer: {args.global_batch_size} prompts x {args.n_samples_per_prompt} samples, "
          f"{args.max_new_tokens} new tokens, hidden {args.hidden_size}, {args.num_layers} layers, {args.iters} "
          f"iterations (first {args.warmup} left out), one process and one thread each, in turn")
    torch.set_num_threads(1)
    rates, rewards = {"wall": {}, "cpu": {}}, {}
    with tempfile.TemporaryDirectory() as directory:
        model, checkpoint = warmed_up_actor(args, directory)
        hf = hf_model(model, checkpoint, directory)
        generation = rollout_seconds(args, model, hf)
        initial = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
        for _ in range(args.rounds):  # the sides take turns, so a change in the machine's load hits both
            for name, run in SIDES:
                hf.load_state_dict(initial)  # every TRL round starts from the same weights, as megalite's do
                times, rewards[name] = run(args, directory, hf if name == "trl" else checkpoint)
                for clock, seconds in zip(("wall", "cpu"), zip(*times[args.warmup:])):
                    rates[clock].setdefault(name, []).append(samples * len(seconds) / sum(seconds))
    print(f"{'':<24}{'samples/s':>10}{'per CPU s':>10}{'reward, first and last 5 iterations':>38}"
          f"   samples/s (wall | CPU) of each round")
    best = {clock: {name: max(values) for name, values in by_name.items()} for clock, by_name in rates.items()}
    for name in best["wall"]:
        first, last = (sum(part) / len(part) for part in (rewards[name][:5], rewards[name][-5:]))
        print(f"{name:<24}{best['wall'][name]:>10.1f}{best['cpu'][name]:>10.1f}{first:>24.3f}{last:>14.3f}   "
              + " ".join(f"{wall:.1f} | {cpu:.1f}" for wall, cpu in zip(rates["wall"][name], rates["cpu"][name])))
    for clock in ("wall", "cpu"):
        print(f"ratio megalite / trl by {clock} time (best round of each): "
              f"{best[clock]['megalite'] / best[clock]['trl']:.2f} (unshared rows: "
              f"{best[clock][UNSHARED] / best[clock]['trl']:.2f})")
    print(f"\nrollout generation alone ({samples} samples, the same prompts; median seconds per call, sides "
          "alternating)")
    for name, seconds in generation.items():
        print(f"{name:<36}{seconds:>9.4f}")


def rollout_seconds(args, model: GPTModel, hf) -> dict[str, float]:
    """Median seconds of one rollout generation of the iteration's samples (``--global-batch-size`` prompts x
    ``--n-samples-per-prompt``): megalite's RL path (the persistent inference engine, a prompt's samples one
    request), megalite's static batched decoder, and Hugging Face ``generate`` (what TRL calls)."""
    from megalite.rlhf.generation import RolloutEngine, SamplingConfig, generate
    from megalite.rlhf.rollouts import left_pad

    rng = random.Random(args.seed)
    prompts = [TOKENIZER.tokenize(p) for p in [problem(rng, 9) for _ in range(args.global_batch_size)]
               for _ in range(args.n_samples_per_prompt)]  # each prompt's samples in consecutive rows, as RL lays out
    ids, mask = left_pad(prompts, TOKENIZER.pad, prompt_width(9))
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod, pad_id=TOKENIZER.pad)
    engine, per_row = RolloutEngine(model), RolloutEngine(model, share_prompts=False)
    sides = {"megalite inference engine (RL's)": lambda g: engine.generate(ids, mask, sampling, g),
             "megalite engine, a request per row": lambda g: per_row.generate(ids, mask, sampling, g),
             "megalite static decoder": lambda g: generate(model, ids, mask, sampling, g),
             "HF generate (TRL's)": lambda g: hf.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                                          max_new_tokens=args.max_new_tokens, top_k=0)}
    times = {name: [] for name in sides}
    with torch.no_grad():
        for call in range(12):
            for name in (list(sides) if call % 2 else list(reversed(sides))):
                torch.manual_seed(call)
                start = time.perf_counter()
                sides[name](torch.Generator().manual_seed(call))
                if call >= 2:
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}




def compare_placements(args) -> None:
    samples = args.global_batch_size * args.n_samples_per_prompt
    print(f"GRPO, {args.global_batch_size} prompts x {args.n_samples_per_prompt} samples per iteration, "
          f"{args.iters} iterations on 4 CPU ranks ({torch.get_num_threads()} threads each unless OMP says otherwise)")
    print(f"{'mode':<20}{'samples/s':>10}{'ratio':>7}" + "".join(f"{k[5:-2]:>11}" for k in SPLIT)
          + f"{'iter s':>9}{'final reward':>14}")
    base = None
    with tempfile.TemporaryDirectory() as directory:
        for port, (mode, extra) in enumerate(MODES.items(), start=29700):
            records = run_example(["--pretrain-iters", "40", *extra], args, directory, port=port)[args.warmup:]
            iteration = sum(r["time_iteration_s"] for r in records) / len(records)
            rate = samples / iteration
            base = base or rate
            split = [sum(r.get(k, 0.0) for r in records) / len(records) for k in SPLIT]
            reward = sum(r["reward"] for r in records[-5:]) / min(5, len(records))
            print(f"{mode:<20}{rate:>10.1f}{rate / base:>7.2f}" + "".join(f"{v:>11.3f}" for v in split)
                  + f"{iteration:>9.3f}{reward:>14.3f}")
    print("\nweight sync, example model (hidden 64, 2 layers), TP2 trainer -> 2 x tp1 rollout replicas:")
    print(f"{'rank':>5}{'side':>9}{'bytes':>12}{'analytic':>12}{'ratio':>7}")
    for r in run_distributed(_sync_rank, 4, 64, 2, timeout=300):
        print(f"{r['rank']:>5}{r['side']:>9}{r['bytes']:>12}{r['analytic']:>12}{r['bytes'] / r['analytic']:>7.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "trl", "placement"), default="all")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--n-samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=3, help="--part trl: completion tokens")
    p.add_argument("--hidden-size", type=int, default=64, help="--part trl")
    p.add_argument("--num-layers", type=int, default=2, help="--part trl")
    p.add_argument("--seed", type=int, default=1234, help="--part trl: the model's and the prompts' seed")
    p.add_argument("--format-steps", type=int, default=60,
                   help="--part trl: steps teaching the answer format before RL")
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the averages")
    p.add_argument("--rounds", type=int, default=2, help="--part trl: runs of each side, in turns; the best counts")
    args = p.parse_args()
    if args.part in ("all", "trl"):
        compare_with_trl(args)
    if args.part in ("all", "placement"):
        compare_placements(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
