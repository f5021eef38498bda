"""ChatSpecDecode's model profile: the capability flags, and the token limits read without weights.

``max_input_tokens`` is the longest prompt a call takes and ``max_output_tokens`` what ``max_tokens``
allows within the context; both come from the pair when one is given, else from the target's
config alone (construction stays lazy), and are left out where neither can be read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from langchain_core.language_models import ModelProfile

import langchain_agentspec as lc
from agentspec.decode import check_prompt
from agentspec.models import DEFAULT_CONTEXT
from langchain_agentspec import ChatSpecDecode

FLAGS = {
    "open_weights": True,
    "text_inputs": True,
    "text_outputs": True,
    "tool_calling": True,
    "tool_choice": True,
    "tool_call_streaming": True,
    "structured_output": True,
    "temperature": True,
}


def test_every_key_is_langchains():
    declared = set(ModelProfile.__annotations__)
    llm = ChatSpecDecode()
    assert set(llm.profile) <= declared, set(llm.profile) - declared
    assert {k: llm.profile[k] for k in FLAGS} == FLAGS


def test_default_model_limits_without_loading():
    llm = ChatSpecDecode()
    assert llm._loaded is None  # the profile read no weights
    assert llm.profile["name"] == "SmolLM2-135M-Instruct"
    assert llm.profile["max_input_tokens"] == DEFAULT_CONTEXT - 1
    assert llm.profile["max_output_tokens"] == 512  # max_tokens' default
    assert ChatSpecDecode(max_tokens=None).profile["max_output_tokens"] == DEFAULT_CONTEXT - 1
    assert ChatSpecDecode(max_tokens=1 << 20).profile["max_output_tokens"] == DEFAULT_CONTEXT - 1


def test_folder_limits_come_from_its_config(tmp_path):
    # a folder with a config and no weights at all: reading the profile cannot have loaded any
    transformers.LlamaConfig(max_position_embeddings=300).save_pretrained(tmp_path)
    llm = ChatSpecDecode(model=str(tmp_path), max_tokens=None)
    assert llm.profile["max_input_tokens"] == 299 and llm.profile["max_output_tokens"] == 299, llm.profile
    assert ChatSpecDecode(model=str(tmp_path), max_tokens=20).profile["max_output_tokens"] == 20


def test_an_unreadable_model_keeps_the_flags(tmp_path):
    llm = ChatSpecDecode(model=str(tmp_path / "missing"))
    assert "max_input_tokens" not in llm.profile and "max_output_tokens" not in llm.profile
    assert {k: llm.profile[k] for k in FLAGS} == FLAGS


def test_pair_limits_agree_with_what_a_call_takes(pair):
    llm = ChatSpecDecode(pair=pair, max_tokens=None)
    longest = llm.profile["max_input_tokens"]
    assert longest == pair.max_context - 1 == llm.profile["max_output_tokens"], llm.profile
    check_prompt(pair, [1] * longest)  # the longest prompt is taken...
    with pytest.raises(ValueError, match="context"):
        check_prompt(pair, [1] * (longest + 1))  # ...one more is not
    assert ChatSpecDecode(pair=pair, max_tokens=7).profile["max_output_tokens"] == 7


_WITHOUT_ENGINE = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"agentspec", "torch", "transformers", "xgrammar"}:
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Refuse())
from langchain_agentspec import ChatSpecDecode

print(sorted(ChatSpecDecode().profile))
"""


def test_without_the_engine_the_limits_are_left_out():
    root = str(Path(lc.__file__).parents[1])  # this copy of the package
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ENGINE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(sorted(FLAGS)), run.stdout
