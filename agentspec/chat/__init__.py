"""Chat requests without a framework: OpenAI-format messages, tools, ``tool_choice`` and
``response_format`` in; prompt ids, the reply's grammar and its forced start out; the reply's text
parsed back into content and OpenAI-format tool calls.

prompt.py      messages -> prompt through the chat template (the Hermes fallback for tools)
tool_calls.py  tool calls found in model output, whole or streamed
request.py     prepare() and ReplyParser: what the LangChain chat model and the server call
reply.py       reply_deltas(): a prepared request's decoding steps as text, whole calls and the finish
"""

from agentspec.chat.prompt import Prompt, render, tool_call_text
from agentspec.chat.reply import Delta, reply_deltas, speculative_metadata
from agentspec.chat.request import PreparedRequest, ReplyParser, prepare
from agentspec.chat.tool_calls import Reply, ToolCallSplitter, new_response_id, parse_reply

__all__ = [
    "Delta",
    "PreparedRequest",
    "Prompt",
    "Reply",
    "ReplyParser",
    "ToolCallSplitter",
    "new_response_id",
    "parse_reply",
    "prepare",
    "render",
    "reply_deltas",
    "speculative_metadata",
    "tool_call_text",
]
