"""The GPT critic under tensor and pipeline parallelism equals the single-rank critic: values and every gradient."""

import torch
import torch.distributed as dist

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.rlhf import (CriticModel, PPOConfig, PPOCriticObjective, TrainingBackend, global_normalizer,
                                  pipeline_values, value_loss)
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.testing import run_distributed
from megalite.topology import device
from tests.rlhf.common import config, padded_prompts


def _full_grad(name, param, cfg, tp_group):
    """This parameter's gradient in the tp=1 layout: TP shards gathered, SwiGLU blocks regrouped, vocab padding cut.

    The padded vocabulary rows must have received no gradient.
    """
    grad = param.grad
    if not getattr(param, "tensor_model_parallel", False):
        return grad
    tp = topology.group_size(tp_group)
    parts = [torch.empty_like(grad) for _ in range(tp)]
    dist.all_gather(parts, grad.contiguous(), group=tp_group)
    if "linear_fc1" in name and cfg.activation == "swiglu":
        # Rank i holds [gate_i; up_i]; the tp=1 layout is [gate; up].
        blocks = torch.stack(parts).view(tp, 2, grad.shape[0] // 2, *grad.shape[1:])
        return blocks.transpose(0, 1).reshape(tp * grad.shape[0], *grad.shape[1:])
    full = torch.cat(parts, dim=param.partition_dim)
    if "word_embeddings" in name:
        assert not full[cfg.vocab_size:].any(), "padded vocabulary rows got a gradient"
        full = full[:cfg.vocab_size]
    return full


def _tp_rank():
    ids, mask = (t.to(device()) for t in padded_prompts())
    weights = torch.linspace(0.5, 1.5, ids.numel(), device=device()).view_as(ids) * mask
    references = {}
    for kind in ("gpt2", "llama"):
        reference = CriticModel(config(kind)).to(device())
        values = reference(ids, mask)
        (values * weights).sum().backward()
        references[kind] = (values.detach(), {n: p.grad for n, p in reference.named_parameters()})
    topo = topology.initialize(tp=2)
    for kind, (ref_values, ref_grads) in references.items():
        cfg = config(kind)
        critic = CriticModel(cfg).to(device())
        values = critic(ids, mask)
        (values * weights).sum().backward()
        torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5)
        assert critic.output_layer is None and values.shape == ids.shape
        params = dict(critic.named_parameters())
        assert sorted(params) == sorted(ref_grads)
        for name, param in params.items():
            got = _full_grad(name, param, cfg, topo.tp.group)
            torch.testing.assert_close(got, ref_grads[name], rtol=0, atol=1e-5, msg=f"{kind} {name}")


def test_critic_tp2_values_and_every_gradient_equal_tp1():
    run_distributed(_tp_rank, 2, timeout=180)


def _value_batch():
    ids, mask = padded_prompts(seed=3, b=4, p=8)
    g = torch.Generator().manual_seed(11)
    response = torch.zeros(4, 7)
    response[:, 3:] = 1
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response,
            "old_values": 0.05 * torch.randn(4, 7, generator=g), "returns": torch.randn(4, 7, generator=g)}


def _pp_rank():
    cfg = config()
    ppo = PPOConfig(value_clip=0.02)
    batch = {k: v.to(device()) for k, v in _value_batch().items()}
    reference = CriticModel(cfg).to(device())
    ref_values = reference(batch["input_ids"], batch["attention_mask"])
    normalizer = global_normalizer(batch["response_mask"], ppo.loss_aggregation)
    ref_loss = value_loss(ref_values[:, :-1], batch["old_values"], batch["returns"], batch["response_mask"], ppo,
                          normalizer)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    topo = topology.initialize(pp=2)
    first, last = topo.is_first_stage(), topo.is_last_stage()
    chunk = CriticModel(cfg, pre_process=first, post_process=last,
                        layer_range=(0, 1) if first else (1, 2)).to(device())
    micro_batches = [{k: batch[k][i:i + 2] for k in ("input_ids", "attention_mask")} for i in (0, 2)]
    torch.testing.assert_close(pipeline_values(chunk, micro_batches), ref_values.detach().cpu(), rtol=0, atol=1e-5)

    ddp = DistributedDataParallel(chunk, DDPConfig())
    backend = TrainingBackend(ddp, get_optimizer(OptimizerConfig(clip_grad=0.0), [ddp]), PPOCriticObjective(ppo),
                              micro_batch_size=2)
    metrics = backend.forward_backward(batch)
    assert abs(metrics["value_loss"] - float(ref_loss)) < 1e-6
    names = [n for n, _ in chunk.named_parameters()]
    assert names and all(n in ref_grads for n in names)
    for name, param in chunk.named_parameters():
        torch.testing.assert_close(param.main_grad, ref_grads[name], rtol=0, atol=1e-5, msg=name)
    return names


def test_critic_pp2_values_on_every_stage_and_value_loss_grads_equal_pp1():
    stage_names = run_distributed(_pp_rank, 2, timeout=180)
    first, last = (set(names) for names in stage_names)
    assert not first & last
    assert first | last == {n for n, _ in CriticModel(config()).named_parameters()}
