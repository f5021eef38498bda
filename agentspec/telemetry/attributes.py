"""Every span attribute and metric name agentspec writes, and pure functions from a call to attributes.

``gen_ai.*`` follow the OpenTelemetry GenAI semantic conventions (status: development), as
published in ``opentelemetry-semantic-conventions`` (a test checks each name against its
constants). The strings are written out here because those constants are marked deprecated (the
conventions moved to their own repository, ``semantic-conventions-genai``). ``agentspec.*`` is our
namespace for what the conventions do not cover: speculation, the prefix cache and the
latency-saved estimate. Durations in our namespace are seconds, named ``..._s``.

Two switches, read from the environment at every call (the caller's ``Telemetry`` may override the
first):

- ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``: ``true`` (or ``SPAN_ONLY`` /
  ``SPAN_AND_EVENT``, the values OpenTelemetry's GenAI utilities take) records the request's
  messages, system instructions and tool definitions and the reply on the span, in the
  conventions' JSON shapes (``role`` / ``parts``). Off by default: they may hold personal data.
- ``OTEL_SEMCONV_STABILITY_OPT_IN`` containing ``gen_ai_latest_experimental``: the names of the
  conventions' unreleased draft replace the published ones it renames, as OpenTelemetry's
  instrumentations do under that flag (it has no "both" mode for GenAI):
  ``gen_ai.client.inference.duration`` for ``gen_ai.client.operation.duration``; the
  ``gen_ai.client.inference.operation.{input,output}_tokens`` histograms and the
  ``gen_ai.client.inference.usage.*`` counters (``gen_ai.token.modality`` "text") for
  ``gen_ai.client.token.usage``; ``gen_ai.usage.cache_write.input_tokens`` for
  ``gen_ai.usage.cache_creation.input_tokens``; plus ``gen_ai.client.inference.time_to_first_chunk``
  on streamed calls. The ``gen_ai.server.*`` timings and ``agentspec.*`` are the same in both.

The functions below read ``DecodeStats``, the request options and the request's OpenAI-format
messages and tools, and return plain dicts; the exporter glue in ``agentspec.telemetry.otel`` only
hands them to a span or an instrument.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from agentspec.chat.prompt import content_text
from agentspec.config import GenerationConfig
from agentspec.decode import CallRecord
from agentspec.stats import DecodeStats

# -- span: OpenTelemetry GenAI conventions ---------------------------------------------------------
OPERATION_NAME = "gen_ai.operation.name"  # "chat"
PROVIDER_NAME = "gen_ai.provider.name"  # "agentspec": the model runs in this process
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"  # the effective cap (clipped to the context window)
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
REQUEST_STREAM = "gen_ai.request.stream"  # True: the caller received chunks; absent otherwise
CONVERSATION_ID = "gen_ai.conversation.id"  # the caller's thread / session id, when it has one
# a served request's X-Request-Id (OpenTelemetry's HTTP semantic conventions: http.request.header.<key>)
REQUEST_ID_HEADER = "http.request.header.x-request-id"
OUTPUT_TYPE = "gen_ai.output.type"  # "json" under a response_format, "text" otherwise
RESPONSE_ID = "gen_ai.response.id"  # one per call; the LangChain reply's response_metadata["id"]
# streamed calls: from the call's start to the first pass that released text or finished
RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_PREFIX = "gen_ai.usage."  # every usage attribute's: what a span leaves to a tracer that reports usage
USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # restored from the prefix cache
# prompt tokens this call newly wrote into the prefix cache (part of input_tokens)
USAGE_CACHE_CREATION_INPUT_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
# opt-in content (JSON strings in the conventions' shapes; see the module docstring)
INPUT_MESSAGES = "gen_ai.input.messages"  # the chat history after the leading system messages
OUTPUT_MESSAGES = "gen_ai.output.messages"  # the reply: its text and its tool calls, as parsed
SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"  # the leading system (or developer) messages
TOOL_DEFINITIONS = "gen_ai.tool.definitions"  # the tools bound to the request
TOKEN_TYPE = "gen_ai.token.type"  # metric attribute: "input" or "output"
ERROR_TYPE = "error.type"  # the exception's class name

OPERATION = "chat"
PROVIDER = "agentspec"

# -- the draft conventions (semantic-conventions-genai), under OTEL_SEMCONV_STABILITY_OPT_IN -------------
LATEST_EXPERIMENTAL = "gen_ai_latest_experimental"
USAGE_CACHE_WRITE_INPUT_TOKENS = "gen_ai.usage.cache_write.input_tokens"  # renames cache_creation
TOKEN_MODALITY = "gen_ai.token.modality"  # metric attribute of the usage counters: "text"
METRIC_INFERENCE_DURATION = "gen_ai.client.inference.duration"  # histogram, s
METRIC_INFERENCE_TIME_TO_FIRST_CHUNK = "gen_ai.client.inference.time_to_first_chunk"  # histogram, s
METRIC_INFERENCE_INPUT_TOKENS = "gen_ai.client.inference.operation.input_tokens"  # histogram, {token}
METRIC_INFERENCE_OUTPUT_TOKENS = "gen_ai.client.inference.operation.output_tokens"  # histogram, {token}
METRIC_USAGE_INPUT_TOKENS = "gen_ai.client.inference.usage.input_tokens"  # counter, {token}
METRIC_USAGE_OUTPUT_TOKENS = "gen_ai.client.inference.usage.output_tokens"  # counter, {token}
METRIC_USAGE_CACHE_READ_TOKENS = "gen_ai.client.inference.usage.cache_read.input_tokens"  # counter
METRIC_USAGE_CACHE_WRITE_TOKENS = "gen_ai.client.inference.usage.cache_write.input_tokens"  # counter

# -- environment variables -----------------------------------------------------------------------------
ENV_CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
ENV_STABILITY_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"
CAPTURE_ON = ("true", "span_only", "span_and_event")  # values that record content on spans

# -- span: agentspec ---------------------------------------------------------------------------------
REQUEST_SPECULATIVE = "agentspec.request.speculative"  # False: the plain baseline loop
REQUEST_NUM_DRAFT_TOKENS = "agentspec.request.num_draft_tokens"  # most draft tokens per verify pass
REQUEST_PREFIX_CACHE = "agentspec.request.prefix_cache"  # whether cached prefixes may be restored
DRAFTER = "agentspec.drafter"  # the drafter used ("prompt_lookup", "model", ...); "none" for plain
DRAFT_TOKENS = "agentspec.draft_tokens"  # proposed by the drafter and verified by the target
ACCEPTED_TOKENS = "agentspec.accepted_tokens"  # of those, accepted
FORCED_TOKENS = "agentspec.forced_tokens"  # written by a grammar without a choice left to the model
JUMP_FORWARD_TOKENS = "agentspec.jump_forward_tokens"  # of the draft tokens, text a grammar forced
JUMP_FORWARD_ACCEPTED = "agentspec.jump_forward_accepted"  # of those, accepted
VERIFY_STEPS = "agentspec.verify_steps"  # target forward passes (each yields >= 1 token)
DRAFT_FAILURES = "agentspec.draft_failures"  # drafter exceptions survived by decoding without it
DRAFT_COOLDOWN = "agentspec.draft_cooldown"  # a drafter this call skipped: it kept failing (set only then)
ACCEPTANCE_RATE = "agentspec.acceptance_rate"  # accepted / drafted
MEAN_ACCEPTANCE_LENGTH = "agentspec.mean_acceptance_length"  # tokens per verify pass, bonus included
ACCEPTANCE_HISTOGRAM = "agentspec.acceptance_histogram"  # [i]: verify passes that accepted i drafts
ACCEPTED_PER_POSITION = "agentspec.accepted_per_position"  # [i]: passes whose draft token i was accepted
DRAFTED_PER_POSITION = "agentspec.drafted_per_position"  # [i]: passes that drafted a token at position i
PREFIX_TOKENS_RESTORED = "agentspec.prefix_cache.restored_tokens"  # = cache_read.input_tokens
PREFILL_TOKENS = "agentspec.prefill_tokens"  # prompt tokens the target computed in this call
# of the restored tokens, those copied from a call running beside it (``scheduler._share_prompts``)
PREFIX_TOKENS_SHARED = "agentspec.prefix_cache.shared_tokens"
TIME_TO_FIRST_TOKEN = "agentspec.time_to_first_token_s"  # from the call's start (cache restore included)
DECODE_TIME = "agentspec.decode_s"  # time spent inside the decoder (not in the caller's hands)
BASELINE_ESTIMATE = "agentspec.baseline_estimate_s"  # the same call, plain decoding, no cache (estimated)
LATENCY_SAVED = "agentspec.latency_saved_s"  # baseline_estimate_s - decode_s; negative: a loss
# what the estimate's pass costs rest on: "prior" (a device type's curve, a term not yet seen in a
# pass), "observed" (the prior rescaled by passes of both kinds), "calibrated" (fitted or given)
COST_SOURCE = "agentspec.latency.cost_source"
DRAFT_SOURCE = "agentspec.draft.source"  # metric attribute: where draft tokens came from ("suffix", ...)
# per draft source ("auto" picks "suffix" or "model" each pass): passes, draft tokens, accepted
SOURCE_STEPS = "agentspec.source.{}.verify_steps"
SOURCE_DRAFT_TOKENS = "agentspec.source.{}.draft_tokens"
SOURCE_ACCEPTED_TOKENS = "agentspec.source.{}.accepted_tokens"
CLOSED_EARLY = "agentspec.closed_early"  # the caller stopped reading before the reply finished

# -- span: an agent run's totals over its model calls (``langchain_agentspec.totals``), on the span a
# LangChain tracer opened for the run's root; their own names, so that a sum over the calls' spans
# never counts them again
RUN_CALLS = "agentspec.run.calls"  # replies that reported speculation or latency figures
RUN_DRAFT_TOKENS = "agentspec.run.draft_tokens"
RUN_ACCEPTED_TOKENS = "agentspec.run.accepted_tokens"
RUN_CACHE_READ_TOKENS = "agentspec.run.cache_read_tokens"  # prompt tokens read from a prefix cache
RUN_LATENCY_SAVED = "agentspec.run.latency_saved_s"  # over the calls with an estimate
RUN_BASELINE_ESTIMATE = "agentspec.run.baseline_estimate_s"
RUN_DECODE_TIME = "agentspec.run.decode_s"

# -- metrics -------------------------------------------------------------------------------------------
METRIC_OPERATION_DURATION = "gen_ai.client.operation.duration"  # histogram, s
METRIC_TOKEN_USAGE = "gen_ai.client.token.usage"  # histogram, {token}, by gen_ai.token.type
METRIC_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"  # histogram, s
METRIC_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"  # histogram, s (after the first)
METRIC_DRAFT_TOKENS = "agentspec.draft.tokens"  # counter, {token}
METRIC_ACCEPTED_TOKENS = "agentspec.accepted.tokens"  # counter, {token}
METRIC_FORCED_TOKENS = "agentspec.forced.tokens"  # counter, {token}
METRIC_CACHE_READ_TOKENS = "agentspec.prefix_cache.read.tokens"  # counter, {token}
METRIC_LATENCY_SAVED = "agentspec.latency.saved"  # up-down counter, s (a call can lose time)
METRIC_BASELINE_DURATION = "agentspec.baseline.duration"  # histogram, s: estimated plain-decoding time

# bucket boundaries the GenAI conventions advise
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216)
PER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def model_label(model: str) -> str:
    """The model's name in telemetry (span name, ``gen_ai.request.model``, metric points): a hub id
    (``org/name``) or a bare name as given; a local path never, for it is unbounded in number and
    tells of the machine (its user's home, its folders): its last component instead, less a
    ``.gguf`` suffix, or the hub id of a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<commit>``). Read from the string alone (no file system)."""
    text = model.strip()
    if not _is_path(text):
        return text
    parts = [p for p in re.split(r"[/\\]+", text) if p not in ("", ".", "..", "~")]
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    if not parts:
        return text
    last = parts[-1]
    return last[: -len(".gguf")] if last.lower().endswith(".gguf") and len(last) > 5 else last


def _is_path(text: str) -> bool:
    """Whether a model string is a local path rather than a hub id: rooted (``/``, ``~``, ``.``, a
    drive letter), with a backslash, more than one ``/``, or a ``.gguf`` file."""
    return (
        text.startswith(("/", "~", "."))
        or "\\" in text
        or re.match(r"^[A-Za-z]:", text) is not None
        or text.count("/") > 1
        or text.lower().endswith(".gguf")
    )


def span_name(model: str) -> str:
    """A call's span name, ``chat {model}``, its model named by ``model_label``."""
    return f"{OPERATION} {model_label(model)}"


