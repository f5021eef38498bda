"""Rendering messages with the chat template: tool turns, the fallback tool prompt, forced calls, and
the prefix property (the prompt of turn n is a token prefix of turn n+1's) on SmolLM2's tokenizer.

Only the tokenizer is loaded (no weights), from the embedded model's folder.
"""

from __future__ import annotations

import copy
import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentspec.chat.prompt import forced_prefix, template_features
from langchain_agentspec.messages import render
from langchain_agentspec.tool_parsing import parse_tool_calls

pytestmark = pytest.mark.model


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def now() -> str:
    """The current time."""
    return "12:00"


TOOLS = [convert_to_openai_tool(add), convert_to_openai_tool(now)]

# A Qwen2.5-style template that renders tools= and tool_calls itself (trimmed to what we use).
NATIVE_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are helpful.{% endif %}
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from agentspec.models import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture(scope="module")
def native_tokenizer(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = NATIVE_TEMPLATE
    return tok


def conversation() -> list:
    """A conversation that only grows: each prefix ends where the assistant speaks next."""
    return [
        [SystemMessage("You are terse."), HumanMessage("What is 2 + 3, and what time is it?")],
        [AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"}])],
        [ToolMessage("5", tool_call_id="c1", name="add")],
        [AIMessage("Now the time.", tool_calls=[{"name": "now", "args": {}, "id": "c2"}])],
        [ToolMessage("12:00", tool_call_id="c2", name="now"), HumanMessage("Thanks! Say it again.")],
        [AIMessage(" 2 + 3 = 5; it is 12:00.")],  # leading space
        [HumanMessage("And in French?")],
        [AIMessage("\n\nCinq, et il est midi. ✓")],  # leading newlines, non-ASCII
        [HumanMessage("ok")],
    ]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("which", ["smollm2", "native"])
def test_prompt_is_prefix_of_next_turn(smol_tokenizer, native_tokenizer, tools, which):
    tok = smol_tokenizer if which == "smollm2" else native_tokenizer
    history: list = []
    previous = None
    for grow in conversation():
        history += grow
        if not isinstance(history[-1], AIMessage):  # the model speaks next: a prompt is rendered
            ids = render(tok, history, tools).ids
            if previous is not None:
                n = len(previous)
                at = next((i for i in range(n) if ids[i] != previous[i]), n)
                assert ids[:n] == previous, f"{len(history)=} {at=} {tok.decode(previous[at - 8 :])!r}"
            previous = ids


def test_smollm2_fallback_prompt(smol_tokenizer):
    native, native_calls, fmt = template_features(smol_tokenizer)
    assert (native, native_calls, fmt) == (False, False, "hermes")
    history = [m for grow in conversation()[:3] for m in grow]
    text = render(smol_tokenizer, history, TOOLS).text
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n"), text[:80]
    assert json.dumps(TOOLS[0]) in text
    # the earlier call is written back in the form the prompt asks for, the result as role "tool"
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # without tools, no tool prompt and the template's default system line
    plain = render(smol_tokenizer, [HumanMessage("hi")]).text
    assert "# Tools" not in plain and "SmolLM" in plain


def test_native_template_gets_tools_and_calls(native_tokenizer):
    assert template_features(native_tokenizer) == (True, True, "hermes")
    history = [m for grow in conversation()[:3] for m in grow]
    prompt = render(native_tokenizer, history, TOOLS)
    assert prompt.native_tools
    assert '"name": "add"' in prompt.text and "# Tools" in prompt.text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt.text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response>" in prompt.text


def test_forced_prefix():
    # a named tool: the call up to its first required argument
    assert forced_prefix("hermes", "add", TOOLS) == '<tool_call>\n{"name": "add", "arguments": {"a":'
    # a tool without arguments: the whole call, which parses as it stands
    whole = forced_prefix("hermes", "now", TOOLS)
    assert parse_tool_calls(whole, {"add", "now"}).tool_calls[0]["name"] == "now"
    # "any" with several tools: up to the name, which the model chooses
    assert forced_prefix("hermes", "any", TOOLS) == '<tool_call>\n{"name": "'
    # Llama-3 style bare JSON
    assert forced_prefix("json", "add", TOOLS) == '{"name": "add", "parameters": {"a":'
    assert forced_prefix("hermes", None, TOOLS) == forced_prefix("hermes", "none", TOOLS) == ""


def test_forced_prefix_is_in_prompt(smol_tokenizer):
    prompt = render(smol_tokenizer, [HumanMessage("2+2?")], TOOLS, "add")
    assert prompt.text.endswith("<|im_start|>assistant\n" + prompt.forced)
    assert smol_tokenizer.decode(prompt.ids) == prompt.text


def test_images_are_refused(smol_tokenizer):
    msg = HumanMessage([{"type": "text", "text": "what is this"}, {"type": "image", "url": "http://x/y.png"}])
    with pytest.raises(ValueError, match="text only"):
        render(smol_tokenizer, [msg])


def test_invalid_calls_are_shown_as_written(smol_tokenizer):
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,'
    call = {"type": "invalid_tool_call", "name": "add", "args": bad, "id": "x", "error": None}
    reply = AIMessage("", invalid_tool_calls=[call])
    history = [HumanMessage("1+1?"), reply, ToolMessage("bad", tool_call_id="x")]
    assert f"<|im_start|>assistant\n{bad}<|im_end|>" in render(smol_tokenizer, history, TOOLS).text
