"""A scripted tool call for the LangChain tests that need one from a random model (telemetry, Phoenix).

Imported by test modules in several rungs (pytest puts tests/, conftest.py's folder, on sys.path).
"""

from __future__ import annotations

from langchain_core.tools import tool

from agentspec.chat import tool_call_text
from langchain_agentspec import ChatSpecDecode


@tool
def now() -> str:
    """The current time."""
    return "12:00"


class WholeCall(ChatSpecDecode):
    """Writes the whole ``now`` call into the reply when ``tool_choice="now"`` (a random model cannot)."""

    def _prefill(self, messages, tools, tool_choice):
        return tool_call_text("now", {}) if tool_choice == "now" else None
