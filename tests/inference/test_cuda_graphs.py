"""The engine's CUDA-graphed decode steps on a GPU, with SDPA or the Triton kernel as their attention: the eager
engine's greedy tokens in fp32 (also after the weights move, which needs new graphs), and bf16 logits close to
the eager step's."""

import pytest
import torch

from megalite.inference import LLM, EngineConfig
from tests.inference.common import VOCAB, logprob_model
from tests.inference.test_static_decode import decode_plan, decode_work

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_graph_replay_gives_the_eager_greedy_tokens(attention):
    model = logprob_model().cuda()
    prompts, params = decode_work()
    config = dict(block_size=4, num_blocks=64, max_num_seqs=6, decode_attention=attention)
    eager_llm = LLM.from_model(model, engine_config=EngineConfig(**config, cuda_graphs=False))
    assert eager_llm.engine.static_decode is None
    llm = LLM.from_model(model, engine_config=EngineConfig(**config))
    graphs = llm.engine.static_decode
    assert graphs is not None and graphs.graphs is not None
    eager = _tokens(eager_llm, prompts, params)
    assert _tokens(llm, prompts, params) == eager
    captured = len(graphs.graphs)
    assert captured > 2  # the batch shrank through several buckets
    assert _tokens(llm, prompts, params) == eager and len(graphs.graphs) == captured  # replayed, not recaptured
    with torch.no_grad():  # new storage (and values) for every weight: the old graphs would read freed memory
        for p in model.parameters():
            p.data = p.data * 0.9
    assert _tokens(llm, prompts, params) == _tokens(eager_llm, prompts, params)


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_bf16_graph_logits_close_to_the_eager_step(attention):
    """Three sequences of different lengths (batch bucket 4): the replayed graph's logits within 4 bf16 steps
    (at the logits' size, about 4) of the eager paged step's; on CPU the two paths differ by 2."""
    model = logprob_model().cuda().to(torch.bfloat16)
    llm = LLM.from_model(model, engine_config=EngineConfig(block_size=4, num_blocks=32, max_num_seqs=8,
                                                           enable_prefix_caching=False, decode_attention=attention))
    engine = llm.engine
    plan = decode_plan(engine)
    static = engine.static_decode
    assert static.accepts(plan) and static.graphs is not None
    graphed = static.run(plan).clone()
    assert len(static.graphs) == 1
    engine.static_decode = None
    eager = engine.execute(plan)
    assert graphed.dtype == torch.float32 and graphed.shape == eager.shape == (3, VOCAB)
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0.125)
