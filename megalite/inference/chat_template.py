"""Chat messages to prompt text with the model's own Jinja chat template, rendered as transformers renders it.

A Hugging Face tokenizer directory carries its chat template in ``chat_template.jinja`` (with named extras
under ``additional_chat_templates/``) or, in older exports, under ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``); files win over the config entry,
as in transformers.  The template sees what ``apply_chat_template`` gives it: ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the named special tokens (``bos_token``, ``eos_token``, ...) and
any extra keyword (e.g. Qwen3's ``enable_thinking``), in a sandboxed Jinja environment with transformers'
options (``trim_blocks``, ``lstrip_blocks``, loop controls, a pass-through ``{% generation %}`` tag) and
helpers (``raise_exception``, a ``tojson`` that does not HTML-escape, ``strftime_now``, ``dict``,
``namespace``).  Only jinja2 is needed, not transformers.

OpenAI-shaped messages are accepted as the OpenAI server receives them: keys whose value is None are
dropped (transformers does the same), a content list of text parts is joined into one string, and a tool
call's ``arguments`` JSON string is decoded into the object templates expect (``arguments | tojson``).

The rendered text already holds the template's special tokens: tokenize it without adding special tokens
again (transformers calls the tokenizer with ``add_special_tokens=False``), or Llama 3 gets two BOS.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens a template sees as variables (transformers' ``special_tokens_map``)."""


class ChatTemplateError(ValueError):
    """No template, a template that does not compile, or one that raised while rendering (one-line message)."""


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ChatTemplateError("chat templates need the jinja2 package: pip install 'megalite[serve]'") from None
    return jinja2


def _environment():
    """A sandboxed environment configured as transformers configures the one ``apply_chat_template`` uses."""
    jinja2 = _jinja()

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers in training templates): the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _body(caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace without underscore attributes, which could reach interpreter internals."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set namespace attribute {name!r}")

    class DictFactory:
        """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the ``dict`` type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=DictFactory(), namespace=Namespace)
    return env


def _plain(value):
    """``value`` rebuilt from JSON types (pydantic objects such as the openai client's messages via model_dump)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    raise ChatTemplateError(f"chat messages and tools must be JSON data, got a {type(value).__name__}")


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages as templates expect them (see the module docstring); a ChatTemplateError if malformed."""
    messages = _plain(messages)
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"messages[{i}].content: only text parts are supported, got {part!r:.80}")
                parts.append(part["text"])
            message["content"] = "\n".join(parts)
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_decoded_call(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _decoded_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatTemplate:
    """One model's chat template(s) and special tokens; :meth:`render` turns messages into the prompt text.

    ``templates`` maps names to Jinja sources (``"default"``, and e.g. ``"tool_use"``, which is chosen when
    tools are given, as transformers chooses it).
    """

    def __init__(self, templates: dict[str, str] | str, special_tokens: dict[str, str] | None = None,
                 source: str = "the chat template"):
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        env = _environment()
        jinja2 = _jinja()
        self._compiled = {}
        for name, text in self.templates.items():
            try:
                self._compiled[name] = env.from_string(text)
            except jinja2.TemplateSyntaxError as err:
                raise ChatTemplateError(f"{source}: template {name!r} does not compile: {err.message} "
                                        f"(line {err.lineno})") from None

    def template_for(self, tools=None) -> str:
        """The name of the template used: ``tool_use`` with tools when present, else ``default``."""
        if tools and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        if len(self.templates) == 1:
            return next(iter(self.templates))
        raise ChatTemplateError(f"{self.source} has several chat templates ({', '.join(sorted(self.templates))}) "
                                "and none named 'default'")

    def render(self, messages, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               documents: list[dict] | None = None, **kwargs) -> str:
        """The prompt text for ``messages`` (OpenAI chat format); extra keywords become template variables."""
        jinja2 = _jinja()
        messages = normalize_messages(messages)
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in _plain(tools))):
            raise ChatTemplateError("tools must be a list of JSON-schema objects")
        name = self.template_for(tools)
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            return self._compiled[name].render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                                               add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"{self.source} rejected the messages: {err.message or type(err).__name__}") \
                from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise ChatTemplateError(f"{self.source} failed on the messages: {type(err).__name__}: {err}") from None


def _token_text(value):
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as err:
        raise ChatTemplateError(f"{path}: cannot read ({err})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object")
    return data


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ChatTemplateError(f"cannot read chat template {path}: {err}") from None


def load_chat_template(tokenizer_dir: str | None = None, template_file: str | None = None) -> ChatTemplate:
    """The chat template of the tokenizer in ``tokenizer_dir``, or the Jinja file ``template_file`` (which wins).

    Special tokens come from the directory's ``tokenizer_config.json`` (and the legacy
    ``special_tokens_map.json``) either way.  Raises :class:`ChatTemplateError` when there is no template.
    """
    special: dict[str, str] = {}
    templates: dict[str, str] = {}
    config: dict = {}
    if tokenizer_dir is not None:
        config_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        map_path = os.path.join(tokenizer_dir, "special_tokens_map.json")
        legacy = _read_json(map_path) if "added_tokens_decoder" not in config and os.path.isfile(map_path) else {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(legacy.get(name, config.get(name)))
            if text is not None:
                special[name] = text
    if template_file is not None:
        return ChatTemplate(_read_text(template_file), special, source=f"chat template {template_file}")
    if tokenizer_dir is None:
        raise ChatTemplateError("no chat template: give the model's tokenizer directory or a --chat-template file")
    main = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(main):
        templates["default"] = _read_text(main)
    extra = os.path.join(tokenizer_dir, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                templates[name[:-len(".jinja")]] = _read_text(os.path.join(extra, name))
    if not templates:
        entry = config.get("chat_template")
        if isinstance(entry, str):
            templates["default"] = entry
        elif isinstance(entry, list):
            templates = {t["name"]: t["template"] for t in entry if isinstance(t, dict)
                         and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    if not templates:
        raise ChatTemplateError(f"the model has no chat template (no chat_template.jinja or tokenizer_config.json "
                                f"'chat_template' in {tokenizer_dir}); pass one with --chat-template FILE")
    return ChatTemplate(templates, special, source=f"the chat template of {tokenizer_dir}")
