"""PPO on single-digit additions with a tensor/pipeline/data-parallel GPT actor and critic.

    torchrun --nproc_per_node 4 examples/rlhf_ppo.py            # TP2 x DP2 (default --tp 2)
    python examples/rlhf_ppo.py --tp 1                          # one process

The script first pretrains a small GPT on "a+b=c<eod>" problems just long
enough to learn the format and some of the sums (or loads it with ``--load``),
then runs PPO: the actor samples answers to "a+b=" prompts, the reward is 1
for a correct answer followed by end-of-document, a KL penalty to the frozen
reference model is added per token, and a GPT critic with a value head gives
GAE advantages.  With ``--use-centralized-critic`` the reward model lives on
one rank only (``--critic-owner-rank``) and scores the next iteration's
rollouts while the current iteration trains (``--critic-prefetch-depth``).
Each PPO iteration is printed and written to ``--metrics-file`` (JSON lines)
and TensorBoard (``--tensorboard-dir``, default runs/rlhf_ppo).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.data.synthetic import arithmetic_answer
from megalite.data.tokenizer import ByteTokenizer
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.models import GPTConfig, GPTModel
from megalite.rlhf import (CentralizedModel, CriticModel, LanguageModelObjective, PPOActorObjective, PPOConfig,
                                  PPOCriticObjective, Prefetcher, ReferenceModel, SamplingConfig, TrainingBackend,
                                  compute_gae, kl_penalty, pipeline_log_probs, pipeline_values, whiten)
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.pipeline import split_layers
from megalite.training.metrics import MetricsLogger


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--max-operand", type=int, default=9, help="problems are a+b with 0 <= a, b <= this")
    p.add_argument("--pretrain-iters", type=int, default=80)
    p.add_argument("--pretrain-batch-size", type=int, default=32, help="sequences per DP rank")
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--ppo-iters", type=int, default=100)
    p.add_argument("--rollout-batch-size", type=int, default=64, help="prompts per DP rank and iteration")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--actor-lr", type=float, default=5e-4)
    p.add_argument("--critic-lr", type=float, default=2e-3)
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--kl-estimator", default="k3", choices=["k1", "k2", "k3"])
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--lam", type=float, default=1.0, help="GAE lambda")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--offload-reference", action="store_true", help="keep the reference model in CPU memory")
    p.add_argument("--use-centralized-critic", action="store_true",
                   help="score rollouts with a reward model held by one rank only")
    p.add_argument("--critic-owner-rank", type=int, default=0)
    p.add_argument("--critic-prefetch-depth", type=int, default=1)
    p.add_argument("--load", default=None, help="directory of a pretrained actor saved with --save")
    p.add_argument("--save", default=None, help="save the pretrained actor here (before PPO)")
    p.add_argument("--metrics-file", default=None)
    p.add_argument("--tensorboard-dir", default="runs/rlhf_ppo")
    return p.parse_args(argv)


TOKENIZER = ByteTokenizer()


def problem(rng: random.Random, max_operand: int) -> tuple[str, str]:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    prompt = f"{a}+{b}="
    return prompt, arithmetic_answer(prompt)


def score(prompt: str, response_ids: list[int]) -> float:
    """1 for the right answer followed by end-of-document, else 0."""
    if TOKENIZER.eod not in response_ids:
        return 0.0
    answer = TOKENIZER.detokenize(response_ids[:response_ids.index(TOKENIZER.eod)])
    return float(answer == arithmetic_answer(prompt))


def score_batches(per_rank: list) -> list:
    """The reward model: scores every rank's (prompts, responses) in one call."""
    return [torch.tensor([score(p, r) for p, r in zip(prompts, responses)]) for prompts, responses in per_rank]


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def pretrain_batch(rng: random.Random, args) -> dict:
    """Right-padded "a+b=c<eod>" sequences; the loss covers the answer and end-of-document."""
    rows, answer_starts = [], []
    for _ in range(args.pretrain_batch_size):
        prompt, answer = problem(rng, args.max_operand)
        rows.append(TOKENIZER.tokenize(prompt + answer) + [TOKENIZER.eod])
        answer_starts.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [TOKENIZER.pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.zeros(len(rows), width - 1)
    for i, (row, start) in enumerate(zip(rows, answer_starts)):
        loss_mask[i, start - 1:len(row) - 1] = 1
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def build(model_cls, config, topo, lr, device):
    """This rank's DDP-wrapped pipeline chunk of ``model_cls`` and its optimizer."""
    layer_range = split_layers(config.num_layers, topo.pp.size)[topo.pp.rank][0]
    module = model_cls(config, pre_process=topo.is_first_stage(), post_process=topo.is_last_stage(),
                       layer_range=layer_range).to(device)
    chunk = DistributedDataParallel(module, DDPConfig(), topo.dp.group, topo.expert_dp.group)
    return chunk, get_optimizer(OptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0), [chunk])