def base_attributes(model: str) -> dict[str, Any]:
    """What every span and metric point of a call carries."""
    return {OPERATION_NAME: OPERATION, PROVIDER_NAME: PROVIDER, REQUEST_MODEL: model}


def capture_content(value: str | None) -> bool:
    """Whether ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``'s value records content on spans."""
    return value is not None and value.strip().lower() in CAPTURE_ON


def latest_experimental(value: str | None) -> bool:
    """Whether ``OTEL_SEMCONV_STABILITY_OPT_IN``'s value (a comma-separated list) opts into the draft."""
    return value is not None and LATEST_EXPERIMENTAL in (s.strip() for s in value.split(","))


def request_attributes(
    model: str,
    config: GenerationConfig | None,
    prefix_cache: Any,
    streamed: bool,
    conversation_id: str | None = None,
    output_type: str | None = None,
) -> dict[str, Any]:
    """A request's attributes: its ``GenerationConfig`` and ``prefix_cache`` setting (as
    ``agentspec.stream`` takes them); ``config`` None for a call refused before it had one.
    ``gen_ai.request.stream`` is set only on a streamed call, as the conventions ask."""
    attrs = base_attributes(model)
    if streamed:
        attrs[REQUEST_STREAM] = True
    if conversation_id is not None:
        attrs[CONVERSATION_ID] = conversation_id
    if output_type is not None:
        attrs[OUTPUT_TYPE] = output_type
    if config is None:
        return attrs
    given = (
        (REQUEST_MAX_TOKENS, config.max_new_tokens),
        (REQUEST_TEMPERATURE, config.temperature),
        (REQUEST_TOP_P, config.top_p),
        (REQUEST_TOP_K, config.top_k),
        (REQUEST_SEED, config.seed),
        (REQUEST_SPECULATIVE, config.speculative),
        (REQUEST_NUM_DRAFT_TOKENS, config.num_draft_tokens),
    )
    attrs.update((name, value) for name, value in given if value is not None)
    if config.stop:
        attrs[REQUEST_STOP_SEQUENCES] = list(config.stop)
    attrs[REQUEST_PREFIX_CACHE] = prefix_cache not in (False, None)
    return attrs


