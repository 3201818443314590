"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them.

The templates are the real Llama 3 / 3.1 and Qwen2.5 / Qwen3 ones as TRL ships them (``trl/chat_templates``),
written into tiny local tokenizer directories; transformers loads the same directories and is the oracle.
"""

from __future__ import annotations

import copy

import pytest

from megalite.inference.chat_template import ChatTemplateError, load_chat_template
from tests.inference.chat_fixtures import CONVERSATION, SPECIAL, TOOLS, hf_messages, tokenizer_dir, trl_template


def transformers_render(path, messages, **kwargs) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer.apply_chat_template(hf_messages(messages), tokenize=False, **kwargs)


CASES = [  # (template, messages, tools, extra template variables)
    ("llama3", [CONVERSATION[0], CONVERSATION[1], {"role": "assistant", "content": " Sunny. "}, CONVERSATION[5]],
     None, {}),
    ("llama3_1", CONVERSATION[1:], TOOLS, {}),
    ("llama3_1", CONVERSATION, None, {"date_string": "25 Nov 2026"}),
    ("qwen2_5", CONVERSATION, TOOLS, {}),
    ("qwen2_5", [CONVERSATION[1], CONVERSATION[4], CONVERSATION[5]], None, {}),
    ("qwen3", CONVERSATION[:4] + [{"role": "assistant", "content": "21 °C.", "reasoning_content": "It said 21."},
                                  CONVERSATION[5]], TOOLS, {}),
    ("qwen3", CONVERSATION, None, {"enable_thinking": False}),
]


@pytest.mark.parametrize("name,messages,tools,variables", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("in_config", [False, True], ids=["jinja-file", "tokenizer-config"])
def test_renders_as_transformers(tmp_path, name, messages, tools, variables, in_config):
    path = tokenizer_dir(tmp_path, trl_template(name), in_config=in_config)
    template = load_chat_template(path)
    for generation_prompt in (True, False):
        ours = template.render(messages, tools=tools, add_generation_prompt=generation_prompt, **variables)
        theirs = transformers_render(path, messages, tools=tools, add_generation_prompt=generation_prompt,
                                     **variables)
        assert ours == theirs
    assert template.special_tokens == SPECIAL


def test_tool_use_template_is_chosen_with_tools(tmp_path):
    path = tokenizer_dir(tmp_path, trl_template("qwen2_5"), extra={"tool_use": trl_template("qwen3")})
    template = load_chat_template(path)
    assert template.template_for(TOOLS) == "tool_use" and template.template_for(None) == "default"
    for tools in (TOOLS, None):
        assert template.render(CONVERSATION, tools=tools) == transformers_render(path, CONVERSATION, tools=tools,
                                                                                 add_generation_prompt=True)


def test_helpers_match_transformers(tmp_path):
    """tojson options, dict, namespace, loop controls and the generation tag behave as in transformers."""
    text = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
            "{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson(indent=2, sort_keys=True) }}{% endgeneration %}"
            "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}{{ '<b>é' | tojson }}{{ strftime_now('%Y') }}")
    path = tokenizer_dir(tmp_path, text)
    assert load_chat_template(path).render(CONVERSATION[4:]) == transformers_render(path, CONVERSATION[4:],
                                                                                   add_generation_prompt=True)


def test_template_file_overrides_and_no_template_is_a_clear_error(tmp_path):
    path = tokenizer_dir(tmp_path, None)
    with pytest.raises(ChatTemplateError, match="has no chat template.*--chat-template"):
        load_chat_template(path)
    override = tmp_path / "chat.jinja"
    override.write_text(trl_template("llama3"))
    rendered = load_chat_template(path, template_file=str(override)).render([CONVERSATION[5]])
    assert rendered == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nThanks! 谢谢<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_that_raises_is_a_clear_error(tmp_path):
    path = tokenizer_dir(tmp_path, trl_template("llama3_1"))
    two_calls = copy.deepcopy(CONVERSATION)
    two_calls[2]["tool_calls"].append(copy.deepcopy(two_calls[2]["tool_calls"][0]))
    with pytest.raises(ChatTemplateError, match="rejected the messages: This model only supports single tool-calls"):
        load_chat_template(path).render(two_calls, tools=TOOLS)
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="only supports single tool-calls"):
        transformers_render(path, two_calls, tools=TOOLS)


@pytest.mark.parametrize("text,match", [
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("{{ messages[0].content.foo.bar() }}", "failed on the messages|rejected the messages"),
    ("{% set ns = namespace(_x=1) %}", "rejected the messages"),
    ("{{ messages.__class__ }}", None),
])
def test_bad_templates_fail_with_one_line(tmp_path, text, match):
    path = tokenizer_dir(tmp_path, text)
    if match is None:  # the sandbox renders unsafe attributes as undefined instead of exposing them
        assert load_chat_template(path).render(CONVERSATION[5:]) == ""
        return
    with pytest.raises(ChatTemplateError, match=match) as err:
        load_chat_template(path).render(CONVERSATION[5:])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ([{"content": "no role"}], r"messages\[0\]"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
])
def test_malformed_messages(tmp_path, messages, match):
    path = tokenizer_dir(tmp_path, trl_template("qwen2_5"))
    with pytest.raises(ChatTemplateError, match=match):
        load_chat_template(path).render(messages)