class Rollouts:
    """Draws prompts, samples responses and computes old log-probs, reference log-probs and values."""

    def __init__(self, args, topo, actor, reference, critic_chunk, device):
        self.args, self.topo, self.actor, self.reference, self.critic = args, topo, actor, reference, critic_chunk
        self.device = device
        self.rng = random.Random(args.seed * 1000 + topo.dp.rank)
        self.sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod,
                                       pad_id=TOKENIZER.pad, temperature=args.temperature)

    def __iter__(self):
        for iteration in range(1, self.args.ppo_iters + 1):
            yield self.rollout(iteration)

    def _micro_batches(self, ids, mask):
        mb = self.args.micro_batch_size
        return [{"input_ids": ids[i:i + mb], "attention_mask": mask[i:i + mb]} for i in range(0, len(ids), mb)]

    def rollout(self, iteration: int) -> dict:
        prompts = [problem(self.rng, self.args.max_operand)[0] for _ in range(self.args.rollout_batch_size)]
        ids, mask = left_pad([TOKENIZER.tokenize(p) for p in prompts], TOKENIZER.pad)
        generator = torch.Generator(self.device).manual_seed(self.args.seed + 7919 * iteration + self.topo.dp.rank)
        out = self.actor.generate(ids.to(self.device), mask.to(self.device), self.sampling, generator)
        p = ids.shape[1]
        micro_batches = self._micro_batches(out.tokens, out.attention_mask)
        with self.reference.on_device() as reference:
            ref_log_probs, _ = pipeline_log_probs(reference, micro_batches, self.args.temperature)
        values = pipeline_values(self.critic, micro_batches).to(self.device)
        response_mask = torch.cat([out.response_mask.new_zeros(len(prompts), p - 1), out.response_mask], dim=1)
        old_log_probs = torch.cat([out.log_probs.new_zeros(len(prompts), p - 1), out.log_probs], dim=1)
        responses = [[int(t) for t, m in zip(row, keep) if m] for row, keep in zip(out.tokens[:, p:], out.response_mask)]
        return {"iteration": iteration, "prompts": prompts, "responses": responses, "input_ids": out.tokens,
                "attention_mask": out.attention_mask, "response_mask": response_mask.float(),
                "old_log_probs": old_log_probs, "ref_log_probs": ref_log_probs.to(self.device),
                "old_values": values[:, :-1]}


def dp_mean(value: float, topo, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=topo.dp.group)
    return float(t) / topo.dp.size


def ppo_update(rollout: dict, scores: torch.Tensor, args, topo, ppo, actor, critic, device) -> dict:
    mask = rollout["response_mask"]
    kl = kl_penalty(rollout["old_log_probs"], rollout["ref_log_probs"], ppo.kl_estimator, ppo.kl_clamp) * mask
    rewards = -ppo.kl_coef * kl
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & (mask > 0)
    rewards = rewards + last.float() * scores.to(device)[:, None]
    advantages, returns = compute_gae(rewards, rollout["old_values"], mask, ppo.gamma, ppo.lam)
    batch = {k: rollout[k] for k in ("input_ids", "attention_mask", "response_mask", "old_log_probs", "old_values")}
    batch.update(advantages=whiten(advantages, mask, topo.dp.group), returns=returns)
    for _ in range(args.ppo_epochs):
        actor_metrics = actor.forward_backward(batch)
        actor.optim_step()
        critic_metrics = critic.forward_backward(batch)
        critic.optim_step()
    kl_mean = dp_mean(float(kl.sum() / mask.sum().clamp(min=1)), topo, device)
    return {"reward": dp_mean(float(scores.mean()), topo, device), "kl": kl_mean,
            "policy_loss": actor_metrics["policy_loss"], "value_loss": critic_metrics["value_loss"],
            "clip_fraction": actor_metrics["clip_fraction"],
            "response_length": dp_mean(float(mask.sum(dim=1).mean()), topo, device)}


