"""Static-shape decode steps (megalite.inference.static_decode) against the engine's eager paged step, in fp32 on
CPU: the same logits for sequences of different lengths padded to a bucket, the same pool contents (padding rows
write only the scratch block), and the same greedy tokens for a whole ``LLM.generate``."""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference import triton_attention
from megalite.inference.static_decode import StaticDecode, buckets, decode_attention_for
from tests.inference.common import VOCAB, logprob_model, tiny_model


def _triton_on_cpu_or_skip() -> None:
    """The Triton kernel runs on CPU tensors only in Triton's interpreter (``TRITON_INTERPRET=1``); on a GPU in
    test_cuda_graphs.py."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1")


def _engine_config(attention: str, **fields) -> EngineConfig:
    if attention == "triton":
        _triton_on_cpu_or_skip()
    return EngineConfig(decode_attention=attention, **fields)


def decode_plan(engine):
    """Three requests (prompts of 3, 9 and 14 tokens) prefilled, then their first decode-only plan (contexts 4,
    10 and 15), scheduled but not run."""
    g = torch.Generator().manual_seed(0)
    for length in (3, 9, 14):
        engine.add_request(torch.randint(0, VOCAB, (length,), generator=g).tolist(),
                           SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the three prefills
    plan, _ = engine.scheduler.schedule()
    assert plan.lengths == [1, 1, 1] and [s + 1 for s in plan.starts] == [4, 10, 15]
    return plan


def decode_work():
    """Six greedy requests, prompts of 1-13 tokens and 2-9 new tokens (so the batch shrinks through buckets)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 14, (6,), generator=g)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True)
              for m in torch.randint(2, 10, (6,), generator=g)]
    return prompts, params


