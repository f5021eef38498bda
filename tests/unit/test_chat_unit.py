"""ChatSpecDecode without weights: construction, validation, tool binding, identity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_core.tools import tool
from pydantic import ValidationError

import langchain_agentspec as lc
from agentspec.chat.request import normalise_tool_choice
from agentspec.models import ModelPair
from langchain_agentspec import ChatSpecDecode


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def now() -> str:
    """The current time."""
    return "12:00"


def test_exports_pinned():
    assert lc.__all__ == [
        "ChatSpecDecode",
        "ParsedOutput",
        "SpeculationCallbackHandler",
        "SpeculationTotals",
        "ToolCallSplitter",
        "get_speculation_callback",
        "parse_tool_calls",
    ]


def test_construction_is_cheap_and_lazy():
    llm = ChatSpecDecode()
    assert llm._loaded is None  # no weights until the first call
    assert llm.model_name == "SmolLM2-135M-Instruct"
    assert llm._identifying_params["model"] == "SmolLM2-135M-Instruct"
    assert llm._identifying_params["drafter"] == "auto"


def test_standard_arguments_are_accepted_and_typos_are_not():
    ChatSpecDecode(api_key="x", timeout=3, max_retries=2, streaming=True)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        ChatSpecDecode(max_new_tokens=5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"drafter": "medusa"}, "drafter"),
        ({"prefix_cache": 0}, "prefix_cache"),
        ({"max_draft_tokens": -1}, "num_draft_tokens"),
    ],
)
def test_bad_values_fail_at_construction(kwargs, match):
    with pytest.raises((ValidationError, ValueError, TypeError), match=match):
        ChatSpecDecode(**kwargs)


def test_pair_excludes_model_arguments():
    pair = ModelPair(target=None, tokenizer=None, name="m")  # no weights needed to build one
    with pytest.raises(ValidationError, match="device"):
        ChatSpecDecode(pair=pair, device="cpu")
    llm = ChatSpecDecode(pair=pair, model="m")
    assert llm.model_name == "m" and llm.load() is pair  # shared, not copied


def test_ls_params():
    llm = ChatSpecDecode(max_tokens=10, stop=["x"], temperature=0.5)
    params = llm._get_ls_params()
    assert params["ls_provider"] == "agentspec" and params["ls_model_type"] == "chat"
    assert (params["ls_max_tokens"], params["ls_stop"], params["ls_temperature"]) == (10, ["x"], 0.5)
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"


@pytest.mark.parametrize(
    ("choice", "want"),
    [
        (None, None),
        ("auto", None),
        ("none", "none"),
        ("any", "any"),
        ("required", "any"),
        (True, "any"),
        ("add", "add"),
        ({"type": "function", "function": {"name": "now"}}, "now"),
    ],
)
def test_tool_choice(choice, want):
    assert normalise_tool_choice(choice, ["add", "now"]) == want


def test_bind_tools():
    bound = ChatSpecDecode().bind_tools([add, now], tool_choice="required")
    assert [t["function"]["name"] for t in bound.kwargs["tools"]] == ["add", "now"]
    assert bound.kwargs["tool_choice"] == "any"
    with pytest.raises(ValueError, match="launch"):
        ChatSpecDecode().bind_tools([add], tool_choice="launch")


def test_byte_budget_gives_an_own_cache():
    llm = ChatSpecDecode(prefix_cache=1 << 20)
    cache = llm._prefix_cache(llm.prefix_cache)
    assert cache.budget_bytes == 1 << 20 and llm._prefix_cache(1 << 20) is cache
    assert llm._prefix_cache(False) is False and llm._prefix_cache(True) is True


# A child process where the engine and what it stands on cannot be imported, as in an environment
# that installed langchain-agentspec without [local] (a client of a remote endpoint).
_WITHOUT_ENGINE = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"agentspec", "torch", "transformers", "xgrammar"}:
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Refuse())
from langchain_core.tools import tool
from pydantic import BaseModel

import langchain_agentspec
from langchain_agentspec import ChatSpecDecode

assert langchain_agentspec.__file__.startswith(sys.argv[1]), langchain_agentspec.__file__

@tool
def add(a: int, b: int) -> int:
    \"\"\"Add two integers.\"\"\"
    return a + b

class Answer(BaseModel):
    value: int

llm = ChatSpecDecode()
llm.bind_tools([add], tool_choice="any")
llm.with_structured_output(Answer)
# the parser is its own distribution (agentspec-toolcalls), so tool calls read without the engine
parsed = langchain_agentspec.parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>')
assert [c["name"] for c in parsed.tool_calls] == ["add"], parsed
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"agentspec", "torch", "transformers"})
assert not loaded, loaded
named = ChatSpecDecode(model="m")  # its first call reaches the engine in _stream, past the model name
for use in (lambda: llm.invoke("hi"), lambda: named.invoke("hi"), lambda: ChatSpecDecode(pair=1)):
    try:
        use()
    except ImportError as exc:
        print(exc)
    else:
        raise AssertionError("no ImportError")
"""


def test_import_and_construction_need_no_engine():
    root = str(Path(lc.__file__).parents[1])  # this copy of the package, not another one installed
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ENGINE, root],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert run.returncode == 0, run.stderr
    from langchain_agentspec._engine import INSTALL_HINT

    assert run.stdout.splitlines() == [INSTALL_HINT] * 3, f"{run.stdout=}"
