"""The OpenAI chat-completions wire format: the request the server accepts, the bodies it sends back.

Pure data and functions (no model, no web framework), so every shape is unit-tested on its own.

Request fields follow OpenAI's API, plus vLLM's ``cache_salt``. Fields an OpenAI client may send that
change nothing here (``user``, ``metadata``, ``store``, ...) are accepted and ignored, as vLLM does;
fields whose meaning this server cannot honour (penalties, a logit bias) are refused with a 400
rather than silently dropped. ``logprobs``/``top_logprobs`` are the target's raw log-probabilities
(``agentspec.logprobs``); ``n`` choices share one prefill and decode together; ``priority`` (vLLM's:
lower first) orders prompts competing for a pass's rows (``agentspec.scheduler``). ``temperature``
defaults to 1, as in OpenAI's API (``ChatSpecDecode`` defaults to 0: send ``temperature=0`` for its
greedy replies).

Responses carry ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens restored from the
prefix cache) and ``metrics``: ``speculative_decoding`` with vLLM's per-request field names and
meanings (``--per-request-spec-decode-metrics summary``), and ``agentspec``, this engine's own record
(``agentspec.chat.speculative_metadata``, the latency-saved estimate, invalid tool calls' errors).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentspec.config import MAX_LOGPROBS
from agentspec.stats import DecodeStats

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with no choices and the usage


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``'s body; messages, tools and formats are checked by
    ``agentspec.chat.prepare`` (a ValueError there is a 400 too)."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: a prefix-cache namespace
    n: int = Field(default=1, ge=1)  # choices; at most the server's max-num-seqs (each is a sequence)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    priority: int = 0  # vLLM's: lower is served first where the scheduler has a choice
    # accepted only at the values that change nothing
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprob_count(self) -> int | None:
        """``GenerationConfig.logprobs``: the alternatives per token (None: no logprobs asked for)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> str | None:
        """The first field set to a value this server cannot honour, or None."""
        if self.frequency_penalty:  # 0 and None both mean no penalty
            return "frequency_penalty"
        if self.presence_penalty:
            return "presence_penalty"
        return "logit_bias" if self.logit_bias else None

    @property
    def length_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name), else the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class APIError(Exception):
    """An error with its HTTP status and OpenAI error body (``error_body``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, which the openai client reads into its exceptions."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(stats: DecodeStats, completion_tokens: int | None = None, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage of a request: its prompt once, the tokens of every choice (``completion_tokens``;
    None: ``stats``' own), the prompt tokens read from the prefix cache (None: ``stats``' own)."""
    completion = stats.output_tokens if completion_tokens is None else completion_tokens
    cached = stats.cached_tokens if cached_tokens is None else cached_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def speculative_decoding(stats: DecodeStats, num_spec_tokens: int) -> dict[str, Any]:
    """vLLM's ``metrics.speculative_decoding`` of one request, from agentspec's stats.

    vLLM's meanings: a spec step is a verify pass over at least one draft token (agentspec also
    counts passes that verified none, under source "none": left out here); ``num_spec_tokens`` is
    the draft length (vLLM's fixed ``num_speculative_tokens``; agentspec's drafters pick each
    draft's length, so the longest draft of the request stands for it, at least its histogram's
    reach); ``mean_acceptance_length`` = 1 + accepted / spec steps, the bonus token included;
    ``draft_acceptance_rate`` = accepted / drafted; ``acceptance_histogram[i]`` = spec steps that
    accepted exactly ``i`` draft tokens, ``num_spec_tokens + 1`` entries.
    """
    empty = stats.source_steps.get("none", 0)  # passes that verified no draft token
    steps = stats.verify_steps - empty
    k = max(num_spec_tokens, len(stats.acceptance_histogram) - 1, 0)
    histogram = [*stats.acceptance_histogram, *[0] * (k + 1 - len(stats.acceptance_histogram))]
    if histogram:
        histogram[0] -= empty
    accepted, drafted = stats.accepted_tokens, stats.draft_tokens
    return {
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "num_spec_steps": steps,
        "num_spec_tokens": k,
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
    }


def finish_reason(reason: str, calls: list[dict]) -> str:
    """OpenAI's finish reason: "tool_calls" when the reply made a (valid) call."""
    return "tool_calls" if reason == "stop" and calls else reason


def message(text: str, calls: list[dict]) -> dict[str, Any]:
    """The assistant message: content None when the reply is only calls, as OpenAI sends it."""
    out: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        out["tool_calls"] = calls
    return out


def logprobs_of(content: list[dict] | None) -> dict | None:
    """A choice's ``logprobs``: OpenAI's object around the entries (None: none were asked for)."""
    return None if content is None else {"content": content, "refusal": None}


def choice(index: int, text: str, calls: list[dict], reason: str, logprobs: list[dict] | None) -> dict:
    """One choice of a whole ``chat.completion``."""
    return {
        "index": index,
        "message": message(text, calls),
        "logprobs": logprobs_of(logprobs),
        "finish_reason": reason,
    }


def completion(completion_id: str, model: str, choices: list[dict], usage: dict, metrics: dict) -> dict:
    """The whole ``chat.completion`` object of a reply that was not streamed."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "metrics": metrics,
    }


class Chunks:
    """The ``chat.completion.chunk`` events of one streamed reply, as SSE ``data:`` lines."""

    def __init__(self, completion_id: str, model: str, include_usage: bool):
        self.id, self.model, self.include_usage = completion_id, model, include_usage
        self.created = int(time.time())

    def event(
        self, delta: dict | None, reason: str | None = None, index: int = 0, logprobs=None, **extra: Any
    ) -> str:
        """A chunk with choice ``index``'s ``delta`` (None: no choice, the usage chunk)."""
        choices = []
        if delta is not None:
            lp = logprobs_of(logprobs)
            choices = [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self, index: int = 0) -> str:
        return self.event({"role": "assistant", "content": ""}, index=index)

    def text(self, text: str, index: int = 0, logprobs: list[dict] | None = None) -> str:
        return self.event({"content": text}, index=index, logprobs=logprobs)

    def calls(self, calls: list[dict], first_index: int, index: int = 0, logprobs=None) -> str:
        """Whole calls, each as one indexed ``tool_calls`` entry (name and all its arguments at once)."""
        entries = [{"index": first_index + i, **call} for i, call in enumerate(calls)]
        return self.event({"tool_calls": entries}, index=index, logprobs=logprobs)

    def finish(self, reason: str, metrics: dict, index: int = 0, logprobs=None) -> str:
        """Choice ``index``'s chunk with its finish reason (and the metrics)."""
        return self.event({}, reason, index=index, logprobs=logprobs, metrics=metrics)

    def end(self, usage: dict) -> list[str]:
        """The usage chunk when asked for, then [DONE]."""
        out = [self.event(None, usage=usage)] if self.include_usage else []
        return [*out, "data: [DONE]\n\n"]

    @staticmethod
    def error(exc: APIError) -> str:
        """An error after the stream began (its status line is already sent): the body as an event."""
        return f"data: {json.dumps(exc.body(), ensure_ascii=False)}\n\n"
