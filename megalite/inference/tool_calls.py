"""Tool calls parsed out of a chat model's text, in the format its chat template taught it, as OpenAI objects.

Two formats cover the templates megalite serves:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and any template that writes ``<tool_call>``): optional text, then
  one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole reply is a bare JSON object ``{"name": ..., "parameters":
  {...}}`` (``"arguments"`` accepted too), optionally after ``<|python_tag|>``; several calls may be
  separated by ``;``.

A reply whose calls do not parse (bad JSON, no ``name``, an argument object that is not an object) is
returned as plain content with no calls, so a model that merely talks about JSON is not turned into a
broken call.  Each call becomes ``{"id": "call_...", "type": "function", "function": {"name", "arguments"}}``
with ``arguments`` a JSON string, as the OpenAI API sends it; ``content`` is None when the reply is only
calls.

``tool_choice`` "required" or a named function is enforced with a grammar (:func:`tool_call_grammar`, for
``megalite.inference.grammar``) that admits only calls in the template's format whose arguments satisfy the
tool's parameter schema.

Streaming: :class:`ToolCallStream` passes content deltas through until a tool call may be starting, holds
the rest, and at the end gives the calls (whole, one delta each, as OpenAI streams may) from the same parse,
so a streamed reply and the same reply unstreamed agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from megalite.inference.params import StructuredOutputsParams

TOOL_CALL_FORMATS = ("hermes", "llama3_json")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedReply:
    """A reply split into its text (None when there is none) and its OpenAI ``tool_calls`` (empty when none)."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def detect_format(chat_template: str) -> str | None:
    """The tool-call format a chat template's source teaches, or None when it teaches neither."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:
        return "llama3_json"
    return None


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(obj, argument_keys: tuple[str, ...], new_id: Callable[[], str]) -> dict | None:
    """One OpenAI tool call from a decoded ``{"name": ..., <argument key>: {...}}``, or None if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[key] for key in argument_keys if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": new_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parse_hermes(text: str, new_id) -> ParsedReply | None:
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls = []
    for block in _HERMES_BLOCK.finditer(text, start):
        try:
            obj = json.loads(block.group(1).strip())
        except ValueError:
            return None
        call = _call(obj, ("arguments", "parameters"), new_id)
        if call is None:
            return None
        calls.append(call)
    return ParsedReply(text[:start].rstrip() or None, calls)


def _parse_llama3_json(text: str, new_id) -> ParsedReply | None:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return None
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = _call(obj, ("parameters", "arguments"), new_id)
        if call is None:
            return None
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
    return ParsedReply(None, calls)


_PARSERS = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json}


def parse_tool_calls(text: str, fmt: str, new_id: Callable[[], str] = _new_id) -> ParsedReply:
    """Split a finished reply (detokenized, special tokens skipped) into content and tool calls in ``fmt``."""
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(TOOL_CALL_FORMATS)}")
    parsed = _PARSERS[fmt](text, new_id)
    return parsed if parsed is not None else ParsedReply(text or None)


class ToolCallStream:
    """Incremental form of :func:`parse_tool_calls` for streamed replies.

    :meth:`feed` takes each new piece of text and returns the content that can be sent now: text that cannot
    belong to a tool call (held back: a possible start of ``<tool_call>``, trailing whitespace before one,
    and in ``llama3_json`` a reply that opens like a JSON call).  :meth:`finish` parses the whole reply and
    returns the content still to send and the tool calls; the content sent in all equals the unstreamed
    ``parse_tool_calls(text).content``.
    """

    def __init__(self, fmt: str, new_id: Callable[[], str] = _new_id):
        if fmt not in _PARSERS:
            raise ValueError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(TOOL_CALL_FORMATS)}")
        self.fmt, self.new_id = fmt, new_id
        self.text, self.sent = "", 0

    def _safe_end(self) -> int:
        """How much of the text so far is content whatever follows."""
        text = self.text
        if self.fmt == "llama3_json":
            head = text.lstrip()
            if not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
                return 0
            return len(text)
        start = text.find("<tool_call>")
        if start >= 0:
            return len(text[:start].rstrip())
        end = len(text)
        for k in range(min(len("<tool_call>") - 1, len(text)), 0, -1):  # a partial marker at the end
            if "<tool_call>".startswith(text[-k:]):
                end = len(text) - k
                break
        return len(text[:end].rstrip())

    def feed(self, delta: str) -> str:
        self.text += delta
        end = max(self._safe_end(), self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> ParsedReply:
        """The content not yet sent (None if none) and the reply's tool calls."""
        parsed = parse_tool_calls(self.text, self.fmt, self.new_id)
        content = parsed.content or ""
        rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
        self.sent = len(self.text)
        return ParsedReply(rest or None, parsed.tool_calls)


def tool_call_grammar(tools: list[dict] | None, tool_choice, fmt: str) -> StructuredOutputsParams | None:
    """The (Lark) grammar forcing the reply to be tool calls, for ``tool_choice`` "required" (any tool;
    one or more calls in ``hermes``, one in ``llama3_json``) or ``{"type": "function", "function": {"name":
    ...}}`` (that tool, once); None for "auto", "none" or no choice.  ValueError for a choice naming no tool."""
    from megalite.inference.grammar import JSON_LAYOUT

    if tool_choice in (None, "auto", "none"):
        return None
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(TOOL_CALL_FORMATS)}")
    functions = [t.get("function") for t in tools or [] if isinstance(t, dict) and t.get("type") == "function"]
    functions = [f for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str)]
    if not functions:
        raise ValueError("tool_choice needs tools: a list of {'type': 'function', 'function': {'name': ...}}")
    if tool_choice != "required":
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    key = "parameters" if fmt == "llama3_json" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               key: f.get("parameters") or {"type": "object"}},
              "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
    call = "%json " + json.dumps(schema)
    if fmt == "llama3_json":
        return StructuredOutputsParams(grammar=f"start: call\ncall: {call}")
    start = 'block ("\\n" block)*' if tool_choice == "required" else "block"
    block = 'block: "<tool_call>\\n" call "\\n</tool_call>"'
    return StructuredOutputsParams(grammar=f"start: {start}\n{block}\ncall: {call}")
