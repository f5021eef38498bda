"""A prepared request's decoding steps turned into reply deltas: text, whole tool calls, the finish.

``reply_deltas`` is the loop both front ends run over ``agentspec.stream``'s Steps (the LangChain
chat model turns each ``Delta`` into a chunk, the server into an SSE event or one response):

- text comes as soon as the verified tokens make it safe to show, never tool-call markup (the
  parser holds text back while a ``<tool_call>`` may be starting);
- each tool call comes whole, once its block closes, with its index in the reply; an invalid one
  (markup that does not parse, a call cut by ``max_tokens``) has the same OpenAI shape, the model's
  raw text as its arguments and an ``error`` saying why;
- with one call wanted (a named tool, ``parallel_tool_calls=False``), the reply finishes ("stop")
  as soon as that call is out, and the caller stops decoding there: the deltas end after the one
  with a ``finish_reason``, and the caller closes the steps (which releases the pair's lock and
  saves the verified part to the prefix cache).

``speculative_metadata`` is the per-call speculation record both report (LangChain's
``response_metadata["speculative"]``, the server's ``metrics.agentspec``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentspec.chat.request import PreparedRequest, ReplyParser
from agentspec.stats import DecodeStats

if TYPE_CHECKING:
    from agentspec.decode import Step


@dataclass
class Delta:
    """What one decoding step adds to the reply."""

    text: str  # text newly safe to show (may be "" on a step that only finishes or only calls)
    calls: list[dict]  # OpenAI-format calls completed in this step; an invalid one carries "error"
    first_index: int  # index in the reply of ``calls[0]`` (calls are numbered from 0 across the reply)
    finish_reason: str | None  # "stop" or "length" on the last delta, else None
    stats: DecodeStats  # the call's running stats (final on the last delta)


def reply_deltas(request: PreparedRequest, steps: Iterable[Step], started: float) -> Iterator[Delta]:
    """The deltas of ``request``'s reply, from the Steps of ``agentspec.stream`` over its prompt.

    ``started``: ``time.perf_counter()`` when the call began, for ``stats.total_time_s`` when the
    reply finishes on a complete call (the loop, not told, would go on decoding). Steps that add
    nothing to show give no delta.
    """
    parser = ReplyParser(request)
    for step in steps:
        reason = step.finish_reason
        events = parser.feed(step.text)
        if reason is None and parser.complete:
            reason = "stop"  # the one wanted call is complete: stop decoding here
            step.stats.finish_reason = reason
            step.stats.total_time_s = time.perf_counter() - started
        if reason is not None:
            events += parser.finish()
        text = "".join(value for kind, value in events if kind == "text")
        calls = [value for kind, value in events if kind != "text"]
        if text or calls or reason is not None:
            yield Delta(text, calls, parser.calls - len(calls), reason, step.stats)
        if reason is not None:
            return


def speculative_metadata(stats: DecodeStats) -> dict[str, Any]:
    """The call's speculation in agentspec's own terms (``agentspec.stats`` states the conventions)."""
    return {
        "drafter": stats.drafter,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "verify_steps": stats.verify_steps,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "acceptance_histogram": list(stats.acceptance_histogram),
        # per draft source ("auto" picks "suffix", "model" or "none" each pass): passes, drafted, accepted
        "source_steps": dict(stats.source_steps),
        "source_draft_tokens": dict(stats.source_draft_tokens),
        "source_accepted_tokens": dict(stats.source_accepted_tokens),
        # drafter exceptions this call survived with the target alone; a drafter it skipped (cool-down)
        "draft_failures": stats.draft_failures,
        "draft_cooldown": stats.draft_cooldown,
    }