def response_attributes(
    model: str,
    stats: DecodeStats,
    response_id: str | None = None,
    latest: bool = False,
    usage: bool = True,
) -> dict[str, Any]:
    """Id, finish reason and usage (``gen_ai.*``) of a call that produced stats (``latest``: the
    draft's name for the prefix-cache writes; ``usage`` False: no ``gen_ai.usage.*``, which another
    span of the call reports)."""
    attrs: dict[str, Any] = {RESPONSE_MODEL: model}
    if usage:
        written = USAGE_CACHE_WRITE_INPUT_TOKENS if latest else USAGE_CACHE_CREATION_INPUT_TOKENS
        attrs[USAGE_INPUT_TOKENS] = stats.prompt_tokens
        attrs[USAGE_OUTPUT_TOKENS] = stats.output_tokens
        attrs[USAGE_CACHE_READ_INPUT_TOKENS] = stats.cached_tokens
        attrs[written] = stats.cache_creation_tokens
    if response_id is not None:
        attrs[RESPONSE_ID] = response_id
    if stats.finish_reason is not None:
        attrs[RESPONSE_FINISH_REASONS] = [stats.finish_reason]
    return attrs


# -- opt-in content, in the conventions' JSON shapes -----------------------------------------------------


def _arguments(arguments: Any) -> Any:
    """A call's arguments as an object when they are JSON (OpenAI sends a string), else as given."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # an invalid call's raw text


def _call_part(call: dict) -> dict[str, Any]:
    function = call.get("function") or {}
    args = _arguments(function.get("arguments"))
    return {"type": "tool_call", "id": call.get("id"), "name": function.get("name"), "arguments": args}


def message_parts(message: dict, index: int) -> list[dict[str, Any]]:
    """An OpenAI-format message's ``parts``: text, its tool calls, or a tool's response."""
    text = content_text(message, index)
    if message["role"] == "tool":
        return [{"type": "tool_call_response", "id": message.get("tool_call_id"), "response": text}]
    parts: list[dict[str, Any]] = [{"type": "text", "content": text}] if text else []
    return parts + [_call_part(call) for call in message.get("tool_calls") or ()]


def input_content_attributes(messages: Sequence[dict], tools: Sequence[dict]) -> dict[str, Any]:
    """``gen_ai.system_instructions`` (the leading system or developer messages), ``gen_ai.input.messages``
    (the rest, in order) and ``gen_ai.tool.definitions``, each a JSON string."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    attrs: dict[str, Any] = {}
    if lead:
        instructions = [part for i in range(lead) for part in message_parts(messages[i], i)]
        attrs[SYSTEM_INSTRUCTIONS] = _json(instructions)
    history = [{"role": m["role"], "parts": message_parts(m, i)} for i, m in enumerate(messages) if i >= lead]
    attrs[INPUT_MESSAGES] = _json(history)
    if tools:
        attrs[TOOL_DEFINITIONS] = _json([tool_definition(t) for t in tools])
    return attrs


