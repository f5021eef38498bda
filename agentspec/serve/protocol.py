"""OpenAI's chat-completions and (legacy) completions wire formats: the requests the server accepts,
the bodies it sends back.

Pure data and functions (no model, no web framework), so every shape is unit-tested on its own.

Request fields follow OpenAI's API, plus vLLM's ``cache_salt``. Fields an OpenAI client may send that
change nothing here (``user``, ``metadata``, ``store``, ...) are accepted and ignored, as vLLM does;
fields whose meaning this server cannot honour (penalties, a logit bias) are refused with a 400
rather than silently dropped. ``logprobs``/``top_logprobs`` are the target's raw log-probabilities
(``agentspec.logprobs``); ``n`` choices share one prefill and decode together; ``priority`` (vLLM's:
lower first) orders prompts competing for a pass's rows (``agentspec.scheduler``). ``temperature``
defaults to 1, as in OpenAI's API (``ChatSpecDecode`` defaults to 0: send ``temperature=0`` for its
greedy replies).

A completion (``CompletionRequest``) takes vLLM's fields for the same options, its ``logprobs`` an
integer (the alternatives per token) answered in the legacy shape (``text_logprobs``); ``echo`` is
served without ``logprobs`` only (the prompt's own log-probabilities are not computed), and
``suffix`` and a ``best_of`` other than ``n`` are refused.

Responses carry ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens restored from the
prefix cache) and ``metrics``: ``speculative_decoding`` with vLLM's per-request field names and
meanings (``--per-request-spec-decode-metrics summary``), and ``agentspec``, this engine's own record
(``agentspec.chat.speculative_metadata``, the latency-saved estimate, invalid tool calls' errors).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from agentspec.config import MAX_LOGPROBS
from agentspec.stats import DecodeStats

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with no choices and the usage


def _off(value: Any) -> bool:
    return not value  # None, False, 0, an empty list or mapping


def _none(value: Any) -> bool:
    return value is None


def _one(value: Any) -> bool:
    return value is None or value == 1


def _on(value: Any) -> bool:
    return value is None or value is True


# Fields of OpenAI's and vLLM's requests that would change a reply, with the test of the value at
# which they change nothing (what clients send by default): any other value is refused (400, code
# "unsupported", the field as ``param``) rather than silently ignored. docs/serving.md gives why.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    # sampling this server's verification does not reproduce (penalties, biases, bans, beams)
    "frequency_penalty": _off,
    "presence_penalty": _off,
    "repetition_penalty": _one,
    "length_penalty": _one,
    "logit_bias": _off,
    "min_p": _off,
    "min_tokens": _off,
    "ignore_eos": _off,
    "stop_token_ids": _off,
    "bad_words": _off,
    "allowed_token_ids": _off,
    "use_beam_search": _off,
    "include_stop_str_in_output": _off,
    "skip_special_tokens": _on,
    # what it does not compute or return
    "prompt_logprobs": _none,
    "logprob_token_ids": _none,
    "return_tokens_as_token_ids": _off,
    "truncate_prompt_tokens": _none,
    # vLLM's own structured-output fields: response_format and tools say the same in OpenAI's terms
    "structured_outputs": _none,
    "guided_json": _none,
    "guided_regex": _none,
    "guided_choice": _none,
    "guided_grammar": _none,
    # rendering: the server renders every conversation with the model's template and its generation prompt
    "chat_template": _none,
    "chat_template_kwargs": _none,
    "documents": _none,
    "add_generation_prompt": _on,
    "continue_final_message": _off,
}


class GenerationRequest(BaseModel):
    """What a chat completion and a completion both carry: the model, how to sample, the choices,
    streaming, the tenant's salt and the priority."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: a prefix-cache namespace
    n: int = Field(default=1, ge=1)  # choices; at most the server's max-num-seqs (each is a sequence)
    priority: int = 0  # vLLM's: lower is served first where the scheduler has a choice
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's (0 and -1: all tokens, as there)

    def unsupported(self) -> str | None:
        """The first field (``NEUTRAL``'s) set to a value this server cannot honour, or None; fields
        no client sends with a meaning (``user``, ``metadata``, ``store``, ...) are ignored, as vLLM does."""
        extra = self.model_extra or {}
        return next(
            (name for name, neutral in NEUTRAL.items() if name in extra and not neutral(extra[name])), None
        )

    @property
    def top_k_or_none(self) -> int | None:
        """``GenerationConfig.top_k``: None for vLLM's "all tokens" (None, 0 or -1)."""
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        """A streamed reply ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    # each request reads these from its own fields
    @property
    def length_limit(self) -> int | None:
        """The most tokens a choice may have (None: the room the prompt leaves in the context)."""
        raise NotImplementedError

    @property
    def logprob_count(self) -> int | None:
        """``GenerationConfig.logprobs``: the alternatives per token (None: no logprobs asked for)."""
        raise NotImplementedError


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``'s body; messages, tools and formats are checked by
    ``agentspec.chat.prepare`` (a ValueError there is a 400 too)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def length_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name), else the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


DEFAULT_MAX_TOKENS = 16  # a completion's length when the request names none (OpenAI's and vLLM's)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``'s body (OpenAI's legacy completions, as vLLM serves them): a prompt
    decoded as it is, no chat template, no grammar. ``prompt`` is a string, a list of token ids, or a
    batch of either (each prompt's n choices are choices ``prompt_index * n + j``)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (vLLM's bound)
    echo: bool = False  # the prompt's text before each choice's
    # accepted only at the values that change nothing
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_forms(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:  # one message for the union, not one per form it is not
            raise ValueError(
                "prompt must be a string, a list of token ids, or a list of strings or of token-id lists"
            ) from None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        one = isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    @property
    def length_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        """The first field set to a value this server cannot honour, or None: besides the penalties
        and bias, a suffix (no fill-in-the-middle), ``best_of`` other than ``n`` (choices are not
        ranked), and ``echo`` with ``logprobs`` (the prompt's own log-probabilities are not computed)."""
        bad = super().unsupported()
        if bad is not None:
            return bad
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return "echo" if self.echo and self.logprobs is not None else None


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


def usage(
    stats: DecodeStats,
    completion_tokens: int | None = None,
    cached_tokens: int | None = None,
    prompt_tokens: int | None = None,
) -> dict:
    """OpenAI's usage of a request: its prompt once (``prompt_tokens``, a batch's prompts each once;
    None: ``stats``' own), the tokens of every choice (``completion_tokens``; None: ``stats``' own),
    the prompt tokens read from the prefix cache (None: ``stats``' own)."""
    prompt = stats.prompt_tokens if prompt_tokens is None else prompt_tokens
    completion = stats.output_tokens if completion_tokens is None else completion_tokens
    cached = stats.cached_tokens if cached_tokens is None else cached_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
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
    accepted exactly ``i`` draft tokens, ``num_spec_tokens + 1`` entries. (vLLM counts the tokens
    accepted at each draft position only in its ``/metrics``, as ``ServerMetrics`` does.)
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


def completion(
    completion_id: str,
    model: str,
    choices: list[dict],
    usage: dict,
    metrics: dict,
    kind: str = "chat.completion",
) -> dict:
    """The whole ``chat.completion`` object of a reply that was not streamed (``kind``
    "text_completion": a completion's)."""
    return {
        "id": completion_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "metrics": metrics,
    }


def text_logprobs(content: list[dict], offset: int = 0) -> dict[str, list]:
    """A completion's ``logprobs`` (the legacy shape, as vLLM answers it) of OpenAI's chat entries
    (``agentspec.chat.logprobs``): each token's text and log-probability; ``top_logprobs`` one dict
    per token, its text first and then its alternatives' (up to k + 1 keys, as vLLM's); ``text_offset``
    each token's offset in the completion's text, from ``offset``, counted in token texts (vLLM's)."""
    starts = list(itertools.accumulate((len(e["token"]) for e in content), initial=offset))
    top = [
        {e["token"]: e["logprob"], **{t["token"]: t["logprob"] for t in e["top_logprobs"]}} for e in content
    ]
    return {
        "tokens": [e["token"] for e in content],
        "token_logprobs": [e["logprob"] for e in content],
        "top_logprobs": top,
        "text_offset": starts[:-1],
    }


def text_choice(index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    """One choice of a ``text_completion``, whole or a chunk's."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


class Events:
    """The chunks of one streamed reply, objects of kind ``object``, as SSE ``data:`` lines."""

    object = ""

    def __init__(self, completion_id: str, model: str, include_usage: bool):
        self.id, self.model, self.include_usage = completion_id, model, include_usage
        self.created = int(time.time())

    def chunk(self, choices: list[dict], **extra: Any) -> str:
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def end(self, usage: dict) -> list[str]:
        """The usage chunk (no choices) when asked for, then [DONE]."""
        out = [self.chunk([], usage=usage)] if self.include_usage else []
        return [*out, "data: [DONE]\n\n"]

    @staticmethod
    def error(exc: APIError) -> str:
        """An error after the stream began (its status line is already sent): the body as an event."""
        return f"data: {json.dumps(exc.body(), ensure_ascii=False)}\n\n"


class Chunks(Events):
    """The ``chat.completion.chunk`` events of one streamed reply."""

    object = "chat.completion.chunk"

    def event(
        self, delta: dict | None, reason: str | None = None, index: int = 0, logprobs=None, **extra: Any
    ) -> str:
        """A chunk with choice ``index``'s ``delta`` (None: no choice, the usage chunk)."""
        choices = []
        if delta is not None:
            lp = logprobs_of(logprobs)
            choices = [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]
        return self.chunk(choices, **extra)

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


class TextChunks(Events):
    """The ``text_completion`` chunks of one streamed completion."""

    object = "text_completion"

    def text(
        self, index: int, text: str, logprobs: dict | None = None, reason: str | None = None, **extra
    ) -> str:
        """Choice ``index``'s next ``text`` (with its tokens' ``text_logprobs``; the last with its
        finish reason and the metrics)."""
        return self.chunk([text_choice(index, text, reason, logprobs)], **extra)
