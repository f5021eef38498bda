"""LangChain integration: ``ChatSpecDecode``, a chat model over agentspec's decoding loop.

Needs ``langchain-core``; the core package ``agentspec`` does not import this module until
``agentspec.ChatSpecDecode`` is first used.
"""

from integrations.langchain.chat_model import ChatSpecDecode
from integrations.langchain.tool_parsing import ParsedOutput, ToolCallSplitter, parse_tool_calls

__all__ = ["ChatSpecDecode", "ParsedOutput", "ToolCallSplitter", "parse_tool_calls"]
