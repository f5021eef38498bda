"""langchain-agentspec: ``ChatSpecDecode``, a LangChain chat model over agentspec's decoding loop.

Its own distribution (as langchain-ollama is ollama's): it depends on langchain-core, and on the
engine, the distribution ``agentspec-decode`` (import name ``agentspec``, which never imports this
package), through the extra ``[local]``. Importing this package and building a ``ChatSpecDecode``
need no engine (so no torch): it is imported on first local use, by ``_engine``.
"""

from langchain_agentspec.chat_model import ChatSpecDecode
from langchain_agentspec.tool_parsing import ParsedOutput, ToolCallSplitter, parse_tool_calls

__all__ = ["ChatSpecDecode", "ParsedOutput", "ToolCallSplitter", "parse_tool_calls"]
