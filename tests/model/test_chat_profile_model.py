"""The profile of a lazy ChatSpecDecode agrees with the embedded pair once it is loaded."""

from __future__ import annotations

import json

import pytest

import agentspec
from agentspec.models import DEFAULT_CONTEXT, ensure_default_model, read_max_context
from langchain_agentspec import ChatSpecDecode

pytestmark = pytest.mark.model


def test_the_default_context_is_the_loaded_pairs():
    pair = agentspec.load_pair()
    config = json.loads((ensure_default_model() / "config.json").read_text())
    assert DEFAULT_CONTEXT == read_max_context() == pair.max_context == config["max_position_embeddings"]
    # the converted folder read as any folder is: the same window
    assert read_max_context(str(ensure_default_model())) == pair.max_context
    lazy, loaded = ChatSpecDecode(max_tokens=64), ChatSpecDecode(pair=pair, max_tokens=64)
    assert lazy._loaded is None
    assert lazy.profile == loaded.profile, f"{lazy.profile=} {loaded.profile=}"
