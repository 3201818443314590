"""Multi-token prediction: loss and gradients against a hand-written single-rank reference, and TP parity."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import topology
from megalite.context_parallel import chunk_indices
from megalite.checkpoint import CheckpointReader, global_shapes, load_model, load_sharded, save_sharded
from megalite.checkpoint.megatron_convert import convert_megalite_to_megatron, megatron_args
from megalite.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megalite.models import GPTModel, gpt_flops_per_token
from megalite.models.mtp import check_mtp_layout
from megalite.moe import set_aux_loss_scale
from megalite.pipeline import broadcast_from_last_stage, forward_backward
from megalite.testing import run_distributed
from megalite.topology import device
from megalite.training.arguments import validate_args
from megalite.training.flags import gpt_config, parse_args
from tests.models.common import VOCAB, batch, config, full_to_shard

SCALE = 0.3


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _mean_ce(hidden, weight, targets, keep):
    """Mean cross entropy of ``hidden [n, b, h] @ weight^T`` against ``targets [b, n]`` over ``keep [b, n]``."""
    logits = hidden.transpose(0, 1) @ weight.t()
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    keep = keep.reshape(-1).float()
    return (per_token * keep).sum() / keep.sum()


def _reference_loss(model, ids, labels, keep, documents):
    """Main mean loss + SCALE * mean over depths of each depth's mean loss, written out by hand.

    Depth ``k`` runs on the first ``s - k - 1`` positions only (causal attention: the positions with a target
    do not see the rest), so no shifting with padding is involved.
    """
    cfg = model.config
    b, s = ids.shape
    eps = cfg.norm_eps
    word = model.embedding.word_embeddings.weight[:VOCAB]
    head = word if model.output_layer is None else model.output_layer.weight[:VOCAB]
    rotary = model.rotary(torch.arange(s, device=ids.device))
    h = model.decoder(model.embedding(ids, None), rotary, None, None, documents)
    losses = [_mean_ce(h, head, labels, keep)]
    for depth, layer in enumerate(model.mtp.layers):
        n = s - depth - 1
        e = F.embedding(ids[:, depth + 1:].t(), word)
        x = torch.cat([_rms(e, layer.enorm.weight, eps), _rms(h[:n], layer.hnorm.weight, eps)], dim=-1)
        x = x @ layer.eh_proj.weight.t()
        docs = None if documents is None else documents[:, :n]
        x = layer.transformer_layer(x, model.rotary(torch.arange(n, device=ids.device)), None, None, docs)
        h = _rms(x, layer.final_layernorm.weight, eps)
        target_keep = keep[:, depth + 1:]
        if documents is not None:
            target_keep = target_keep * (documents[:, depth + 1:] == documents[:, :n])
        losses.append(_mean_ce(h, head, labels[:, depth + 1:], target_keep))
    depths = len(model.mtp.layers)
    return losses[0] + SCALE / depths * sum(losses[1:]), losses


@pytest.mark.parametrize("case", ["tied", "untied_masked", "packed"])
def test_mtp_loss_and_every_gradient_equal_hand_written_reference(case):
    """Shifted inputs and targets, the end-of-sequence and document cut-offs, the scaling, and the gradient path
    through the backward pass only (the returned loss stays the main model's)."""
    ids, labels = batch(s=10)
    keep = torch.ones_like(labels)
    documents = None
    if case == "untied_masked":
        keep[0, 3] = keep[1, 7] = 0
    if case == "packed":
        documents = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    cfg = config("llama", mtp_num_layers=2, mtp_loss_scaling_factor=SCALE,
                 untie_embeddings_and_output_weights=case == "untied_masked")
    model = GPTModel(cfg)
    per_token = model(ids, labels, document_ids=documents, loss_mask=None if case == "tied" else keep)
    loss = (per_token * keep).sum() / keep.sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 for name, g in grads.items() if name.startswith("mtp.")), "an MTP weight got no grad"
    model.zero_grad()
    expected, losses = _reference_loss(model, ids, labels, keep, documents)
    torch.testing.assert_close(loss, losses[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.stack(model.mtp.last_losses), torch.stack(losses[1:]).detach(), rtol=1e-6,
                               atol=0)
    expected.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_mtp_is_training_only_and_changes_no_returned_value():
    """Evaluation (and logits) run the main model alone; the training loss returned is the main model's."""
    ids, labels = batch()
    plain = GPTModel(config("llama"))
    model = GPTModel(config("llama", mtp_num_layers=1))
    assert {n for n, _ in plain.named_parameters()} < {n for n, _ in model.named_parameters()}
    torch.testing.assert_close(model(ids, labels), plain(ids, labels), rtol=0, atol=0)
    model.eval()
    model.mtp.last_losses = None
    model(ids, labels)
    assert model.mtp.last_losses is None


def _check_tp_parity():
    ids, labels = (t.to(device()) for t in batch(s=8))
    cfg = config("llama", mtp_num_layers=2, mtp_loss_scaling_factor=SCALE)
    ref = GPTModel(cfg).to(ids.device)
    ref(ids, labels).mean().backward()
    ref_params = dict(ref.named_parameters())
    topo = topology.initialize(tp=2)
    for sequence_parallel in (False, True):
        model = GPTModel(cfg, sequence_parallel=sequence_parallel).to(ids.device)
        params = dict(model.named_parameters())
        loss = model(ids, labels)
        loss.mean().backward()
        torch.testing.assert_close(torch.stack(model.mtp.last_losses), torch.stack(ref.mtp.last_losses), rtol=1e-6,
                                   atol=0)
        for name, param in params.items():
            grad = param.grad
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=topo.tp.group)
            expected = full_to_shard(name, ref_params[name].grad, param, cfg, topo.tp.rank, topo.tp.size)
            torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6,
                                       msg=f"sequence_parallel={sequence_parallel}: grad {name}")


