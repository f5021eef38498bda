"""A response's choices put together from their jobs' deltas, and shaped as each route answers.

Each choice's job (``worker.Job``) hands its deltas to the event loop, where they go into the
choice's ``Reply``; a route's ``Form`` turns the replies into its API's objects: the chat route's
``chat.completion`` (or ``chat.completion.chunk`` events, ``ChatForm``), the completions route's
``text_completion``, whole or in chunks (``TextForm``). Merging the choices' events, whole or
streamed, is the app's (``app.answer``), the same for both routes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agentspec.chat import Delta, speculative_metadata
from agentspec.decode import CallRecord
from agentspec.serve import protocol as P
from agentspec.serve.worker import Job


class Reply:
    """A reply (one choice) being put together from its deltas: content, valid calls, invalid calls."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.text: list[str] = []
        self.calls: list[dict] = []
        self.invalid: list[dict] = []  # not OpenAI's: reported under metrics.agentspec
        self.logprobs: list[dict] | None = None  # OpenAI's entries, when the request asked
        self.last: Delta | None = None  # the delta with the finish reason, once it came
        self.record: CallRecord | None = None  # the choice's record, once its decode is closed

    def add(self, delta: Delta) -> list[dict]:
        """Take ``delta``; returns its valid calls, each with its index among the reply's valid calls."""
        self.text.append(delta.text)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        fresh = []
        for call in delta.calls:
            if "error" in call:
                self.invalid.append(call)
            else:
                fresh.append((len(self.calls), call))
                self.calls.append(call)
        return fresh

    def finish_reason(self, delta: Delta) -> str:
        return P.finish_reason(delta.finish_reason or "stop", self.calls)

    def choice(self) -> dict[str, Any]:
        assert self.last is not None
        text, reason = "".join(self.text), self.finish_reason(self.last)
        return P.choice(self.index, text, self.calls, reason, self.logprobs)

    def metrics(self) -> dict[str, Any]:
        """A finished reply's ``metrics``: its call's record, as the span reports it."""
        record = self.record
        assert self.last is not None and record is not None, "the reply is not finished"
        stats = self.last.stats
        own = {
            **speculative_metadata(stats),
            "cached_tokens": stats.cached_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "forced_tokens": stats.forced_tokens,
            "time_to_first_token_s": stats.time_to_first_token_s,
            "latency_saved_s": record.latency_saved_s,
            "baseline_s": record.baseline_s,
            "decode_s": record.decode_s,
            "cost_source": record.cost_source,
        }
        if self.invalid:
            own["invalid_tool_calls"] = self.invalid
        return {
            "speculative_decoding": P.speculative_decoding(stats, record.longest_draft),
            "agentspec": own,
        }


class TextReply(Reply):
    """A completion's choice: its text (after the prompt's, with ``echo``), its log-probabilities in
    the legacy shape."""

    def __init__(self, index: int, echo: str = "") -> None:
        super().__init__(index)
        self.echo = echo  # the prompt's text, when the request asked for it back
        self.offset = 0  # streamed: the next token's ``text_offset``, after the chunks sent

    def streamed_logprobs(self, delta: Delta) -> dict | None:
        """``delta``'s log-probabilities in the legacy shape, their offsets after the earlier chunks'."""
        if delta.logprobs is None:
            return None
        out = P.text_logprobs(delta.logprobs, self.offset)
        self.offset += sum(len(token) for token in out["tokens"])
        return out

    def choice(self) -> dict[str, Any]:
        assert self.last is not None
        logprobs = P.text_logprobs(self.logprobs) if self.logprobs is not None else None
        text = self.echo + "".join(self.text)
        return P.text_choice(self.index, text, self.last.finish_reason or "stop", logprobs)


def take(reply: Reply, kind: str, value: Any) -> tuple[Delta, list]:
    """A job's "delta" or "finish" event taken into its reply: (the delta, its fresh valid calls)."""
    delta, record = value if kind == "finish" else (value, None)
    calls = reply.add(delta)
    if record is not None:
        reply.last, reply.record = delta, record
    return delta, calls


Metrics = Callable[[Reply], dict[str, Any]]  # a finished reply's ``metrics``, counted in /metrics


