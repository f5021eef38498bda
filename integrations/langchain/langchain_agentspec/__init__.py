"""langchain-agentspec: ``ChatSpecDecode``, a LangChain chat model over agentspec's decoding loop.

Its own distribution (as langchain-ollama is ollama's): it depends on langchain-core, and on the
engine, the distribution ``agentspec-decode`` (import name ``agentspec``), which never imports it.
"""

from langchain_agentspec.chat_model import ChatSpecDecode
from langchain_agentspec.tool_parsing import ParsedOutput, ToolCallSplitter, parse_tool_calls

__all__ = ["ChatSpecDecode", "ParsedOutput", "ToolCallSplitter", "parse_tool_calls"]
