"""``/v1/chat/completions`` through the real server, driven by the official ``openai`` client (its response
models parse every reply): chat equal to ``LLM.generate`` of the rendered prompt, n > 1, logprobs equal to the
model's, stop strings, streamed deltas equal to the whole reply, JSON-schema and json_object response formats
(100 samples at temperature 1 all validate), Hermes tool calls (forced, whole and streamed), and the 400s: a
template that raises, a model with no template, a schema that does not compile."""

import json

import pytest
import torch

from megalite.data.tokenizer import ByteTokenizer
from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference.api_server import ServerConfig
from megalite.inference.chat_template import ChatTemplate, ChatTemplateError
from tests.inference.chat_fixtures import trl_template
from tests.inference.common import tiny_model
from tests.inference.server_harness import BYTES, Server

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "required": ["ok", "size"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_light", "description": "Switch a light.",
                                           "parameters": {"type": "object", "properties": {
                                               "room": {"enum": ["hall", "kitchen"]}, "on": {"type": "boolean"}},
                                               "required": ["room", "on"], "additionalProperties": False}}}]


def _model():
    """A tiny llama over ByteTokenizer's ids with room for a chat template's system prompt."""
    return tiny_model(vocab_size=BYTES.vocab_size, max_position_embeddings=2048, init_method_std=0.3)


def _server(model, template, **config):
    return Server(model, ServerConfig(max_tokens_limit=200, **config), chat_template=template,
                  engine_config=EngineConfig(block_size=16, num_blocks=512))


def _chat(client, **body):
    """The reply, checked by the client's own model."""
    raw = client.chat.completions.with_raw_response.create(model="megalite", **body)
    ChatCompletion.model_validate(json.loads(raw.http_response.text))
    return raw.parse()


def _stream(client, **body):
    chunks = list(client.chat.completions.create(model="megalite", stream=True, **body))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    return chunks


def test_chat_through_the_openai_client():
    model, template = _model(), ChatTemplate(trl_template("qwen2_5"))
    with _server(model, template) as server:
        client = server.client()
        prompt = BYTES.tokenize(template.render(MESSAGES, add_generation_prompt=True))
        reply = _chat(client, messages=MESSAGES, max_completion_tokens=8, temperature=0, logprobs=True,
                      top_logprobs=2)
        offline = LLM.from_model(model, tokenizer=BYTES).generate(
            [prompt], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
        choice = reply.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == offline.text
        assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 8
        # OpenAI's id prefixes: chatcmpl- for chat, cmpl- for text completions.
        assert reply.id.startswith("chatcmpl-") and len(reply.id) > len("chatcmpl-")
        text_reply = client.completions.create(model="megalite", prompt=prompt, max_tokens=2, temperature=0)
        assert text_reply.id.startswith("cmpl-")
        ids = prompt + offline.token_ids
        with torch.no_grad():
            full = model(torch.tensor([ids]))[0].float().log_softmax(-1)
        entries = choice.logprobs.content
        assert len(entries) == 8
        for i, entry in enumerate(entries):
            position = len(prompt) + i
            assert abs(entry.logprob - full[position - 1, ids[position]].item()) < 1e-5
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6

        # Streamed deltas add up to the same reply; the role comes first, the finish reason last.
        chunks = _stream(client, messages=MESSAGES, max_completion_tokens=8, temperature=0,
                         stream_options={"include_usage": True})
        assert chunks[0].choices[0].delta.role == "assistant"
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-") and chunks[0].id != reply.id
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8
        streamed = _stream(client, messages=MESSAGES, max_completion_tokens=8, temperature=0, logprobs=True,
                           top_logprobs=2)
        entries_streamed = [e for c in streamed if c.choices and c.choices[0].logprobs
                            for e in c.choices[0].logprobs.content]
        # (the same tokens and alternatives; log-probs to the 1e-5 above: the prompt now comes from the prefix cache)
        assert [(e.token, [t.token for t in e.top_logprobs]) for e in entries_streamed] == \
            [(e.token, [t.token for t in e.top_logprobs]) for e in entries]
        assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(entries_streamed, entries))

        # n > 1 with a seed: n different samples, reproducible.
        first = _chat(client, messages=MESSAGES, max_tokens=6, n=3, seed=5, temperature=1.0)
        again = _chat(client, messages=MESSAGES, max_tokens=6, n=3, seed=5, temperature=1.0)
        assert [c.index for c in first.choices] == [0, 1, 2]
        assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
        assert len({c.message.content for c in first.choices}) > 1

        # A stop string is cut from the reply.
        plain = _chat(client, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        text = plain.choices[0].message.content
        stop = text[4:6]
        stopped = _chat(client, messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop],
                        extra_body={"ignore_eos": True})
        assert stopped.choices[0].message.content == text[:text.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"
        assert server.idle()


def test_json_schema_response_format_100_samples():
    with _server(_model(), ChatTemplate(trl_template("qwen2_5")), max_n=25) as server:
        client = server.client()
        texts = []
        for seed in range(4):
            reply = _chat(client, messages=MESSAGES, max_tokens=60, n=25, seed=seed, temperature=1.0,
                          response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
            assert all(c.finish_reason == "stop" for c in reply.choices)
            texts += [c.message.content for c in reply.choices]
        assert len(texts) == 100 and len(set(texts)) > 1
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)
        # Any object: biased towards closing quotes and braces, so a random model's strings end.
        reply = _chat(client, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=1,
                      logit_bias={ord('"'): 10, ord("}"): 10}, response_format={"type": "json_object"})
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_tool_calls_in_the_hermes_format():
    template = ChatTemplate(trl_template("qwen2_5"))
    with _server(_model(), template) as server:
        client = server.client()
        for choice in ("required", {"type": "function", "function": {"name": "set_light"}}):
            reply = _chat(client, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=150, seed=2,
                          logit_bias={BYTES.eod: 5})
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
            for call in message.tool_calls:
                assert call.function.name == "set_light" and call.id.startswith("call_")
                jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
            chunks = _stream(client, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=150, seed=2,
                             logit_bias={BYTES.eod: 5})
            streamed = [call for c in chunks for call in (c.choices[0].delta.tool_calls or []) if c.choices]
            assert [(c.function.name, c.function.arguments) for c in streamed] == \
                [(c.function.name, c.function.arguments) for c in message.tool_calls]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        # "auto": the reply is parsed; a random model writes no call, so it is content.
        reply = _chat(client, messages=MESSAGES, tools=TOOLS, max_tokens=5, temperature=0)
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


def test_bad_chat_requests_get_400():
    raising = ChatTemplate("{{ raise_exception('only user messages, please') }}")
    missing = ChatTemplateError("the model has no chat template; pass one with --chat-template FILE")
    with _server(_model(), raising) as server:
        client = server.client()
        with pytest.raises(openai.BadRequestError, match="only user messages, please"):
            client.chat.completions.create(model="megalite", messages=MESSAGES)
    with _server(_model(), ChatTemplate(trl_template("qwen2_5"))) as server:
        client = server.client()
        for body, message in (
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "does not compile"),
                ({"response_format": {"type": "xml"}}, "unknown response_format type"),
                ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
                ({"messages": []}, "messages must be"),
                ({"top_logprobs": 2}, "top_logprobs")):
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(**{"model": "megalite", "messages": MESSAGES, **body})
        assert server.idle()
    with Server(_model(), tokenizer=ByteTokenizer(), chat_template=missing) as server:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            server.client().chat.completions.create(model="megalite", messages=MESSAGES)


