"""Structured output: sampled completions of a tiny random model under a grammar always satisfy it.

The model is a 2-layer random GPT over megalite's ByteTokenizer ids (one byte per token), so any text can
be produced; sampling is at temperature 1 through the sampler's own ``target_probs``, the grammar mask
applied by :func:`apply_grammar` in one batched step for all rows.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from megalite.data.tokenizer import ByteTokenizer
from megalite.inference.params import SamplingParams, StructuredOutputsParams
from megalite.inference.sampler import draw, target_probs, verify
from megalite.models.kv_cache import KVCache
from tests.inference.common import tiny_model

llguidance = pytest.importorskip("llguidance")
from megalite.inference.grammar import (GrammarCompiler, GrammarError, apply_grammar,  # noqa: E402
                                        response_format_grammar)

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eod
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "age", "color", "ok", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER)


def sample_under(grammar, prompts: list[bytes], n: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` samples per prompt (prompts of one length) at temperature 1, decoded together with a KV cache,
    all rows masked in one batched step and drawn with the engine's :func:`draw` (row ``i``'s noise seed
    ``seed * 10^6 + i``); each sample has its own grammar state."""
    model = tiny_model(vocab_size=TOKENIZER.vocab_size, max_position_embeddings=256, hidden_size=32)
    ids = torch.tensor([list(p) for p in prompts for _ in range(n)])
    states = [grammar.new_state() for _ in range(ids.shape[0])]
    outputs: list[list[int]] = [[] for _ in states]
    done = [False] * len(states)
    cache, params = KVCache(), SamplingParams(temperature=1.0)
    seeds, start = [seed * 10 ** 6 + i for i in range(len(states))], ids.shape[1]
    for step in range(max_tokens):
        with torch.no_grad():
            logits = model(ids, kv_cache=cache)[:, -1, :TOKENIZER.vocab_size].float()
        live = [None if finished else state for state, finished in zip(states, done)]
        probs = target_probs(apply_grammar(logits, live), params)
        tokens = draw(probs, seeds, [start + step] * len(seeds))
        for i, token in enumerate(tokens):
            if done[i]:
                continue
            states[i].advance(token)
            if token == EOS:
                done[i] = True
            else:
                outputs[i].append(token)
        if all(done):
            break
        ids = torch.tensor(tokens)[:, None]
    assert all(done), "a sample did not finish within max_tokens"
    assert all(s.is_terminated for s in states)
    return outputs