def _pipeline_step(data_iterator, chunk):
    tokens = next(data_iterator)
    per_token = chunk(tokens[:, :-1], tokens[:, 1:])
    return per_token, lambda output: (output.mean(), {"loss": output.mean().detach()})


def _check_pipeline_parity(directory):
    """pp=2 (the depths and the embedding's copy on the last stage) against one rank, tied and untied, through
    the 1F1B schedule with DDP and the trainer's gradient finalization (the copy's grads summed with the first
    stage's); then saved under ``directory``, and the one-rank checkpoint there loaded (the copy from the
    model's word embedding)."""
    m = 2
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, 9), generator=g) for _ in range(m)]
    topo = topology.initialize(pp=2)
    for tied in (True, False):
        cfg = config("llama", mtp_num_layers=2, mtp_loss_scaling_factor=SCALE,
                     untie_embeddings_and_output_weights=not tied)
        ref = GPTModel(cfg)
        set_aux_loss_scale(ref, 1.0 / m)
        ref_losses = []
        for tokens in batches:
            loss = ref(tokens[:, :-1], tokens[:, 1:]).mean()
            (loss / m).backward()
            ref_losses.append(loss.item())
        ref_grads = {name: p.grad for name, p in ref.named_parameters()}
        first = topo.pp.rank == 0
        model = GPTModel(cfg, pre_process=first, post_process=not first, layer_range=(0, 1) if first else (1, 2))
        chunk = DistributedDataParallel(model, DDPConfig(bucket_size=2000))
        set_aux_loss_scale(chunk, 1.0 / m)
        metrics = forward_backward(_pipeline_step, iter(batches), chunk, m, tensor_shape=(8, 2, 32),
                                   finalize_grads_func=finalize_model_grads)
        losses = broadcast_from_last_stage([mt["loss"].item() for mt in metrics])
        assert losses == pytest.approx(ref_losses, rel=1e-6), tied
        if not first:
            assert model.output_layer is None if tied else model.output_layer is not None
            assert getattr(model.mtp.embedding.word_embeddings.weight, "shared_embedding", False)
        for name, param in model.named_parameters():
            ref_name = "embedding.word_embeddings.weight" if name.startswith("mtp.embedding.") else name
            torch.testing.assert_close(param.main_grad, ref_grads[ref_name], rtol=1e-5, atol=1e-7,
                                       msg=f"tied={tied}: {name}")
        save_sharded(os.path.join(directory, f"pp2_tied_{tied}"), 1, [chunk])
        load_sharded(os.path.join(directory, f"pp1_tied_{tied}"), [model])
        saved = GPTModel(dataclasses.replace(cfg, seed=99))
        for name, param in model.named_parameters():
            ref_name = "embedding.word_embeddings.weight" if name.startswith("mtp.embedding.") else name
            assert torch.equal(param, dict(saved.named_parameters())[ref_name]), (tied, name)


