"""``/v1/chat/completions`` in OpenAI's wire format: messages to a checked completion request, samples to messages.

A chat body is rendered with the model's chat template (:mod:`megalite.inference.chat_template`) and
tokenized without the tokenizer's own special tokens (the template already holds them); the rest is checked
as the completions body it amounts to (:func:`megalite.inference.completions.parse_completion`: the same
sampling fields, limits and messages), with ``max_completion_tokens`` (or ``max_tokens``) as the length and
``logprobs``/``top_logprobs`` as the per-token alternatives.  ``response_format`` (``json_object``,
``json_schema``), a forcing ``tool_choice`` ("required" or a named function) or vLLM's ``structured_outputs``
(one of them) become ``SamplingParams.structured_outputs`` (the server compiles it off the engine thread).
With ``tools``, replies are split into content and ``tool_calls`` in the format the template teaches
(:mod:`megalite.inference.tool_calls`), whole or streamed; finish reason "tool_calls" when there are calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.inference.chat_template import ChatTemplateError
from megalite.inference.completions import (SAMPLING_FIELDS, MAX_LOGPROBS, BadRequest, CompletionRequest,
                                            parse_completion)
from megalite.inference.grammar import GrammarError, response_format_grammar
from megalite.inference.tool_calls import ToolCallStream, detect_format, parse_tool_calls, tool_call_grammar

FIELDS = frozenset(SAMPLING_FIELDS) | {"model", "messages", "max_tokens", "max_completion_tokens", "stream",
                                 "stream_options", "logprobs", "top_logprobs", "user", "response_format", "tools",
                                 "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}


@dataclass
class ChatRequest:
    """A checked chat body: the completion request it amounts to (one prompt, its grammar on
    ``params.structured_outputs``), the tool-call format replies are parsed in (None: no tools) and whether
    ``logprobs`` were asked."""

    completion: CompletionRequest
    tool_format: str | None
    logprobs: bool


def render_chat(template, tokenizer, messages, tools=None, chat_template_kwargs=None) -> list[int]:
    """The prompt ids of ``messages`` under ``template``: rendered with the generation prompt, then tokenized
    without the tokenizer's special tokens (ChatTemplateError when the template rejects the messages)."""
    text = template.render(messages, tools=tools, add_generation_prompt=True, **(chat_template_kwargs or {}))
    return list(tokenizer.tokenize(text, add_special_tokens=False))


