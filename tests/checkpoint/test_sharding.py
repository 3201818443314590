"""Flat ZeRO ranges cut into boxes, and the SwiGLU fc1 / padded-vocabulary shard placement."""

import itertools

import torch

from megalite.checkpoint.sharding import ShardContext, box_slices, flat_boxes, global_param


def test_flat_boxes_cover_exactly_the_range():
    shape = (3, 4, 5)
    numbered = torch.arange(60).view(shape)
    for lo, hi in itertools.combinations(range(0, 61, 7), 2):
        got = []
        for box, start in flat_boxes(lo, hi, shape):
            values = numbered[box_slices(box)].reshape(-1)
            assert values.tolist() == list(range(start, start + values.numel()))
            got.extend(values.tolist())
        assert got == list(range(lo, hi))


def test_gated_fc1_and_vocab_pieces():
    from megalite.models import GPTConfig

    config = GPTConfig(vocab_size=10, num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8,
                       activation="swiglu")
    fc1 = torch.nn.Parameter(torch.empty(4, 8))
    fc1.tensor_model_parallel, fc1.partition_dim = True, 0
    gp = global_param("decoder.layers.0.mlp.linear_fc1.weight", fc1, config, ShardContext(tp_rank=1, tp_size=4))
    assert gp.shape == (16, 8)
    assert [(p.local, p.offset) for p in gp.pieces] == [(((0, 2), (0, 8)), (2, 0)), (((2, 4), (0, 8)), (10, 0))]
    # An MoE shared expert's fc1 is a SwiGLU MLP's too: [gate; up] globally, not the ranks' [gate_i; up_i] blocks.
    gp = global_param("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", fc1, config,
                      ShardContext(tp_rank=1, tp_size=4))
    assert [(p.local, p.offset) for p in gp.pieces] == [(((0, 2), (0, 8)), (2, 0)), (((2, 4), (0, 8)), (10, 0))]
    vocab = torch.nn.Parameter(torch.empty(4, 8))
    vocab.tensor_model_parallel, vocab.partition_dim = True, 0
    gp = global_param("output_layer.weight", vocab, config, ShardContext(tp_rank=2, tp_size=3))
    assert gp.name == "embedding.word_embeddings.weight" and gp.alias and gp.shape == (10, 8)
    assert [(p.local, p.offset) for p in gp.pieces] == [(((0, 2), (0, 8)), (8, 0))]


def test_global_shapes_draw_no_values(monkeypatch):
    """The shapes-only (meta) model behind global_shapes skips its random fills (torch's meta kernel for a draw
    imports its compiler the first time, seconds at every LoRA run's start) and still names every tensor."""
    from megalite.checkpoint import global_shapes
    from megalite.models import GPTConfig, GPTModel

    def refuse(*args, **kwargs):
        raise AssertionError("a random fill ran on a meta tensor")

    config = GPTConfig(vocab_size=10, num_layers=1, hidden_size=8, num_attention_heads=2, max_position_embeddings=4,
                       make_vocab_size_divisible_by=1)
    expected = {name: tuple(p.shape) for name, p in GPTModel(config).state_dict().items()}
    monkeypatch.setattr(torch.nn.init, "_no_grad_normal_", refuse)
    assert global_shapes(config) == expected