def _check_cp_parity():
    """cp=2 (each rank's tokens: chunks r and 2cp-1-r; the loss weighted as the trainer's masked loss) against
    one rank: MTP losses, and every gradient averaged over CP as DDP averages it."""
    topology.initialize()  # every axis of size 1 but dp: the reference is single-rank
    ids, labels = batch(s=8)
    cfg = config("llama", mtp_num_layers=2, mtp_loss_scaling_factor=SCALE)
    ref = GPTModel(cfg)
    ref(ids, labels).mean().backward()
    topo = topology.initialize(cp=2)
    mine = chunk_indices(8, 2, topo.cp.rank)
    model = GPTModel(cfg)
    per_token = model(ids[:, mine], labels[:, mine])
    (per_token.sum() * 2 / labels.numel()).backward()
    losses = torch.stack(model.mtp.last_losses)
    dist.all_reduce(losses, group=topo.cp.group)
    torch.testing.assert_close(losses / 2, torch.stack(ref.mtp.last_losses), rtol=1e-6, atol=0)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=topo.cp.group)
        torch.testing.assert_close(grad / 2, ref_params[name].grad, rtol=1e-5, atol=1e-7, msg=f"cp=2: grad {name}")


def _check_parallel_layouts(directory, megatron: bool):
    _check_tp_parity()
    _check_cp_parity()
    _check_pipeline_parity(directory)
    if megatron:  # last: it patches CUDA calls of this process
        return _check_against_megatron_core(directory)
    return None


@pytest.mark.slow
def test_mtp_parallel_layouts_and_megatron_core_match_single_rank(tmp_path):
    """tp=2 with and without SP, cp=2, pp=2 tied and untied (and checkpoints resharded pp1 <-> pp2), and
    Megatron-Core's MTP (and its checkpoints both ways), in one two-rank run."""
    megatron = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
    for tied in (True, False):
        cfg = config("llama", mtp_num_layers=2, untie_embeddings_and_output_weights=not tied, seed=99)
        save_sharded(str(tmp_path / f"pp1_tied_{tied}"), 1, [GPTModel(cfg)])
    convert_megalite_to_megatron(str(tmp_path / "pp1_tied_False"), str(tmp_path / "to_megatron"))
    megatron_saved = run_distributed(_check_parallel_layouts, 2, str(tmp_path), bool(megatron), timeout=300)[0]
    for tied in (True, False):
        path = str(tmp_path / f"pp2_tied_{tied}")
        loaded = load_model(path)
        assert sorted(CheckpointReader(path).shapes) == sorted(global_shapes(loaded.config))
        fresh = GPTModel(loaded.config)
        assert loaded.config.mtp_num_layers == 2
        for name, value in fresh.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), (tied, name)
    if not megatron:
        pytest.skip("megatron-core is not installed: the tp/pp checks ran, the Megatron-Core comparison did not")
    loaded = load_model(str(tmp_path / "megatron_saved"))
    assert loaded.config.mtp_num_layers == 2
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, megatron_saved[name][:value.shape[0]]), name


@pytest.mark.parametrize("kind, overrides, pipelined, message", [
    ("llama", {"mtp_num_layers": 0}, False, "mtp_num_layers must be a positive integer"),
    ("llama", {"mtp_num_layers": 1, "mtp_loss_scaling_factor": -1.0}, False, "mtp_loss_scaling_factor must be"),
    ("gpt2", {"mtp_num_layers": 1}, True, "under pipeline parallelism needs rotary positions"),
])
def test_mtp_bad_settings_are_one_clear_error(kind, overrides, pipelined, message):
    cfg = config(kind, **overrides)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
        check_mtp_layout(cfg, pipelined)


def test_aux_loss_scale_scales_the_mtp_gradient():
    """A trainer scales each micro-batch's loss (1/micro-batches, an fp16 loss scale); set_aux_loss_scale scales
    the MTP loss the same way, which the MTP-only weights' gradients show."""
    ids, labels = batch()
    model = GPTModel(config("llama", mtp_num_layers=1))
    grads = []
    for scale in (1.0, 0.25):
        set_aux_loss_scale(model, scale)
        model.zero_grad()
        model(ids, labels).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.")})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], 0.25 * grad, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("flags, message", [
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4"],
     "under pipeline parallelism needs rotary positions"),
    (["--mtp-num-layers", "0"], "mtp_num_layers must be a positive integer"),
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
      "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--pipeline-schedule", "zbv"],
     "--mtp-num-layers needs another schedule"),
])
def test_mtp_flags_reject_bad_settings(flags, message):
    with pytest.raises(ValueError, match=message):
        validate_args(parse_args(flags), 2)