def parse_chat(body, checker, *, template, tokenizer, max_tokens_limit: int, max_n: int) -> ChatRequest:
    """The checked request a chat body asks for, or BadRequest naming what is wrong.

    ``template`` is the model's :class:`ChatTemplate`, or the :class:`ChatTemplateError` saying why it has
    none (its message is the 400's)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}")
    if isinstance(template, ChatTemplateError) or template is None:
        raise BadRequest(str(template or "this server has no chat template"))
    if tokenizer is None:
        raise BadRequest("chat needs a tokenizer (the checkpoint records none; start the server with --tokenizer)")
    messages, tools = body.get("messages"), body.get("tools")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of chat messages")
    if tools is not None and (not isinstance(tools, list) or not tools):
        raise BadRequest("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    try:
        prompt = render_chat(template, tokenizer, messages, tools, kwargs)
    except ChatTemplateError as error:
        raise BadRequest(str(error)) from None
    if not prompt:
        raise BadRequest("the chat template rendered the messages as an empty prompt")
    logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
    if not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs must be true or false, got {logprobs!r}")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS
                            or not logprobs):
        raise BadRequest(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], with logprobs: true")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:  # OpenAI's default: as long as the context allows
        max_tokens = max(1, min(max_tokens_limit, checker.max_context - len(prompt)))
    tool_format = None
    if tools and tool_choice != "none":
        tool_format = detect_format(template.templates[template.template_for(tools)])
        if tool_format is None:
            raise BadRequest("tools were given, but the model's chat template teaches no tool-call format "
                             "(Hermes <tool_call> or Llama 3 JSON)")
    try:
        grammar = tool_call_grammar(tools, tool_choice, tool_format) if tool_format else None
        if grammar is None and tool_choice not in (None, "auto", "none"):
            raise BadRequest("tool_choice needs tools")
        formats = (("tool_choice", grammar is not None),
                   ("response_format", body.get("response_format") not in (None, {"type": "text"})),
                   ("structured_outputs", body.get("structured_outputs") is not None))
        asked = [name for name, given in formats if given]
        if len(asked) > 1:
            raise BadRequest(f"{' and '.join(asked)} each constrain the reply: ask for one")
        grammar = grammar or response_format_grammar(body.get("response_format"))
    except (GrammarError, ValueError) as error:
        if isinstance(error, BadRequest):
            raise
        raise BadRequest(str(error)) from None
    completion = {name: body[name] for name in SAMPLING_FIELDS if name in body}
    completion.update(prompt=prompt, max_tokens=max_tokens, logprobs=(top or 0) if logprobs else None,
                      stream=body.get("stream", False), stream_options=body.get("stream_options"))
    if grammar is not None:
        completion["structured_outputs"] = grammar
    checked = parse_completion(completion, checker, max_tokens_limit=max_tokens_limit, max_n=max_n,
                               tokenizer=tokenizer)
    return ChatRequest(checked, tool_format, logprobs)


def chat_logprobs(tokenizer, tokens, logprobs, tops, top_n: int) -> dict:
    """OpenAI's chat ``logprobs`` object (``content``: one entry per token, with its ``top_n`` alternatives)."""
    def entry(token, value):
        piece = tokenizer.detokenize([token])
        return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

    content = []
    for i, token in enumerate(tokens):
        alternatives = sorted((tops[i] if tops else {}).items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(token, logprobs[i]), "top_logprobs": [entry(t, v) for t, v in alternatives]})
    return {"content": content}


def chat_choice(index: int, output, checked: ChatRequest, tokenizer) -> dict:
    """One choice of a chat reply from a finished :class:`CompletionOutput`."""
    text = output.text or ""
    message, finish = {"role": "assistant", "content": text}, output.finish_reason
    if checked.tool_format is not None:
        parsed = parse_tool_calls(text, checked.tool_format)
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"], finish = parsed.tool_calls, "tool_calls"
    logprobs = None
    if checked.logprobs:
        logprobs = chat_logprobs(tokenizer, output.token_ids, output.logprobs, output.top_logprobs,
                                 checked.completion.params.logprobs)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


class ChatStream:
    """The streamed deltas of one chat choice (each sent as its own chunk): the role first, then content
    (held back by the tool-call stream where a call may be starting), and at the end any tool calls whole,
    then the finish reason."""

    def __init__(self, index: int, checked: ChatRequest, tokenizer):
        self.index, self.checked, self.tokenizer = index, checked, tokenizer
        self.tools = ToolCallStream(checked.tool_format) if checked.tool_format else None
        self.started = False

    def chunks(self, event_choice: dict) -> list[dict]:
        """The chunk choices for one engine event of this sample (token ids, text, log-probs, finish)."""
        text = event_choice["text"] or ""
        delta = {"content": self.tools.feed(text) if self.tools else text}
        if not self.started:
            delta, self.started = {"role": "assistant", **delta}, True
        logprobs = None
        if self.checked.logprobs:
            logprobs = chat_logprobs(self.tokenizer, event_choice["token_ids"], event_choice["logprobs"],
                                     event_choice["top_logprobs"], self.checked.completion.params.logprobs)
        finish = event_choice["finish_reason"]
        if finish is None and delta == {"content": ""} and logprobs is None:
            return []  # text held back as a possible tool call
        if finish is None or self.tools is None:
            return [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        parsed = self.tools.finish()
        delta["content"] = (delta["content"] or "") + (parsed.content or "")
        out = [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
        if parsed.tool_calls:
            calls = [{"index": j, **call} for j, call in enumerate(parsed.tool_calls)]
            out.append({"index": self.index, "delta": {"tool_calls": calls}, "logprobs": None,
                        "finish_reason": None})
            finish = "tool_calls"
        out.append({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": finish})
        return out
