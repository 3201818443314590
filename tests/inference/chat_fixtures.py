"""Tiny local Hugging Face tokenizer directories holding real chat templates (TRL ships the originals in
``trl/chat_templates``), and an OpenAI-shaped conversation with tools, for the chat-template and tool-call tests."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "unk_token": "<unk>"}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]

CONVERSATION = [  # as an OpenAI client sends it
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                 {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
    {"role": "assistant", "content": "It is 21 °C in Paris."},
    {"role": "user", "content": "Thanks! 谢谢"},
]


def hf_messages(messages):
    """The same conversation the way transformers users write it: text content, arguments as objects."""
    out = copy.deepcopy(messages)
    for message in out:
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(part["text"] for part in message["content"])
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def trl_template(name: str) -> str:
    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("trl (which ships the reference chat templates) is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "chat_templates", name + ".jinja")
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def tokenizer_dir(tmp_path, template, *, in_config: bool = False, extra: dict | None = None) -> str:
    """A tiny word-level HF tokenizer directory holding ``template`` (a .jinja file, or the config entry)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = str(tmp_path / "tok")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL).save_pretrained(path)
    if template is not None and in_config:
        config_path = os.path.join(path, "tokenizer_config.json")
        with open(config_path) as handle:
            config = json.load(handle)
        config["chat_template"] = template
        with open(config_path, "w") as handle:
            json.dump(config, handle)
    elif template is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as handle:
            handle.write(template)
    for name, text in (extra or {}).items():
        os.makedirs(os.path.join(path, "additional_chat_templates"), exist_ok=True)
        with open(os.path.join(path, "additional_chat_templates", name + ".jinja"), "w", encoding="utf-8") as handle:
            handle.write(text)
    return path