def test_mtp_flags_set_the_config():
    args = validate_args(parse_args(["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.5"]), 1)
    cfg = gpt_config(args)
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (2, 0.5)
    assert gpt_config(validate_args(parse_args([]), 1)).mtp_num_layers is None


def test_flops_per_token_count_the_mtp_depths():
    """Each depth adds its projection, its layer and one more pass through the output layer (6N + attention)."""
    cfg = config("gpt2", untie_embeddings_and_output_weights=True, mtp_num_layers=2)
    model = GPTModel(cfg)
    matmul = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and "embedding" not in n and "output_layer" not in n)
    matmul += 3 * VOCAB * cfg.hidden_size
    seq = 8
    expected = 6 * matmul + 12 * (cfg.num_layers + 2) * cfg.hidden_size * seq
    assert gpt_flops_per_token(cfg, seq) == pytest.approx(expected)


def _check_against_megatron_core(directory):
    """Megatron-Core's GPTModel with its MTP block (local spec, CPU) and megalite's with the same weights: the
    same per-token loss and, with the MTP loss added through both backward passes, the same gradients.  Then
    Megatron-Core saves its model (torch_dist, read by megalite in the test) and loads the megalite checkpoint
    ``directory/pp1_tied_False`` converted for it (``directory/to_megatron``): the same weights.  Returns the
    saved weights."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.checkpoint.megatron_fixture import patch_cuda

    patch_cuda()
    parallel_state.initialize_model_parallel(1, 1)  # every rank compares on its own (dp = world)
    torch.manual_seed(0)
    mc = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, kv_channels=8,
        hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        mtp_num_layers=2, mtp_loss_scaling_factor=SCALE)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    theirs = MegatronGPT(mc, spec, vocab_size=VOCAB, max_sequence_length=16, share_embeddings_and_output_weights=False,
                         position_embedding_type="rope",
                         mtp_block_spec=get_gpt_mtp_block_spec(mc, spec, use_transformer_engine=False))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    ours = GPTModel(config("llama", num_query_groups=2, kv_channels=8, untie_embeddings_and_output_weights=True,
                           make_vocab_size_divisible_by=VOCAB, mtp_num_layers=2, mtp_loss_scaling_factor=SCALE))
    state = {k: v for k, v in theirs.state_dict().items() if "_extra_state" not in k}
    assert sorted(state) == sorted(ours.state_dict())
    ours.load_state_dict(state)
    ids, labels = batch(s=8)
    mask = torch.triu(torch.ones(8, 8), 1).bool()[None, None]
    expected = theirs(ids, torch.arange(8).expand(2, 8), mask, labels=labels)
    loss = ours(ids, labels)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    expected.mean().backward()
    loss.mean().backward()
    grads = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)

    saved = os.path.join(directory, "megatron_saved")
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(saved, "iter_0000001"))
    dist.barrier()
    args = argparse.Namespace(**megatron_args(ours.config, 1, 1))
    dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": 1,
                             "model": theirs.sharded_state_dict()}, os.path.join(saved, "iter_0000001"))
    if dist.get_rank() == 0:
        with open(os.path.join(saved, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    converted = config("llama", mtp_num_layers=2, untie_embeddings_and_output_weights=True, seed=99)
    padded = GPTModel(converted).padded_vocab_size
    back = MegatronGPT(mc, spec, vocab_size=padded, max_sequence_length=16, share_embeddings_and_output_weights=False,
                       position_embedding_type="rope",
                       mtp_block_spec=get_gpt_mtp_block_spec(mc, spec, use_transformer_engine=False))
    loaded = dist_checkpointing.load({"model": back.sharded_state_dict()},
                                     os.path.join(directory, "to_megatron", "iter_0000001"))
    back.load_state_dict(loaded["model"])
    megatron_state = back.state_dict()
    for name, value in GPTModel(converted).state_dict().items():
        assert torch.equal(megatron_state[name][:value.shape[0]], value), name
    return {name: value for name, value in theirs.state_dict().items() if "_extra_state" not in name}
