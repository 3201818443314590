"""Structured output in the engine: a compiled grammar on SamplingParams (``structured_outputs``) masks every
sample's tokens, composed with n > 1 (forked samples each keep their own state), prefix sharing, greedy and
sampled decoding and n-gram speculation; a sample ends with reason "stop" once its output is complete."""

import json

import pytest

from megalite.inference import LLM, EngineConfig, SamplingParams
from tests.inference.server_harness import BYTES, byte_model

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from megalite.inference.grammar import GrammarCompiler  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def _compiler():
    return GrammarCompiler(BYTES, vocab_size=BYTES.vocab_size, stop_token_ids=[BYTES.eod])


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_every_sample_follows_the_schema(speculative):
    grammar = _compiler().compile("json_schema", SCHEMA)
    llm = LLM.from_model(byte_model(), tokenizer=BYTES,
                         engine_config=EngineConfig(block_size=4, num_blocks=512, speculative=speculative))
    prompt = 'answer in JSON: {"ok": true, "color": "red"} {"ok": '
    sampled = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=60, structured_outputs=grammar)
    greedy = SamplingParams(temperature=0, max_tokens=60, structured_outputs=grammar)
    free = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=60)
    outputs = llm.generate([prompt, prompt, prompt], [sampled, greedy, free])
    for output in outputs[:2]:
        for choice in output.outputs:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in outputs[0].outputs}) > 1  # the samples differ: each has its own state
    unconstrained = [c.text for c in outputs[2].outputs]
    assert not all(_valid(text) for text in unconstrained)  # the random model alone does not write the schema


def _valid(text):
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_a_grammar_for_another_vocabulary_is_refused():
    grammar = GrammarCompiler(BYTES, vocab_size=300, stop_token_ids=[BYTES.eod]).compile("json_object")
    llm = LLM.from_model(byte_model(), tokenizer=BYTES, engine_config=EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(ValueError, match="compiled for a vocabulary of 300"):
        llm.generate("x", SamplingParams(structured_outputs=grammar))
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"type": "json_object"})



@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_complete_grammar_stops_before_min_tokens(temperature):
    """Where the grammar allows only eos (the row after a draft that completes it), ``min_tokens`` (which bans
    eos) gives way: the grammar wins and the sample ends with its complete output, as vLLM decides.  Sampled
    verification used to fail the request there (a row with no token left)."""
    grammar = _compiler().compile("regex", "abcd")
    llm = LLM.from_model(byte_model(), tokenizer=BYTES,
                         engine_config=EngineConfig(block_size=4, num_blocks=64, speculative="ngram"))
    prompt = "abcd abcd abcd "  # the n-gram drafter proposes "bcd " after the first "a"
    params = SamplingParams(n=2, temperature=temperature, seed=0, max_tokens=12, min_tokens=8,
                            structured_outputs=grammar)
    free = SamplingParams(temperature=temperature, seed=0, max_tokens=12, min_tokens=8, stop_token_ids=[ord("d")])
    constrained, unconstrained = llm.generate([prompt, prompt], [params, free])
    assert llm.engine.stats["draft_tokens"] > 0
    for choice in constrained.outputs:
        assert (choice.text, choice.finish_reason) == ("abcd", "stop")
    assert len(unconstrained.outputs[0].token_ids) >= 8  # without a grammar min_tokens still holds the stop back
