"""Chat requests without a framework: OpenAI-format messages, tools, ``tool_choice`` and
``response_format`` in; prompt ids, the reply's grammar and its forced start out; the reply's text
parsed back into content and OpenAI-format tool calls, by ``agentspec_toolcalls`` (the parser's own
distribution, which the LangChain integration's remote path imports without the engine).

prompt.py      messages -> prompt through the chat template (the Hermes fallback for tools)
request.py     prepare() and prepare_call() (one request fitted to a pair), ReplyParser
reply.py       run(): a prepared call decoded into text, whole calls and the finish, then its record
completion.py  prepare_completion(): a plain prompt (text or ids) as a call, no template or grammar
"""

from agentspec.chat.prompt import Prompt, render, tool_call_text
from agentspec.chat.reply import ChatRun, Delta, reply_deltas, run, speculative_metadata
from agentspec.chat.request import ChatCall, PreparedRequest, ReplyParser, prepare, prepare_call
from agentspec_toolcalls import Reply, ToolCallSplitter, new_response_id, parse_reply

__all__ = [
    "ChatCall",
    "ChatRun",
    "Delta",
    "PreparedRequest",
    "Prompt",
    "Reply",
    "ReplyParser",
    "ToolCallSplitter",
    "new_response_id",
    "parse_reply",
    "prepare",
    "prepare_call",
    "render",
    "reply_deltas",
    "run",
    "speculative_metadata",
    "tool_call_text",
]