def tool_definition(tool: dict) -> dict[str, Any]:
    """An OpenAI-format tool as the conventions define one: its function's fields, flattened."""
    function = tool["function"]
    return {
        "type": "function",
        **{k: function[k] for k in ("name", "description", "parameters") if k in function},
    }


def output_content_attributes(
    text: str, tool_calls: Sequence[dict], finish_reason: str | None
) -> dict[str, Any]:
    """``gen_ai.output.messages``: the one reply, its text and its (OpenAI-format) tool calls as parsed."""
    parts: list[dict[str, Any]] = [{"type": "text", "content": text}] if text else []
    parts += [_call_part(call) for call in tool_calls]
    # no finish reason: the caller stopped reading, or decoding failed; the conventions say "error"
    message = {"role": "assistant", "parts": parts, "finish_reason": finish_reason or "error"}
    return {OUTPUT_MESSAGES: _json([message])}


def _json(value: Any) -> str:
    # span attributes hold no nested maps: the conventions allow a JSON string on spans
    return json.dumps(value, ensure_ascii=False)


def speculation_attributes(stats: DecodeStats) -> dict[str, Any]:
    """The ``agentspec.*`` record of what drafting, the grammar and the prefix cache did."""
    return {
        DRAFTER: stats.drafter or "none",
        DRAFT_TOKENS: stats.draft_tokens,
        ACCEPTED_TOKENS: stats.accepted_tokens,
        FORCED_TOKENS: stats.forced_tokens,
        JUMP_FORWARD_TOKENS: stats.jump_forward_tokens,
        JUMP_FORWARD_ACCEPTED: stats.jump_forward_accepted,
        VERIFY_STEPS: stats.verify_steps,
        DRAFT_FAILURES: stats.draft_failures,
        ACCEPTANCE_RATE: stats.acceptance_rate,
        MEAN_ACCEPTANCE_LENGTH: stats.mean_acceptance_length,
        ACCEPTANCE_HISTOGRAM: list(stats.acceptance_histogram),
        ACCEPTED_PER_POSITION: list(stats.accepted_per_position),
        DRAFTED_PER_POSITION: list(stats.drafted_per_position),
        PREFIX_TOKENS_RESTORED: stats.cached_tokens,
        PREFILL_TOKENS: stats.prefill_tokens,
        PREFIX_TOKENS_SHARED: stats.shared_prefix_tokens,
        **source_attributes(stats),
        **({DRAFT_COOLDOWN: stats.draft_cooldown} if stats.draft_cooldown else {}),
    }


