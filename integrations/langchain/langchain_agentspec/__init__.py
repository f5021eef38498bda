"""langchain-agentspec: ``ChatSpecDecode``, a LangChain chat model over agentspec's decoding loop.

Its own distribution (as langchain-ollama is ollama's): it depends on langchain-core, and on the
engine, the distribution ``agentspec-decode`` (import name ``agentspec``, which never imports this
package), through the extra ``[local]``. Importing this package and building a ``ChatSpecDecode``
need no engine (so no torch): it is imported on first local use, by ``_engine``.
``get_speculation_callback`` (``totals``) adds up the calls' speculation and latency saved over an
agent run.
"""

from langchain_agentspec.chat_model import ChatSpecDecode
from langchain_agentspec.tool_parsing import ParsedOutput, ToolCallSplitter, parse_tool_calls
from langchain_agentspec.totals import SpeculationCallbackHandler, SpeculationTotals, get_speculation_callback

__all__ = [
    "ChatSpecDecode",
    "ParsedOutput",
    "SpeculationCallbackHandler",
    "SpeculationTotals",
    "ToolCallSplitter",
    "get_speculation_callback",
    "parse_tool_calls",
]
