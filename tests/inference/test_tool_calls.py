"""Tool calls parsed from model output match transformers' ``parse_response`` (with TRL's response schemas for
the Llama 3.1 and Qwen templates) and come out as OpenAI ``tool_calls`` objects the openai client accepts."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from megalite.inference.tool_calls import ParsedReply, ToolCallStream, detect_format, parse_tool_calls
from tests.inference.chat_fixtures import tokenizer_dir, trl_template

HERMES = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [true, null]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {"s": "é \\" }"}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "It is sunny in Paris.",
]
LLAMA3 = [
    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    '{"name": "f", "parameters": {"nested": {"x": [1, 2]}, "text": "a } b"}}',
    "It is sunny in Paris.",
]


def as_peer(parsed: ParsedReply) -> dict:
    """Our reply in the shape transformers' parse_response gives (arguments decoded, no ids, empty parts left out)."""
    out = {"role": "assistant"}
    if parsed.content is not None:
        out["content"] = parsed.content
    if parsed.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                               "arguments": json.loads(c["function"]["arguments"])}}
                             for c in parsed.tool_calls]
    return out


@pytest.mark.parametrize("template,fmt,texts,end", [("qwen2_5", "hermes", HERMES, "<|im_end|>"),
                                                     ("qwen3", "hermes", HERMES, "<|im_end|>"),
                                                     ("llama3_1", "llama3_json", LLAMA3, "<|eot_id|>")])
def test_matches_transformers_parse_response(tmp_path, template, fmt, texts, end):
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    source = trl_template(template)
    assert detect_format(source) == fmt
    tokenizer = add_response_schema(AutoTokenizer.from_pretrained(tokenizer_dir(tmp_path, source)))
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    for text in texts:
        peer = tokenizer.parse_response(text + end, prefix=prefix)
        if peer.get("content") == "":
            del peer["content"]
        assert as_peer(parse_tool_calls(text, fmt)) == peer, text


def test_openai_shape_and_ids():
    ids = (f"call_{i}" for i in itertools.count())
    parsed = parse_tool_calls(HERMES[1], "hermes", new_id=lambda: next(ids))
    assert parsed.content is None
    assert parsed.tool_calls == [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [true, null]}'}},
        {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": '{"s": "é \\" }"}'}}]
    pytest.importorskip("openai")
    from openai.types.chat import ChatCompletionMessage

    message = ChatCompletionMessage.model_validate({"role": "assistant", "content": parsed.content,
                                                    "tool_calls": parsed.tool_calls})
    assert [c.function.name for c in message.tool_calls] == ["f", "g"]
    default = parse_tool_calls(HERMES[0], "hermes").tool_calls[0]["id"]
    assert default.startswith("call_") and default != parse_tool_calls(HERMES[0], "hermes").tool_calls[0]["id"]


@pytest.mark.parametrize("text,fmt,calls", [
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}', "llama3_json",
     [("f", {"a": 1}), ("g", {})]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 2}"}\n</tool_call>', "hermes", [("f", {"a": 2})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 3}}', "hermes", [("f", {"a": 3})]),  # cut at a stop token
])
def test_variants(text, fmt, calls):
    parsed = parse_tool_calls(text, fmt)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("text,fmt", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "hermes"),  # bad JSON
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "hermes"),  # no name
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "hermes"),  # arguments not an object
    ('{"name": "f", "parameters": {"a": 1}} and then some prose', "llama3_json"),
    ('{"city": "Paris"}', "llama3_json"),
    ("", "hermes"),
])
def test_malformed_calls_stay_content(text, fmt):
    parsed = parse_tool_calls(text, fmt)
    assert parsed.tool_calls == [] and parsed.content == (text or None)


def test_unknown_format_and_undetected_template():
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'"):
        parse_tool_calls("x", "mistral")
    assert detect_format(trl_template("llama3")) is None


@pytest.mark.parametrize("fmt,texts", [("hermes", HERMES + ["Sure.  \n<tool_c", "a <tool_call> b", "x <tool_"]),
                                       ("llama3_json", LLAMA3 + ["  {not a call", "<|python_tag|>{\"name\": \"f\"}",
                                                                 "<|python", "{}"])])
def test_streamed_reply_agrees_with_unstreamed(fmt, texts):
    generator = torch.Generator().manual_seed(0)
    for text in texts:
        whole = parse_tool_calls(text, fmt, new_id=lambda: "call")
        for _ in range(8):
            cuts = sorted(torch.randint(len(text) + 1, (3,), generator=generator).tolist())
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            stream = ToolCallStream(fmt, new_id=lambda: "call")
            sent = "".join(stream.feed(piece) for piece in pieces)
            if whole.tool_calls:  # nothing of a call is sent as content while streaming
                assert sent == (whole.content or "")[:len(sent)] and "<tool_call>" not in sent
            end = stream.finish()
            assert ((sent + (end.content or "")) or None) == whole.content, (text, pieces)
            assert end.tool_calls == whole.tool_calls
