"""Structured output in the engine: ``SamplingParams.structured_outputs`` in vLLM's shape
(:class:`StructuredOutputsParams`: json, regex, choice, grammar or json_object), compiled by the engine, masks
every sample's tokens, composed with n > 1 (forked samples each keep their own state), prefix sharing, greedy
and sampled decoding and n-gram speculation; a sample ends with reason "stop" once its output is complete."""

import json

import pytest

from megalite.inference import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from tests.inference.server_harness import BYTES, byte_model

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from megalite.inference.grammar import GrammarError  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_every_sample_follows_the_schema(speculative):
    grammar = StructuredOutputsParams(json=SCHEMA)
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


def test_regex_choice_grammar_and_json_object_as_vllm_spells_them():
    """Each of vLLM's kinds, as a StructuredOutputsParams or a dict of its fields (the server's body)."""
    llm = LLM.from_model(byte_model(), tokenizer=BYTES, engine_config=EngineConfig(block_size=4, num_blocks=512))
    choices = ['say "yes"', "no\\way", "caf\u00e9"]
    kinds = [(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"
              and t[:3].isdigit() and t[4:].isalpha()),
             ({"choice": choices}, lambda t: t in choices),
             (StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")"'), lambda t: t[0] + t[-1] == "()"
              and set(t[1:-1]) <= set("abc") and len(t) > 2),  # GBNF
             (StructuredOutputsParams(grammar='start: "<" NAME ">"\nNAME: /[xy]+/'), lambda t: t[0] + t[-1] == "<>"
              and set(t[1:-1]) <= set("xy")),  # Lark
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    params = [SamplingParams(n=3, temperature=1.0, seed=6, max_tokens=40, structured_outputs=k) for k, _ in kinds]
    for output, (_, valid) in zip(llm.generate(["pick: "] * len(kinds), params), kinds):
        for choice in output.outputs:
            assert choice.finish_reason == "stop" and valid(choice.text), choice.text


def test_bad_structured_outputs_are_refused():
    for value, message in (({}, "exactly one of json, regex, choice, grammar and json_object, got none"),
                           ({"regex": "a", "choice": ["a"]}, r"got \['regex', 'choice'\]"),
                           ({"choice": []}, "choice must be a non-empty list"),
                           ({"json": 3}, "json must be a JSON schema"),
                           ({"json_object": False}, "json_object must be true"),
                           ({"guided_json": {}}, r"unknown fields \['guided_json'\]"),
                           (object(), "StructuredOutputsParams")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(structured_outputs=value)
    llm = LLM.from_model(byte_model(), tokenizer=BYTES, engine_config=EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(GrammarError, match="does not compile"):
        llm.generate(["x", "y"], [SamplingParams(), SamplingParams(structured_outputs={"regex": "(unclosed"})])
    assert not llm.engine.requests and not llm.engine.has_unfinished()  # nothing queued before the grammar failed
    no_text = LLM.from_model(byte_model(), engine_config=EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        no_text.generate([[1, 2]], SamplingParams(structured_outputs={"json_object": True}))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_complete_grammar_stops_before_min_tokens(temperature):
    """Where the grammar allows only eos (the row after a draft that completes it), ``min_tokens`` (which bans
    eos) gives way: the grammar wins and the sample ends with its complete output, as vLLM decides.  Sampled
    verification used to fail the request there (a row with no token left)."""
    grammar = StructuredOutputsParams(regex="abcd")
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


def test_a_steps_grammar_masks_are_one_computation(monkeypatch):
    """Every decoding sequence under a grammar gets its mask from one parallel computation per engine step (it was
    one per sequence: ~30% of throughput at 64 requests), and the outputs are those of masking row by row."""
    from megalite.inference import grammar

    grammar_params = StructuredOutputsParams(json=SCHEMA)
    prompts = ['answer in JSON: {"ok": ' + str(i) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=grammar_params)

    def run(batched: bool):
        llm = LLM.from_model(byte_model(), tokenizer=BYTES, engine_config=EngineConfig(block_size=4, num_blocks=512))
        if not batched:
            monkeypatch.setattr(type(llm.engine), "_grammar_rows", lambda self, *args: {})
        calls = []
        real = grammar.GrammarState._masks
        monkeypatch.setattr(grammar.GrammarState, "_masks",
                            staticmethod(lambda states: calls.append(len(states)) or real(states)))
        texts = [o.outputs[0].text for o in llm.generate(prompts, params)]
        monkeypatch.undo()
        return texts, calls, llm.engine.stats["steps"]

    texts, calls, steps = run(batched=True)
    per_row_texts, per_row_calls, _ = run(batched=False)
    assert texts == per_row_texts and all(_valid(t) for t in texts)
    assert len(calls) <= steps and max(calls) == len(prompts)  # all five rows in one computation
    assert len(per_row_calls) > steps and max(per_row_calls) == 1