def test_buckets():
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(3) == [1, 2, 3] and buckets(20) == [1, 2, 4, 8, 16, 20] and buckets(1) == [1]


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("window", [None, 5])
def test_static_step_matches_the_eager_step(window, attention):
    """Three sequences (contexts 4, 10, 15 tokens: 1 to 4 blocks of 4) in a batch bucket of 4 and a context
    bucket of 4 blocks: fp32 logits equal to the eager step's, and every real block of the pool the same."""
    model = tiny_model(init_method_std=0.3, window_size=window)  # logprob_model's std, with the window
    llm = LLM.from_model(model, engine_config=_engine_config(attention, block_size=4, num_blocks=32, max_num_seqs=8,
                                                             enable_prefix_caching=False))
    engine = llm.engine
    plan = decode_plan(engine)
    if window is not None:
        assert any(b < 0 for table in plan.block_tables for b in table)  # blocks freed outside the window
    eager = engine.execute(plan)
    keys = {n: k[:, :-1].clone() for n, k in engine.pool.keys.items()}
    static = StaticDecode.for_engine(engine, graphs=False)
    assert static.accepts(plan)
    assert not static.accepts(dataclasses.replace(plan, lengths=[1, 2, 1]))  # a chunk or drafts: eager
    assert not static.accepts(dataclasses.replace(plan, sample_rows=[0, 2]))  # a row without logits: eager
    got = static.run(plan)
    assert got.dtype == torch.float32 and got.shape == eager.shape == (3, VOCAB)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    for n, k in engine.pool.keys.items():  # the same keys rewritten (layer 2's to rounding: its input went
        # through layer 1's attention); padding touched the scratch block only
        torch.testing.assert_close(k[:, :-1], keys[n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_static_path_generates_the_eager_greedy_tokens(monkeypatch, attention):
    """A whole generate with decode steps on the static path (prompts of 1-13 tokens, 2-9 new tokens, so the
    batch shrinks through its buckets) gives exactly the eager engine's greedy tokens."""
    model = logprob_model()
    config = _engine_config(attention, block_size=4, num_blocks=64, max_num_seqs=6)
    prompts, params = decode_work()
    eager = [o.outputs[0].token_ids for o in LLM.from_model(model, engine_config=config).generate(prompts, params)]
    llm = LLM.from_model(model, engine_config=config)
    assert llm.engine.static_decode is None  # CPU: eager by default
    llm.engine.static_decode = StaticDecode.for_engine(llm.engine, graphs=False)
    shapes = []
    real = StaticDecode.run

    def counted(self, plan):
        shapes.append(len(plan.lengths))
        return real(self, plan)

    monkeypatch.setattr(StaticDecode, "run", counted)
    static = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert static == eager
    assert len(set(shapes)) > 2  # decode steps of several batch sizes went through the static path
    assert llm.engine.allocator.num_used() == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_triton_kernel_matches_sdpa_per_row(device):
    """The kernel against SDPA over each row's own keys: 3 of 6 query heads per group (padded to 4 in the
    kernel), a head dim of 12 (padded to 16), contexts of 1-16 keys through shuffled tables, the lengths a strided
    column (as the engine's packed inputs hold them), with and without a window of 3 (and 0: itself only)."""
    if device == "cpu":
        _triton_on_cpu_or_skip()
    elif not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from megalite.inference.triton_attention import paged_decode

    g = torch.Generator().manual_seed(0)
    groups, blocks, bs, d, heads, rows = 2, 40, 4, 12, 6, 5
    keys, values = (torch.randn(groups, blocks, bs, d, generator=g).to(device) for _ in range(2))
    packed = torch.zeros(rows, 8, dtype=torch.long)
    packed[:, 0] = torch.tensor([1, 5, 9, 16, 13])
    packed[:, 4:] = torch.randperm(blocks, generator=g)[:rows * 4].view(rows, 4)
    packed = packed.to(device)
    contexts, tables = packed[:, 0], packed[:, 4:]
    q = torch.randn(rows, heads, d, generator=g).to(device)
    for window in (None, 3, 0):
        out = paged_decode(q, keys, values, tables, contexts, d ** -0.5, window)
        for i, c in enumerate(contexts.tolist()):
            k, v = (x[:, tables[i]].reshape(groups, -1, d)[:, :c] for x in (keys, values))
            visible = torch.arange(c, device=device) >= (0 if window is None else c - 1 - window)
            expected = F.scaled_dot_product_attention(q[i].view(groups, heads // groups, d), k, v,
                                                      attn_mask=visible, scale=d ** -0.5)
            torch.testing.assert_close(out[i], expected.reshape(heads, d), rtol=1e-5, atol=1e-5)


def test_unsupported_engines_and_bad_config_say_why():
    llm = LLM.from_model(logprob_model(), engine_config=EngineConfig(block_size=4, num_blocks=16,
                                                                    speculative="ngram"))
    with pytest.raises(ValueError, match="static decode steps do not support speculative decoding"):
        StaticDecode.for_engine(llm.engine, graphs=False)
    with pytest.raises(ValueError, match="decode_attention must be 'auto', 'sdpa' or 'triton', got 'flash'"):
        EngineConfig(decode_attention="flash")
    with pytest.raises(ValueError, match="decode_attention='triton' needs a power-of-two block_size, got 12"):
        EngineConfig(decode_attention="triton", block_size=12)


def test_auto_attention_is_triton_on_cuda_where_it_can_run(monkeypatch):
    """``decode_attention="auto"`` (the default) picks the Triton kernel on CUDA when Triton is installed and the
    block size is a power of two (3.6x faster than SDPA on an H200), else SDPA; explicit choices stand."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for installed in (True, False):
        monkeypatch.setattr(triton_attention, "available", lambda: installed)
        assert decode_attention_for(EngineConfig(), cuda) == ("triton" if installed else "sdpa")
        assert decode_attention_for(EngineConfig(block_size=12), cuda) == "sdpa"
        assert decode_attention_for(EngineConfig(), cpu) == "sdpa"
        assert decode_attention_for(EngineConfig(decode_attention="sdpa"), cuda) == "sdpa"
    assert EngineConfig().decode_attention == "auto"
    with pytest.raises(ValueError, match="decode_attention='triton' needs Triton installed"):
        decode_attention_for(EngineConfig(decode_attention="triton"), cuda)


def test_an_engine_asking_for_triton_without_it_is_an_error_not_an_eager_engine(monkeypatch):
    """On CUDA, ``decode_attention="triton"`` without Triton fails when the engine is built: it is not swallowed
    with the cases the static steps do not support (which keep eager steps)."""
    monkeypatch.setattr(triton_attention, "available", lambda: False)
    llm = LLM.from_model(logprob_model(), engine_config=EngineConfig(block_size=4, num_blocks=16,
                                                                    decode_attention="triton"))
    engine = llm.engine
    engine.device = torch.device("cuda")  # what default_for reads; nothing runs on it
    with pytest.raises(ValueError, match="decode_attention='triton' needs Triton installed"):
        StaticDecode.default_for(engine)
    engine.drafter = object()  # an unsupported engine keeps its eager steps, whatever its attention
    assert StaticDecode.default_for(engine) is None