class Form:
    """How a route answers with its jobs' choices: a ``reply`` for each job; once all are finished,
    the ``whole`` response; or, streamed, the ``start`` of each choice, the ``events`` of each of its
    job's events as it comes, and the ``end``. ``metrics`` makes a finished reply's metrics."""

    kind = ""  # the response's object

    def __init__(self, jobs: Sequence[Job], n: int, model: str, metrics: Metrics):
        self.jobs, self.n, self.model, self.metrics = jobs, n, model, metrics
        self.id = jobs[0].response_id

    def usage(self, replies: Sequence[Reply]) -> dict[str, Any]:
        """The request's usage: each prompt once (its n choices are consecutive), every choice's
        tokens, and the prompt tokens the prefix cache held before the request (with n > 1: before
        the prompt's one prefill)."""
        firsts = range(0, len(replies), self.n)
        prompt = sum(replies[i].last.stats.prompt_tokens for i in firsts)
        cached = sum(_cached(self.jobs[i], replies[i]) for i in firsts)
        completion = sum(r.last.stats.output_tokens for r in replies)
        return P.usage(replies[0].last.stats, completion, cached, prompt)

    def whole(self, replies: Sequence[Reply]) -> dict[str, Any]:
        metrics = [self.metrics(r) for r in replies]
        choices = [r.choice() for r in replies]
        # with n > 1 the metrics are the first choice's (each choice is counted in /metrics)
        return P.completion(self.id, self.model, choices, self.usage(replies), metrics[0], self.kind)

    def reply(self, job: Job) -> Reply:
        raise NotImplementedError

    def start(self, reply: Reply) -> list[str]:
        raise NotImplementedError

    def events(self, reply: Reply, kind: str, value: Any) -> list[str]:
        raise NotImplementedError

    def end(self, replies: Sequence[Reply]) -> list[str]:
        raise NotImplementedError


def _cached(job: Job, reply: Reply) -> int:
    return job.shared.restored if job.shared is not None else reply.last.stats.cached_tokens


class ChatForm(Form):
    """The chat route's: a ``chat.completion``, or ``chat.completion.chunk`` events."""

    kind = "chat.completion"

    def __init__(self, jobs: Sequence[Job], body: P.ChatCompletionRequest, model: str, metrics: Metrics):
        super().__init__(jobs, body.n, model, metrics)
        self.chunks = P.Chunks(self.id, model, body.include_usage)

    def reply(self, job: Job) -> Reply:
        return Reply(job.index)

    def start(self, reply: Reply) -> list[str]:
        return [self.chunks.start(reply.index)]

    def events(self, reply: Reply, kind: str, value: Any) -> list[str]:
        """The SSE events of one of a choice's job events; its log-probabilities ride on the first."""
        delta, calls = take(reply, kind, value)
        chunks, out, logprobs, i = self.chunks, [], delta.logprobs, reply.index
        if delta.text:
            out.append(chunks.text(delta.text, i, logprobs))
            logprobs = None
        if calls:
            out.append(chunks.calls([c for _, c in calls], calls[0][0], i, logprobs))
            logprobs = None
        if reply.record is not None:
            out.append(chunks.finish(reply.finish_reason(delta), self.metrics(reply), i, logprobs))
        elif logprobs:  # tokens whose text is held back still: their entries come now
            out.append(chunks.text("", i, logprobs))
        return out

    def end(self, replies: Sequence[Reply]) -> list[str]:
        return self.chunks.end(self.usage(replies))


class TextForm(Form):
    """The completions route's: a ``text_completion``, whole or in chunks, each choice's prompt text
    first with ``echo``."""

    kind = "text_completion"

    def __init__(self, jobs: Sequence[Job], body: P.CompletionRequest, model: str, metrics: Metrics):
        super().__init__(jobs, body.n, model, metrics)
        self.echo = body.echo
        self.chunks = P.TextChunks(self.id, model, body.include_usage)

    def reply(self, job: Job) -> TextReply:
        assert job.call is not None, "the job's call is not prepared yet"
        return TextReply(job.index, job.call.request.prompt.text if self.echo else "")

    def start(self, reply: TextReply) -> list[str]:
        return [self.chunks.text(reply.index, reply.echo)] if reply.echo else []

    def events(self, reply: TextReply, kind: str, value: Any) -> list[str]:
        """One chunk for a job event that adds text or tokens, the last with the finish and metrics."""
        delta, _ = take(reply, kind, value)
        logprobs = reply.streamed_logprobs(delta)
        if reply.record is not None:
            reason, metrics = delta.finish_reason, self.metrics(reply)
            return [self.chunks.text(reply.index, delta.text, logprobs, reason, metrics=metrics)]
        if delta.text or (logprobs is not None and logprobs["tokens"]):
            return [self.chunks.text(reply.index, delta.text, logprobs)]
        return []

    def end(self, replies: Sequence[Reply]) -> list[str]:
        return self.chunks.end(self.usage(replies))
