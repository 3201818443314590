"""LoRA adapters: identity at init, TP/SP/PP/CP/DP gradients equal one rank's, adapter-only optimizer state,
errors, and batch-invariant numerics (the engine's log-probs bit for bit)."""

import pytest
import torch

from megalite import topology
from megalite.context_parallel import slice_for_rank
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.lora import LoRAConfig, apply_lora
from megalite.lora.state import adapter_layouts, global_adapters, load_global_adapters, local_shard
from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.pipeline import forward_backward, split_layers
from megalite.testing import run_distributed
from tests.rlhf.common import config as rl_config
from tests.rlhf.test_batch_invariant import _gaps

SEQ, BATCH, VOCAB = 8, 2, 64
REL = 1e-5


def _config(**overrides):
    values = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, max_position_embeddings=SEQ, position_embedding_type="rope",
                  normalization="RMSNorm", activation="swiglu", add_bias_linear=False, make_vocab_size_divisible_by=1)
    return GPTConfig(**{**values, **overrides})


def _tokens(seed=0, count=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(count)]


def _random_b(lora, seed=7):
    """Global adapters with B drawn at random (B is zero at init, which would leave A's gradient zero)."""
    g = torch.Generator().manual_seed(seed)
    tensors = global_adapters(lora)
    for name in tensors:
        if ".lora_B." in name:
            tensors[name] = torch.randn(tensors[name].shape, generator=g) * 0.1
    return tensors


def test_output_equals_base_at_init_and_only_adapters_train():
    torch.manual_seed(0)
    model = GPTModel(_config())
    ids = _tokens()[0][:, :-1]
    base = model(input_ids=ids).detach()
    lora = apply_lora(model, LoRAConfig(rank=4, alpha=8))
    assert len(list(lora.named_adapters())) == 2 * 4
    assert torch.equal(model(input_ids=ids), base)
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in lora.parameters())


def _reference(config, lora_config, batches, seed=7):
    """Global adapter grads of the mean loss over ``batches`` on one rank, and the adapters used."""
    model = GPTModel(config)
    lora = apply_lora(model, lora_config)
    tensors = _random_b(lora, seed)
    load_global_adapters(lora, tensors)
    for tokens in batches:
        (model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean() / len(batches)).backward()
    return tensors, {name: p.grad.clone() for name, p, _ in adapter_layouts(lora)}


def _max_rel_error(lora, ref_grads):
    worst = 0.0
    for name, param, _ in adapter_layouts(lora):
        ref = local_shard(lora, name, ref_grads[name])
        worst = max(worst, ((param.grad - ref).norm() / ref.norm()).item())
    return worst


def _tp_case():
    lora_config = LoRAConfig(rank=4, alpha=8, target_modules="linear_qkv,linear_proj,linear_fc1,linear_fc2")
    batches = _tokens(1)
    tensors, ref = _reference(_config(), lora_config, batches)
    topology.initialize(tp=2)
    errors = []
    for sp in (False, True):
        model = GPTModel(_config(), sequence_parallel=sp)
        lora = apply_lora(model, lora_config)
        load_global_adapters(lora, tensors)
        tokens = batches[0]
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        errors.append(_max_rel_error(lora, ref))
    return errors


