"""Single-process GPT tests: parity with a plain torch GPT, pipeline chunks, KV cache, config checks."""

from __future__ import annotations

import pytest
import torch

from megalite import kernels
from megalite.models import GPTModel, KVCache, gpt_flops_per_token
from megalite.tensor_parallel import model_parallel_seed
from tests.models.common import VOCAB, batch, config
from tests.models.plain_gpt import PlainGPT

KINDS = {
    "gpt2": {},
    "gpt2_tanh_untied": dict(activation="gelu_tanh", untie_embeddings_and_output_weights=True),
    "llama": {},
    "llama_bias_mha": dict(add_bias_linear=True, num_query_groups=4),
}


def _kind_config(name):
    return config("llama" if name.startswith("llama") else "gpt2", **KINDS[name])


@pytest.mark.parametrize("name", list(KINDS))
def test_matches_plain_torch_gpt(name):
    cfg = _kind_config(name)
    model = GPTModel(cfg)
    plain = PlainGPT(cfg)
    plain.load_megalite(model)
    ids, labels = batch()
    logits = model(ids)
    assert logits.shape == (2, 8, VOCAB)
    torch.testing.assert_close(logits, plain(ids), rtol=0, atol=1e-5)
    loss, plain_loss = model(ids, labels=labels), plain(ids, labels=labels)
    assert loss.shape == (2, 8) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-5)
    loss.sum().backward()
    plain_loss.sum().backward()
    layer, block = model.decoder.layers["1"], plain.blocks[1]
    torch.testing.assert_close(layer.mlp.linear_fc2.weight.grad, block.mlp.fc2.weight.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.input_layernorm.weight.grad, block.norm1.weight.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.embedding.word_embeddings.weight.grad[:VOCAB], plain.wte.weight.grad,
                               rtol=0, atol=1e-5)


def test_init_statistics_and_padding_rows():
    cfg = config(untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg)
    word = model.embedding.word_embeddings.weight
    assert word.shape == (104, 32)
    assert torch.count_nonzero(word[VOCAB:]) == 0 and torch.count_nonzero(model.output_layer.weight[VOCAB:]) == 0
    assert abs(word[:VOCAB].std().item() - 0.02) < 0.002
    fc2 = model.decoder.layers["0"].mlp.linear_fc2.weight
    assert abs(fc2.std().item() - 0.02 / 2) < 0.001
    assert not torch.equal(model.decoder.layers["0"].mlp.linear_fc1.weight, model.decoder.layers["1"].mlp.linear_fc1.weight)
    assert not torch.equal(word, model.output_layer.weight)
    assert torch.equal(GPTModel(cfg).state_dict()["decoder.layers.1.mlp.linear_fc1.weight"],
                       model.decoder.layers["1"].mlp.linear_fc1.weight)
    other = GPTModel(config(untie_embeddings_and_output_weights=True, seed=7))
    assert not torch.equal(other.embedding.word_embeddings.weight, word)


