"""The conversation a LangChain run belongs to, read from the run's metadata.

LangGraph copies a run's ``configurable`` ``thread_id`` into the metadata of every callback under
it: a chat model called by ``create_agent`` with ``config={"configurable": {"thread_id": "t-1"}}``
sees ``run_manager.metadata["thread_id"] == "t-1"``. Apps (and LangChain's
``RunnableWithMessageHistory`` configurations) pass ``session_id`` or ``conversation_id`` in the
metadata instead. The keys, and which wins when several are set, are those OpenInference reads for
its ``session.id``, so a trace backend and agentspec name a conversation alike.

``ChatSpecDecode`` records the id on its span as ``gen_ai.conversation.id``; a remote client sends
it as its session header. Needs no engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KEYS = ("session_id", "conversation_id", "thread_id")  # first set one wins (OpenInference's order)


def conversation_id(metadata: Mapping[str, Any] | None) -> str | None:
    """The run's conversation id, as a string; None when its metadata names none (the conventions
    ask for no made-up fallback)."""
    for key in KEYS if metadata else ():
        value = metadata.get(key)
        if value is not None and value != "":
            return str(value)
    return None
