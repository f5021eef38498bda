"""A prepared request's decoding steps turned into reply deltas: text, whole tool calls, the finish.

``reply_deltas`` is the loop both front ends run over ``agentspec.stream``'s Steps (the LangChain
chat model turns each ``Delta`` into a chunk, the server into an SSE event or one response):

- text comes as soon as the verified tokens make it safe to show, never tool-call markup (the
  parser holds text back while a ``<tool_call>`` may be starting);
- each tool call comes whole, once its block closes, with its index in the reply; an invalid one
  (markup that does not parse, a call cut by ``max_tokens``) has the same OpenAI shape, the model's
  raw text as its arguments and an ``error`` saying why;
- the finish is the loop's: with one call wanted (a named tool, ``parallel_tool_calls=False``) the
  request's fitted config stops decoding at the call's closing tag (``PreparedRequest.fitted``), and
  any call after the first is dropped; the deltas end after the one with a ``finish_reason``.

``run`` decodes a prepared ``ChatCall`` into these deltas (``ChatRun``) and, once closed, hands back
the call's one ``CallRecord`` (steps, decoder time, latency saved) that every report reads.

``speculative_metadata`` is the per-call speculation record both report (LangChain's
``response_metadata["speculative"]``, the server's ``metrics.agentspec``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from agentspec.chat.logprobs import LogprobFormat
from agentspec.chat.request import ChatCall, PreparedRequest, ReplyParser
from agentspec.decode import CallRecord, Run, Step
from agentspec.decode import run as run_steps
from agentspec.logprobs import TokenLogprob
from agentspec.stats import DecodeStats


@dataclass
class Delta:
    """What one decoding step adds to the reply."""

    text: str  # text newly safe to show (may be "" on a step that only finishes or only calls)
    calls: list[dict]  # OpenAI-format calls completed in this step; an invalid one carries "error"
    first_index: int  # index in the reply of ``calls[0]`` (calls are numbered from 0 across the reply)
    finish_reason: str | None  # "stop" or "length" on the last delta, else None
    stats: DecodeStats  # the call's running stats (final on the last delta)
    # the log-probabilities of the tokens verified since the last delta, OpenAI's ``logprobs.content``
    # entries (``agentspec.chat.logprobs``); None when the call did not ask for them
    logprobs: list[dict] | None = None


def reply_deltas(
    request: PreparedRequest, steps: Iterable[Step], logprobs: LogprobFormat | None = None
) -> Iterator[Delta]:
    """The deltas of ``request``'s reply, from the Steps of ``agentspec.stream`` over its prompt.
    Steps that add nothing to show give no delta; their tokens' log-probabilities (``logprobs``:
    the call asked for them) come with the next delta."""
    parser = ReplyParser(request)
    held: list[TokenLogprob] = []
    for step in steps:
        reason = step.finish_reason
        events = parser.feed(step.text)
        if reason is not None:
            events += parser.finish()
        text = "".join(value for kind, value in events if kind == "text")
        calls = [value for kind, value in events if kind != "text"]
        held += step.logprobs or ()
        if text or calls or reason is not None:
            content = logprobs.content(held) if logprobs is not None else None
            held = []
            yield Delta(text, calls, parser.calls - len(calls), reason, step.stats, content)
        if reason is not None:
            return


class ChatRun:
    """One prepared call decoded: iterate for its ``Delta``s, then ``close`` for its ``CallRecord``.

    Close it in the thread that iterated it, whether the reply finished, the caller left early or an
    error was raised: closing takes the call out of the pair's scheduler, saves the verified part to
    the prefix cache and makes the record.
    """

    def __init__(self, call: ChatCall, steps: Run, cancelled: threading.Event | None = None):
        self.call, self._run, self._cancelled = call, steps, cancelled

    def __iter__(self) -> Iterator[Delta]:
        call = self.call
        form = None
        if call.config.logprobs is not None:
            eos = call.config.eos_token_ids or call.pair.eos_token_ids
            form = LogprobFormat(call.pair.tokenizer, eos)
        return reply_deltas(call.request, self._steps(), form)

    def _steps(self) -> Iterator[Step]:
        """The Steps, ending after the pass in progress once ``cancelled`` is set."""
        for step in self._run:
            yield step
            if self._cancelled is not None and self._cancelled.is_set():
                return

    def close(self) -> CallRecord:
        return self._run.close()


def run(
    call: ChatCall,
    drafter: Any = None,
    prefix_cache: Any = True,
    namespace: str | None = None,
    cancelled: threading.Event | None = None,
) -> ChatRun:
    """Decode ``call`` (``agentspec.chat.prepare_call``) with ``drafter`` and ``prefix_cache`` as
    ``agentspec.stream`` takes them, in ``namespace`` (the tenant's cache and drafting memory);
    ``cancelled``, once set, ends the deltas after the pass in progress (a consumer that left)."""
    ids = call.request.prompt.ids
    steps = run_steps(
        call.pair,
        ids,
        drafter,
        prefix_cache,
        call.grammar,
        namespace,
        cancelled=cancelled,
        config=call.config,
    )
    return ChatRun(call, steps, cancelled)


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
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
        # per draft source ("auto" picks "suffix", "model" or "none" each pass): passes, drafted, accepted
        "source_steps": dict(stats.source_steps),
        "source_draft_tokens": dict(stats.source_draft_tokens),
        "source_accepted_tokens": dict(stats.source_accepted_tokens),
        # drafter exceptions this call survived with the target alone; a drafter it skipped (cool-down)
        "draft_failures": stats.draft_failures,
        "draft_cooldown": stats.draft_cooldown,
    }