def _pp_case():
    lora_config = LoRAConfig(rank=2, alpha=4)
    batches = _tokens(2, count=2)
    tensors, ref = _reference(_config(), lora_config, batches)
    topo = topology.initialize(pp=2)
    rank = topo.pp.rank
    (layer_range,) = split_layers(2, 2, None)[rank]
    model = GPTModel(_config(), pre_process=rank == 0, post_process=rank == 1, layer_range=layer_range)
    lora = apply_lora(model, lora_config)
    load_global_adapters(lora, tensors)

    def step(data, chunk):
        tokens = next(data)
        output = chunk(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        return output, lambda out: (out.mean(), {})

    forward_backward(step, iter(batches), model, len(batches), tensor_shape=(SEQ, BATCH, 32))
    return [_max_rel_error(lora, ref)]


def _dp_case():
    """dp=2 with megalite's DDP and optimizer over the adapters alone: the one-rank gradient, then a step."""
    lora_config = LoRAConfig(rank=2, alpha=4)
    batches = _tokens(4, count=2)
    tensors, ref = _reference(_config(), lora_config, batches)
    topo = topology.initialize()
    model = GPTModel(_config())
    lora = apply_lora(model, lora_config)
    load_global_adapters(lora, tensors)
    ddp = DistributedDataParallel(lora, DDPConfig())
    optimizer = get_optimizer(OptimizerConfig(lr=1e-3), [ddp])
    tokens = batches[topo.dp.rank]
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    ddp.finish_grad_sync()
    worst = 0.0
    for name, param, _ in adapter_layouts(lora):
        worst = max(worst, ((param.main_grad - ref[name]).norm() / ref[name].norm()).item())
    ok, _, _ = optimizer.step()
    assert ok and sorted(id(p) for p in optimizer.optimizer.state) == sorted(id(s.main) for s in optimizer.shards)
    assert len(optimizer.shards) == len(list(lora.parameters()))
    return [worst]


def _cp_case():
    """cp=2: each rank runs its two sequence chunks; the adapters' gradients summed over CP are the one-rank
    gradients of the summed loss."""
    lora_config = LoRAConfig(rank=2, alpha=4)
    tokens = _tokens(5)[0]
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    model = GPTModel(_config())
    lora = apply_lora(model, lora_config)
    tensors = _random_b(lora)
    load_global_adapters(lora, tensors)
    model(input_ids=ids, labels=labels).sum().backward()
    ref = {name: p.grad.clone() for name, p, _ in adapter_layouts(lora)}
    topo = topology.initialize(cp=2)
    model = GPTModel(_config())
    lora = apply_lora(model, lora_config)
    load_global_adapters(lora, tensors)
    cp, rank = topo.cp.size, topo.cp.rank
    model(input_ids=slice_for_rank(ids, cp, rank), labels=slice_for_rank(labels, cp, rank)).sum().backward()
    for param in lora.parameters():
        torch.distributed.all_reduce(param.grad, group=topo.cp.group)
    return [_max_rel_error(lora, ref)]


@pytest.mark.slow
@pytest.mark.parametrize("case", [_tp_case, _pp_case, _dp_case, _cp_case], ids=["tp2-and-sp", "pp2", "dp2-ddp",
                                                                                 "cp2"])
def test_adapter_grads_equal_one_rank(case):
    for rank, errors in enumerate(run_distributed(case, 2, timeout=120)):
        assert errors and all(err <= REL for err in errors), (rank, errors)


def _state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def _one_adam_step(model, params):
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    tokens = _tokens(3)[0]
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    optimizer.step()
    return _state_bytes(optimizer)


def test_optimizer_state_is_adapters_only_and_small():
    config = _config(hidden_size=64, ffn_hidden_size=128, vocab_size=256)
    full_model = GPTModel(config)
    full = _one_adam_step(full_model, full_model.parameters())
    model = GPTModel(config)
    lora = apply_lora(model, LoRAConfig(rank=1, alpha=2))
    adapters = _one_adam_step(model, lora.parameters())
    assert adapters == 2 * 4 * sum(p.numel() for p in lora.parameters())
    assert adapters <= 0.02 * full, (adapters, full)


def test_bf16_base_with_fp32_adapters():
    model = GPTModel(_config())
    lora = apply_lora(model, LoRAConfig(rank=2), base_dtype=torch.bfloat16)
    tokens = _tokens(4)[0]
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).float().mean().backward()
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in model.parameters())
    for p in lora.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all()
    assert any(p.grad.abs().sum() > 0 for p in lora.parameters())


def test_target_matching_nothing_names_the_available_ones():
    with pytest.raises(ValueError, match="linear_q.*available ones are linear_qkv, linear_proj, linear_fc1, linear_fc2"):
        LoRAConfig(target_modules="linear_q,linear_fc1")


def test_rank_larger_than_layer():
    with pytest.raises(ValueError, match="rank 40 is larger than layer .*linear_proj"):
        apply_lora(GPTModel(_config()), LoRAConfig(rank=40, target_modules="linear_proj"))


def test_dropout_acts_in_training_only():
    model = GPTModel(_config())
    lora = apply_lora(model, LoRAConfig(rank=2, dropout=0.5))
    load_global_adapters(lora, _random_b(lora))
    ids = _tokens(5)[0][:, :-1]
    model.eval()
    first, second = model(input_ids=ids), model(input_ids=ids)
    assert torch.equal(first, second)
    model.train()
    torch.manual_seed(1)
    dropped = model(input_ids=ids)
    assert (dropped - first).abs().max() > 1e-4


def test_moe_model_is_refused():
    from megalite.moe import MoEConfig

    model = GPTModel(_config(moe=MoEConfig(num_experts=2, ffn_hidden_size=16, topk=1)))
    with pytest.raises(ValueError, match="LoRA on MoE models is not supported"):
        apply_lora(model, LoRAConfig(rank=2))


def test_batch_invariant_model_with_adapters_gives_the_engine_log_probs_bit_for_bit():
    """The adapters' matmuls are the base layers' batch-invariant ones (plain F.linear missed by rounding)."""
    torch.manual_seed(0)
    model = GPTModel(rl_config("llama", batch_invariant=True))
    lora = apply_lora(model, LoRAConfig(rank=4, alpha=8))
    load_global_adapters(lora, _random_b(lora))
    assert _gaps(model) == [(0.0, 0.0)] * 3