def pretrain(args, topo, config, device) -> DistributedDataParallel:
    """The actor chunk, pretrained here or loaded from ``--load``."""
    chunk, optimizer = build(GPTModel, config, topo, args.pretrain_lr, device)
    backend = TrainingBackend(chunk, optimizer, LanguageModelObjective(), args.micro_batch_size, topo)
    if args.load:
        backend.load(args.load)
        return chunk
    rng = random.Random(args.seed + 17 * topo.dp.rank)
    for step in range(1, args.pretrain_iters + 1):
        batch = {k: v.to(device) for k, v in pretrain_batch(rng, args).items()}
        metrics = backend.forward_backward(batch)
        backend.optim_step()
        if topo.global_rank == 0 and (step % 20 == 0 or step == args.pretrain_iters):
            print(f"pretrain step {step}/{args.pretrain_iters} | lm_loss {metrics['lm_loss']:.4f}", flush=True)
    if args.save:
        backend.save(args.save)
    return chunk


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    owns_process_group = not dist.is_initialized()
    topo = topology.initialize(tp=args.tp, pp=args.pp)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(args.seed)
    config = GPTConfig(vocab_size=TOKENIZER.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, max_position_embeddings=16,
                       make_vocab_size_divisible_by=8, seed=args.seed)
    ppo = PPOConfig(kl_coef=args.kl_coef, kl_estimator=args.kl_estimator, entropy_coef=args.entropy_coef,
                    gamma=1.0, lam=args.lam)
    start = time.monotonic()
    actor_chunk = pretrain(args, topo, config, device)
    layer_range = split_layers(config.num_layers, topo.pp.size)[topo.pp.rank][0]
    reference = ReferenceModel(GPTModel(config, pre_process=topo.is_first_stage(), post_process=topo.is_last_stage(),
                                        layer_range=layer_range).to(device),
                               source=actor_chunk, offload=args.offload_reference)
    actor = TrainingBackend(actor_chunk, get_optimizer(OptimizerConfig(lr=args.actor_lr, weight_decay=0.0,
                                                                       clip_grad=1.0), [actor_chunk]),
                            PPOActorObjective(ppo, args.temperature), args.micro_batch_size, topo)
    critic_chunk, critic_optimizer = build(CriticModel, config, topo, args.critic_lr, device)
    critic = TrainingBackend(critic_chunk, critic_optimizer, PPOCriticObjective(ppo), args.micro_batch_size, topo)
    rollouts = Rollouts(args, topo, actor, reference, critic_chunk, device)
    reward_model = None
    if args.use_centralized_critic:
        reward_model = CentralizedModel(score_batches if topo.global_rank == args.critic_owner_rank else None,
                                        owner=args.critic_owner_rank)
        stream = Prefetcher(reward_model, rollouts, args.critic_prefetch_depth,
                            inputs_of=lambda r: (r["prompts"], r["responses"]))
    else:
        stream = ((r, score_batches([(r["prompts"], r["responses"])])[0]) for r in rollouts)
    logger = MetricsLogger(topo.global_rank == 0, args.metrics_file, args.tensorboard_dir, args.ppo_iters,
                           stream=open(os.devnull, "w"))
    for rollout, scores in stream:
        metrics = ppo_update(rollout, scores, args, topo, ppo, actor, critic, device)
        logger.log(rollout["iteration"], metrics)
        if topo.global_rank == 0:
            print(f"ppo iteration {rollout['iteration']}/{args.ppo_iters} | "
                  + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
                  + f" | elapsed {time.monotonic() - start:.0f}s", flush=True)
    if reward_model is not None:
        reward_model.close()
    logger.close()
    if owns_process_group:
        topology.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