def source_attributes(stats: DecodeStats) -> dict[str, Any]:
    """``agentspec.source.<source>.*``: verify passes, draft tokens and accepted tokens per draft source."""
    attrs: dict[str, Any] = {}
    for template, counts in (
        (SOURCE_STEPS, stats.source_steps),
        (SOURCE_DRAFT_TOKENS, stats.source_draft_tokens),
        (SOURCE_ACCEPTED_TOKENS, stats.source_accepted_tokens),
    ):
        attrs.update({template.format(source): n for source, n in counts.items()})
    return attrs


def timing_attributes(record: CallRecord, streamed: bool) -> dict[str, Any]:
    """The call's measured times, and its latency-saved estimate when there is one, with its source,
    as its record holds them; the time to the first chunk only for a streamed call."""
    attrs: dict[str, Any] = {DECODE_TIME: record.decode_s}
    if streamed and record.first_chunk_s is not None:
        attrs[RESPONSE_TIME_TO_FIRST_CHUNK] = record.first_chunk_s
    if record.ttft_s is not None:
        attrs[TIME_TO_FIRST_TOKEN] = record.ttft_s
    if record.baseline_s is not None:
        attrs[BASELINE_ESTIMATE] = record.baseline_s
        attrs[LATENCY_SAVED] = record.latency_saved_s
    if record.cost_source is not None:
        attrs[COST_SOURCE] = record.cost_source
    return attrs


def error_type(exc: BaseException) -> str:
    """``error.type`` for an exception: its class name (``ValueError``, ``TokenizerMismatchError``)."""
    return type(exc).__qualname__


def metric_attributes(model: str, error: str | None = None) -> dict[str, Any]:
    """Attributes of a call's metric points: low cardinality (no ids, no counts)."""
    attrs = base_attributes(model)
    attrs[RESPONSE_MODEL] = model
    if error is not None:
        attrs[ERROR_TYPE] = error
    return attrs