def test_structured_outputs_in_vllms_shape_over_http():
    """vLLM's ``structured_outputs`` body field (the client's ``extra_body``) on both endpoints, compiled by the
    server; one that does not compile, or that competes with response_format, is a 400."""
    template = ChatTemplate(trl_template("qwen2_5"))
    choices = ["red", "green", "blue"]
    with Server(_model(), chat_template=template, engine_config=EngineConfig(block_size=16, num_blocks=64)) as server:
        client = server.client()
        reply = client.completions.create(model="megalite", prompt="colour: ", max_tokens=10, temperature=1.0, n=4,
                                          seed=1, extra_body={"structured_outputs": {"choice": choices}})
        assert all(c.text in choices and c.finish_reason == "stop" for c in reply.choices)
        streamed = client.completions.create(model="megalite", prompt="id: ", max_tokens=10, temperature=0,
                                             stream=True, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        assert len(text) == 4 and text.isdigit()
        chat = _chat(client, messages=MESSAGES, max_tokens=10, temperature=0,
                     extra_body={"structured_outputs": {"regex": "(yes|no)!"}})
        assert chat.choices[0].message.content in ("yes!", "no!")
        for create, body, message in (
                (client.completions.create, {"prompt": "x", "extra_body": {"structured_outputs": {"regex": "(a"}}},
                 "does not compile"),
                (client.completions.create, {"prompt": "x", "extra_body": {"structured_outputs": {"json": "{"}}},
                 "not valid JSON"),
                (client.completions.create, {"prompt": "x", "extra_body": {"structured_outputs": {"choices": ["a"]}}},
                 "unknown fields"),
                (client.chat.completions.create, {"messages": MESSAGES, "response_format": {"type": "json_object"},
                                                  "extra_body": {"structured_outputs": {"regex": "a"}}},
                 "response_format and structured_outputs each constrain the reply")):
            with pytest.raises(openai.BadRequestError, match=message):
                create(model="megalite", **body)
        assert server.idle()


def test_llm_chat_renders_as_the_server_does(tmp_path):
    """``LLM.chat`` (one conversation or several) equals ``generate`` of the prompt the template renders; a
    tokenizer directory's own template is used by default, a Jinja source overrides it."""
    from tests.inference.chat_fixtures import tokenizer_dir

    model, source = _model(), trl_template("qwen2_5")
    llm = LLM.from_model(model, tokenizer=BYTES, engine_config=EngineConfig(block_size=16, num_blocks=256))
    params = SamplingParams(max_tokens=5, temperature=0)
    prompt = BYTES.tokenize(ChatTemplate(source).render(MESSAGES, add_generation_prompt=True))
    expected = llm.generate([prompt], params)[0].outputs[0]
    one = llm.chat(MESSAGES, params, chat_template=source)
    two = llm.chat([MESSAGES, MESSAGES[1:]], params, chat_template=ChatTemplate(source))
    assert one[0].prompt_token_ids == prompt and one[0].outputs[0].token_ids == expected.token_ids
    assert two[0].outputs[0].text == expected.text and len(two) == 2
    assert two[1].prompt_token_ids == BYTES.tokenize(ChatTemplate(source).render(MESSAGES[1:]))

    from megalite.data.tokenizer import build_tokenizer

    hf = build_tokenizer(tokenizer_dir(tmp_path, "{% for m in messages %}{{ m.content }} {% endfor %}"),
                         "HuggingFaceTokenizer")
    hf_llm = LLM.from_model(tiny_model(vocab_size=hf.vocab_size), tokenizer=hf)
    out = hf_llm.chat([{"role": "user", "content": "hello hello"}], SamplingParams(max_tokens=1, temperature=0))
    assert out[0].prompt_token_ids == [1, 1]  # "hello hello " without the tokenizer's special tokens
    with pytest.raises(ChatTemplateError, match="no chat template"):
        LLM.from_model(tiny_model(vocab_size=hf.vocab_size), tokenizer=ByteTokenizer()).chat(MESSAGES)
