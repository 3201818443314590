"""Expert and ZeRO-1 optimizer state reshard exactly: save at ep=2 (expert dp=1, dp=2), load at ep=1, save again.

The two checkpoints must hold identical global tensors (weights, exp_avg, exp_avg_sq), and the
model loaded in one process gives the same logits as the expert-parallel model.
"""

import torch

from megalite.checkpoint import CheckpointReader, load_model
from megalite.testing import run_distributed

VOCAB, SEQ = 40, 8


def _config():
    from megalite.models import GPTConfig
    from megalite.moe import MoEConfig

    return GPTConfig(vocab_size=VOCAB, num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                     activation="swiglu", normalization="RMSNorm", position_embedding_type="rope",
                     add_bias_linear=False, make_vocab_size_divisible_by=16, untie_embeddings_and_output_weights=True,
                     moe=MoEConfig(num_experts=4, ffn_hidden_size=16, topk=2, activation="swiglu"))


def _model_and_optimizer():
    from megalite.distributed import DDPConfig, DistributedDataParallel
    from megalite.models import GPTModel
    from megalite.optim import OptimizerConfig, get_optimizer

    chunk = DistributedDataParallel(GPTModel(_config()), DDPConfig(use_distributed_optimizer=True))
    return chunk, get_optimizer(OptimizerConfig(lr=1e-2), [chunk])


def _rank(before, after):
    import torch.distributed as dist

    from megalite import checkpoint, topology

    topology.initialize(ep=2)
    chunk, optimizer = _model_and_optimizer()
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        optimizer.zero_grad()
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
        chunk(ids[:, :-1], ids[:, 1:]).mean().backward()
        chunk.finish_grad_sync()
        optimizer.step()
    checkpoint.save_sharded(before, 2, [chunk], optimizer)
    with torch.no_grad():
        logits = chunk.module(torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB)

    topology.initialize(ep=1)
    chunk, optimizer = _model_and_optimizer()
    checkpoint.load_sharded(before, [chunk], optimizer)
    checkpoint.save_sharded(after, 2, [chunk], optimizer)
    return logits


def test_expert_and_zero1_state_survive_resharding(tmp_path):
    before, after = str(tmp_path / "ep2"), str(tmp_path / "ep1")
    logits = run_distributed(_rank, 2, before, after, timeout=180)
    a, b = CheckpointReader(before), CheckpointReader(after)
    assert sorted(a.shapes) == sorted(b.shapes)
    assert any(n.startswith("optimizer.exp_avg_sq.") and "experts.fc1_weight" in n for n in a.shapes)
    for name in a.shapes:
        assert torch.equal(a.read(name), b.read(name)), name
    model = load_model(before)
    with torch.no_grad():
        single = model(torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB)
    for rank_logits in logits:
        assert (single - rank_logits[..., :VOCAB]).abs().max().item() <= 1e-5