@pytest.mark.parametrize("kind, tied", [("gpt2", True), ("llama", False)])
def test_pipeline_chunks_equal_full_model(kind, tied):
    cfg = config(kind, num_layers=3, untie_embeddings_and_output_weights=not tied)
    full = GPTModel(cfg)
    first = GPTModel(cfg, post_process=False, layer_range=(0, 1))
    middle = GPTModel(cfg, pre_process=False, post_process=False, layer_range=(1, 2))
    last = GPTModel(cfg, pre_process=False, layer_range=(2, 3))
    chunked = {**first.state_dict(), **middle.state_dict(), **last.state_dict()}
    expected = full.state_dict()
    if tied:
        assert torch.equal(chunked.pop("output_layer.weight"), expected["embedding.word_embeddings.weight"])
        assert first.embedding.word_embeddings.weight.shared_embedding
        assert last.output_layer.weight.shared_embedding
        assert not getattr(full.embedding.word_embeddings.weight, "shared_embedding", False)
    assert sorted(chunked) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(chunked[name], value), name
    ids, labels = batch()
    hidden = first(ids)
    assert hidden.shape == (8, 2, 32)
    middle.set_input_tensor(hidden)
    last.set_input_tensor(middle())
    torch.testing.assert_close(last(labels=labels), full(ids, labels=labels), rtol=0, atol=1e-6)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_replays_dropout(granularity):
    def run(recompute):
        cfg = config("llama", hidden_dropout=0.2, attention_dropout=0.3, recompute_granularity=recompute)
        model = GPTModel(cfg)
        model_parallel_seed(42, 0)
        ids, labels = batch()
        loss = model(ids, labels=labels)
        loss.sum().backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model

    loss, grads, model = run(None)
    loss_re, grads_re, _ = run(granularity)
    torch.testing.assert_close(loss_re, loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_re[name], grad, rtol=0, atol=1e-6, msg=name)
    model.eval()
    ids, labels = batch()
    assert (model(ids, labels=labels) - loss).abs().max() > 1e-3, "dropout had no effect"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_kv_cache_decoding_matches_full_forward(kind):
    model = GPTModel(config(kind)).eval()
    ids, _ = batch(s=8)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :5], kv_cache=cache)]
        steps += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(5, 7)]
        steps.append(model(ids[:, 7:], kv_cache=cache))
    assert cache.offset == 8
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_fused_kernels_match_reference():
    ids, labels = batch()
    losses = []
    for fused in (True, False):
        kernels.set_fused(fused)
        try:
            losses.append(GPTModel(config("llama", add_bias_linear=True)).forward(ids, labels=labels))
        finally:
            kernels.set_fused(True)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_flops_per_token_counts_matmul_weights(kind):
    cfg = config(kind, untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg)
    matmul = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and "embedding" not in n and "output_layer" not in n)
    matmul += VOCAB * cfg.hidden_size
    seq = 8
    expected = 6 * matmul + 12 * cfg.num_layers * cfg.hidden_size * seq
    assert gpt_flops_per_token(cfg, seq) == pytest.approx(expected)


@pytest.mark.parametrize("overrides, tp, message", [
    (dict(num_attention_heads=6), 1, "hidden_size=32 is not divisible by num_attention_heads=6"),
    (dict(num_query_groups=3), 1, "num_attention_heads=4 is not divisible by num_query_groups=3"),
    (dict(num_attention_heads=2), 4, "num_attention_heads=2 is not divisible by the tensor-parallel size 4"),
    (dict(num_query_groups=1), 2, "num_query_groups=1 is not divisible by the tensor-parallel size 2"),
    (dict(ffn_hidden_size=30), 4, "ffn_hidden_size=30 is not divisible by the tensor-parallel size 4"),
    (dict(activation="relu"), 1, "activation must be one of"),
    (dict(hidden_dropout=1.0), 1, "hidden_dropout must be in"),
    (dict(vocab_size=0), 1, "vocab_size must be a positive integer, got 0"),
    (dict(moe_layer_freq=[1]), 1, "needs num_layers=2 entries"),
])
def test_bad_config(overrides, tp, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides).validate(tp)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"layer_range=\(1, 3\)"):
        GPTModel(config(), layer_range=(1, 3))
    model = GPTModel(config())
    with pytest.raises(ValueError, match="positions up to 17 exceed max_position_embeddings=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    ids, mask = torch.zeros(1, 20, dtype=torch.long), torch.tensor([[0] * 4 + [1] * 16])
    assert model(ids, attention_mask=mask).shape[1] == 20  # left padding: the 16 real tokens take positions 0..15
    mask[0, 3] = 1
    with pytest.raises(ValueError, match=r"position_ids range over \[0, 16\], outside \[0, 15\]"):
        model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="needs set_input_tensor"):
        GPTModel(config(), pre_process=False)()
