"""Reference model offload, the training backend's DP/micro-batch invariance and checkpoints, and the RL trainer's
warm-up progress bar."""

import contextlib
import io
import math

import torch

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.models import GPTConfig, GPTModel
from megalite.rlhf import (PPOActorObjective, PPOConfig, ReferenceModel, TrainingBackend, policy_loss,
                                  sequence_log_probs)
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.rlhf.arithmetic import TOKENIZER
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.rlhf.trainer_models import pretrain
from megalite.testing import run_distributed
from tests.rlhf.common import VOCAB, config, padded_prompts


def test_reference_offload_keeps_weights_on_host_and_matches_actor():
    actor = GPTModel(config())
    ids, mask = padded_prompts()
    for offload in (False, True):
        reference = ReferenceModel(GPTModel(config(seed=99)), source=actor, offload=offload)
        with torch.no_grad():
            want, _ = sequence_log_probs(actor, ids, mask)
        torch.testing.assert_close(reference.log_probs(ids, mask), want, rtol=0, atol=0)
        assert not any(p.requires_grad for p in reference.parameters())
        assert all(p.device.type == "cpu" for p in reference.parameters())


def _batch(rows):
    ids, mask = padded_prompts(seed=4, b=4, p=8)
    g = torch.Generator().manual_seed(9)
    response = torch.zeros(4, 7)
    response[:, 4:] = 1
    return {"input_ids": ids[rows], "attention_mask": mask[rows], "response_mask": response[rows],
            "old_log_probs": (-torch.rand(4, 7, generator=g))[rows], "advantages": torch.randn(4, 7, generator=g)[rows],
            "ref_log_probs": (0.3 * torch.randn(4, 7, generator=g) - math.log(VOCAB))[rows],
            "is_weights": torch.rand(4, 7, generator=g)[rows]}


def _backend_rank(directory):
    for mode, kl_loss in (("token-mean", False), ("seq-mean-token-mean", False), ("seq-mean-token-sum", True)):
        backend = _check_backend(mode, kl_loss)
    _check_save_load(backend, directory)


def _new_backend(cfg, ppo):
    chunk = DistributedDataParallel(GPTModel(cfg), DDPConfig())
    return TrainingBackend(chunk, get_optimizer(OptimizerConfig(clip_grad=0.0), [chunk]), PPOActorObjective(ppo),
                           micro_batch_size=1)


def _check_save_load(backend, directory):
    """A backend loaded from save() holds the same weights and Adam state: its next update is identical."""
    backend.save(directory)
    ppo = backend.objective.config
    restored = _new_backend(config(seed=99), ppo)
    restored.load(directory)
    rows = slice(2 * topology.current().dp.rank, 2 * topology.current().dp.rank + 2)
    for b in (backend, restored):
        b.forward_backward(_batch(rows))
        b.optim_step()
    for (name, got), want in zip(restored.chunk.module.named_parameters(), backend.chunk.module.parameters()):
        assert torch.equal(got, want), name


def _check_backend(mode, kl_loss):
    """Entropy bonus, the KL loss term and IS weights included: the DP x micro-batch gradient equals the whole."""
    cfg = config()
    ppo = PPOConfig(loss_aggregation=mode, entropy_coef=0.01, use_kl_loss=kl_loss, kl_coef=0.3, kl_estimator="k3")
    plain = GPTModel(cfg)
    whole = _batch(slice(0, 4))
    log_probs, entropy = sequence_log_probs(plain, whole["input_ids"], whole["attention_mask"], with_entropy=True)
    norm = float(whole["response_mask"].sum()) if mode == "token-mean" else 4.0
    ref_loss, _ = policy_loss(log_probs, whole["old_log_probs"], whole["advantages"], whole["response_mask"], ppo, norm,
                              whole["is_weights"])
    mask = whole["response_mask"]

    def mean(x):
        if mode == "seq-mean-token-mean":
            return ((x * mask).sum(1) / mask.sum(1)).sum() / norm
        return (x * mask).sum() / norm

    total = ref_loss - 0.01 * mean(entropy)
    if kl_loss:
        d = log_probs - whole["ref_log_probs"]
        total = total + 0.3 * mean(torch.exp(-d) - 1 + d)
    total.backward()
    topo = topology.current() if topology.is_initialized() else topology.initialize()
    backend = _new_backend(cfg, ppo)
    chunk = backend.chunk
    rows = slice(2 * topo.dp.rank, 2 * topo.dp.rank + 2)
    metrics = backend.forward_backward(_batch(rows))
    assert abs(metrics["policy_loss"] - float(ref_loss)) < 1e-6
    for (name, param), ref in zip(chunk.module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(param.main_grad, ref.grad, rtol=0, atol=1e-6, msg=name)
    backend.optim_step()
    return backend


def test_backend_gradient_independent_of_micro_batches_and_dp_and_save_load(tmp_path):
    run_distributed(_backend_rank, 2, str(tmp_path), timeout=180)


def _warm_up(argv):
    """The trainer's warm-up with rank 0's stderr captured: (stderr, stdout)."""
    args = parse_args(argv)
    validate(args, 1)
    topo = topology.initialize(tp=1, pp=1)
    model_config = GPTConfig(vocab_size=TOKENIZER.vocab_size, num_layers=1, hidden_size=32, num_attention_heads=4,
                             max_position_embeddings=16, make_vocab_size_divisible_by=8)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        pretrain(args, topo, model_config, "cpu")
    return err.getvalue(), out.getvalue()


def test_warm_up_shows_a_progress_bar_and_one_summary_line():
    argv = ["--tensor-model-parallel-size", "1", "--pretrain-iters", "3", "--pretrain-global-batch-size", "4",
            "--micro-batch-size", "4", "--global-batch-size", "4"]
    [(err, out)] = run_distributed(_warm_up, 1, argv, timeout=120)
    assert "warm-up: 100%" in err and "3/3" in err and "lm_loss" in err
    assert out.startswith("warm-up: 3 steps | lm_loss ") and out.count("\n") == 1