def test_json_schema_samples_all_validate_with_n_above_one(compiler):
    jsonschema = pytest.importorskip("jsonschema")
    grammar = compiler.compile("json_schema", SCHEMA)
    prompts = [f"person {i:02d}: ".encode() for i in range(25)]
    outputs = sample_under(grammar, prompts, n=4, max_tokens=160)
    assert len(outputs) == 100
    texts = [TOKENIZER.detokenize(out) for out in outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 90  # the samples of one request are independent, not copies
    assert compiler.compile("json_schema", json.dumps(SCHEMA)) is grammar  # cached by content


def test_json_object_regex_and_ebnf(compiler):
    for text in (TOKENIZER.detokenize(o) for o in sample_under(compiler.compile("json_object"), [b"x"], 8, 200, 4)):
        assert isinstance(json.loads(text), dict)
    regex = r"(yes|no|[0-9]{1,4}-[a-c]{2})"
    for text in (TOKENIZER.detokenize(o) for o in sample_under(compiler.compile("regex", regex), [b"?"], 16, 16, 2)):
        assert re.fullmatch(regex, text), text
    ebnf = 'root ::= item ("," item)*\nitem ::= "a" | "bb" | [0-9]\n'
    samples = sample_under(compiler.compile("ebnf", ebnf), [b"!"], 16, 64, 3)
    for text in (TOKENIZER.detokenize(o) for o in samples):
        assert re.fullmatch(r"(a|bb|[0-9])(,(a|bb|[0-9]))*", text), text


def test_mask_advance_rollback_and_drafts(compiler):
    state = compiler.compile("regex", "ab[0-9]c").new_state()
    mask = state.allowed_token_mask()
    assert mask.dtype == torch.bool and mask.shape == (TOKENIZER.vocab_size,)
    assert mask.nonzero().flatten().tolist() == [ord("a")]
    masks = []
    for ch in "ab7c":
        masks.append(state.allowed_token_mask())
        state.advance(ord(ch))
    assert state.allowed_token_mask().nonzero().flatten().tolist() == [EOS]
    assert state.is_terminated
    state.rollback(2)
    assert not state.is_terminated and torch.equal(state.allowed_token_mask(), masks[2])
    with pytest.raises(GrammarError, match="token 120 is not allowed"):
        state.advance(ord("x"))
    assert torch.equal(state.allowed_token_mask(), masks[2])  # a refused token leaves the state as it was
    drafts = state.draft_masks([ord("7"), ord("c")])  # both valid: three masks, the state unchanged
    assert torch.equal(drafts[0], masks[2]) and torch.equal(drafts[1], masks[3])
    assert drafts[2].nonzero().flatten().tolist() == [EOS]
    assert torch.equal(state.allowed_token_mask(), masks[2])
    bad = state.draft_masks([ord("x"), ord("c")])  # forbidden first draft: its mask repeats
    assert torch.equal(bad[0], masks[2]) and torch.equal(bad[1], masks[2]) and torch.equal(bad[2], masks[2])


def test_speculative_verification_under_draft_masks(compiler):
    """Target rows masked with draft_masks make the sampler's exact verification emit only grammar-valid tokens:
    a forbidden draft has probability 0 after masking, so it is always rejected."""
    grammar = compiler.compile("regex", "(ab|cd)+x")
    generator = torch.Generator().manual_seed(4)
    for trial in range(40):
        state = grammar.new_state()
        for token in b"abcd"[:trial % 5]:
            state.advance(token)
        drafts = torch.tensor(list(b"abcdx"))[torch.randint(5, (3,), generator=generator)].tolist()
        logits = torch.randn(len(drafts) + 1, TOKENIZER.vocab_size, generator=generator)
        masked = logits.masked_fill(~state.draft_masks(drafts), float("-inf"))
        params = SamplingParams(temperature=0.0 if trial % 2 else 1.0)
        emitted = verify(masked, drafts, params, trial, 3 + trial % 5)
        for token in emitted:
            state.advance(token)  # raises GrammarError on a token the grammar forbids
        accepted = len(emitted) - 1
        assert emitted[:accepted] == drafts[:accepted]


def test_apply_grammar_leaves_unconstrained_rows(compiler):
    logits = torch.randn(3, TOKENIZER.vocab_size, generator=torch.Generator().manual_seed(0))
    state = compiler.compile("regex", "[a-c]+").new_state()
    out = apply_grammar(logits, [None, state, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1])
    assert allowed.nonzero().flatten().tolist() == [ord("a"), ord("b"), ord("c")]
    assert torch.equal(out[1][allowed], logits[1][allowed])
    assert apply_grammar(logits, [None] * 3) is logits
    with pytest.raises(ValueError, match="3 logits rows but 2 grammar states"):
        apply_grammar(logits, [None, state])


@pytest.mark.parametrize("kind,source,match", [
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}, "does not exist"),
    ("json_schema", {"type": 5}, "type must be a string"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", [1], "must be a JSON object"),
    ("json_schema", "[" * 100_000 + "]" * 100_000, "RecursionError"),
    ("regex", "(ab", "unclosed group"),
    ("ebnf", "root ::= (", "does not compile"),
    ("xml", "<a/>", "unknown grammar kind 'xml'"),
])
def test_grammar_that_does_not_compile_is_a_clear_error(compiler, kind, source, match):
    with pytest.raises(GrammarError, match=match) as err:
        compiler.compile(kind, source)
    assert "\n" not in str(err.value)


def test_hostile_schema_hits_the_compile_limit():
    """300 integer-range alternatives take ~0.2 s to compile: over a 1 ms limit a clear error (the caller waits
    no longer), under the default 1 s limit a grammar."""
    hostile = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": i,
                                                                     "maximum": i * 1000 + 7}},
                          "required": [f"k{i}"]} for i in range(300)]}
    with pytest.raises(GrammarError, match="took longer than the compile limit of 0.001 s"):
        GrammarCompiler(TOKENIZER, compile_time_limit_s=0.001).compile("json_schema", hostile)
    state = GrammarCompiler(TOKENIZER).compile("json_schema", hostile).new_state()
    assert state.allowed_token_mask().nonzero().flatten().tolist() == [ord("{")]


def test_response_format():
    assert response_format_grammar(None) is None and response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert response_format_grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}) == \
        StructuredOutputsParams(json=SCHEMA)
    for bad, match in (({"type": "yaml"}, "unknown response_format type 'yaml'"), ("json", "must be an object"),
                       ({"type": "json_schema", "json_schema": {"schema": 3}}, "json_schema must be")):
        with pytest.raises(GrammarError, match=match):
            response_format_grammar(bad)


TEXTS = ["abc abd bead cab dab", "aa bb cc dd ee", "deed bead cede ace bad"] * 20


def megalite_tokenizers(tmp_path):
    """megalite's SentencePiece and GPT-2 BPE tokenizers and a transformers fast tokenizer, trained here."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from megalite.data.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer, train_sentencepiece

    sp = SentencePieceTokenizer(train_sentencepiece(TEXTS, str(tmp_path / "sp"), vocab_size=40))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=280, special_tokens=["<|endoftext|>"])
    vocab, merges = bpe.save_model(str(tmp_path))
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    return {"sentencepiece": sp, "gpt2": GPT2BPETokenizer(vocab, merges), "hf": hf}


def test_tokenizers_and_vocab_padding(tmp_path):
    """Random walks under a regex with each tokenizer's vocabulary (padded up to a larger model vocabulary)
    decode, with the tokenizer's own decoder, to text the regex matches; padding ids are never allowed."""
    pytest.importorskip("transformers")
    regex = "[a-e]{2,6}( [a-e]{2,6}){0,3}"
    for name, tok in megalite_tokenizers(tmp_path).items():
        decode = getattr(tok, "detokenize", None) or tok.decode
        compiler = GrammarCompiler(tok, vocab_size=320)
        assert compiler.tokenizer_vocab < 320
        grammar = compiler.compile("regex", regex)
        generator = torch.Generator().manual_seed(0)
        for _ in range(10):
            state, ids = grammar.new_state(), []
            while True:
                mask = state.allowed_token_mask()
                assert not mask[compiler.tokenizer_vocab:].any()
                token = int(torch.rand(320, generator=generator).masked_fill(~mask, -1).argmax())
                state.advance(token)
                if token in compiler.stop_token_ids:
                    break
                ids.append(token)
            assert re.fullmatch(regex, decode(ids)), (name, decode(ids))
    with pytest.raises(GrammarError, match="smaller than the tokenizer's"):
        GrammarCompiler(TOKENIZER, vocab_size=100)
    from megalite.data.tokenizer import NullTokenizer

    with pytest.raises(GrammarError, match="needs a text tokenizer; NullTokenizer"):
        GrammarCompiler(NullTokenizer(10))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}


@pytest.mark.parametrize("fmt,choice", [("hermes", {"type": "function", "function": {"name": "get_weather"}}),
                                        ("llama3_json", "required")])
def test_forced_tool_calls_parse_and_validate(compiler, fmt, choice):
    """tool_choice enforced by a grammar: every sample parses into calls of the allowed tools whose
    arguments validate against the tool's parameter schema."""
    jsonschema = pytest.importorskip("jsonschema")
    from megalite.inference.tool_calls import parse_tool_calls, tool_call_grammar

    grammar = compiler.compile(*tool_call_grammar([WEATHER, CLOCK], choice, fmt).spec())
    names = {"get_weather"} if isinstance(choice, dict) else {"get_weather", "now"}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for out in sample_under(grammar, [b"call: "], n=12, max_tokens=120, seed=5):
        parsed = parse_tool_calls(TOKENIZER.detokenize(out), fmt)
        assert parsed.content is None and len(parsed.tool_calls) == 1
        function = parsed.tool_calls[0]["function"]
        assert function["name"] in names
        jsonschema.validate(json.loads(function["arguments"]), schemas[function["name"]])
    state = grammar.new_state()
    for ch in ('<tool_call>\n{"name": "' if fmt == "hermes" else '{"name": "').encode():
        state.advance(ch)
    first_letters = {chr(t) for t in state.allowed_token_mask().nonzero().flatten().tolist()}
    assert first_letters == {name[0] for name in names}


def test_required_hermes_admits_several_calls_and_choice_errors(compiler):
    from megalite.inference.tool_calls import tool_call_grammar

    state = compiler.compile(*tool_call_grammar([WEATHER, CLOCK], "required", "hermes").spec()).new_state()
    for ch in ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
               '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":2}}\n</tool_call>').encode():
        state.advance(ch)
    assert state.allowed_token_mask()[EOS]
    assert tool_call_grammar([WEATHER], "auto", "hermes") is None and tool_call_grammar(None, "none", "hermes") is None
    named_nope = {"type": "function", "function": {"name": "nope"}}
    for tools, choice, match in (([WEATHER], named_nope, "'nope', which is not"),
                                 ([], "required", "tool_choice needs tools"), ([WEATHER], "always", "must be 'none'")):
        with pytest.raises(ValueError, match=match):
            tool_call_grammar(tools, choice, "hermes")
