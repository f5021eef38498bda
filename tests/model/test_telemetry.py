"""OpenTelemetry spans and metrics of model calls (agentspec.telemetry), read back from memory.

Spans go to an ``InMemorySpanExporter`` through a ``SimpleSpanProcessor``, metrics to an
``InMemoryMetricReader``; both providers are injected (``tracer_provider=``/``meter_provider=``),
since the global ones can be set only once per process. The chat calls run a tiny random Llama
behind the embedded model's real tokenizer (its chat template, its tool-call format), so the whole
LangChain path runs in milliseconds; its replies are noise, which is all these tests need. The
latency estimate's arithmetic is checked on hand-written numbers; that tracing runs no model pass of
its own is checked by counting the target's forwards.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from scripted_calls import WholeCall, now

from agentspec import grammar as G
from agentspec.cache import PrefixCache
from agentspec.cost import CostModel, baseline_seconds, calibrate, cost_model, set_cost_model
from agentspec.decode import ContextLengthExceeded, Step, stream
from agentspec.models import ModelPair, ensure_default_model
from agentspec.stats import DecodeStats
from agentspec.telemetry import CallInfo, Telemetry, traced_stream
from agentspec.telemetry import attributes as A
from langchain_agentspec import ChatSpecDecode

pytestmark = pytest.mark.usefixtures("one_thread")

# a cost model with round numbers: prefill_s(n) = 0.1 + 0.01 n, decode_s(c) = 0.05 + 0.001 c
ROUND = dict(p0=0.1, p1=0.01, p2=0.0, d0=0.05, d1=0.001)


@pytest.fixture(scope="module")
def chat_pair(tiny_llama):
    """A tiny random Llama behind SmolLM2's tokenizer, with a fixed (round-number) cost model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    model = tiny_llama(5, vocab_size=len(tokenizer), max_positions=1024)
    cache = PrefixCache(64 << 20)
    pair = ModelPair(target=model, tokenizer=tokenizer, name="tiny-smol", prefix_cache=cache)
    set_cost_model(pair, CostModel(**ROUND))  # no calibration: the estimate is checked by hand
    return pair


@pytest.fixture
def otel():
    """(exporter, reader, providers as ChatSpecDecode keyword arguments)."""
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    yield exporter, reader, {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _one_span(exporter):
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def _points(reader) -> dict[str, list]:
    """Metric name -> its data points."""
    out: dict[str, list] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def _check_matches_reply(span, reply: AIMessage) -> None:
    """Every count on the span is the one the reply's metadata reports (both read DecodeStats)."""
    a, usage, spec = span.attributes, reply.usage_metadata, reply.response_metadata["speculative"]
    stats = reply.response_metadata["stats"]
    assert a[A.USAGE_INPUT_TOKENS] == usage["input_tokens"]
    assert a[A.USAGE_OUTPUT_TOKENS] == usage["output_tokens"]
    assert a[A.USAGE_CACHE_READ_INPUT_TOKENS] == usage["input_token_details"]["cache_read"]
    assert a[A.PREFIX_TOKENS_RESTORED] == stats["cached_tokens"]
    assert a[A.PREFILL_TOKENS] == stats["prefill_tokens"] == stats["prompt_tokens"] - stats["cached_tokens"]
    assert a[A.RESPONSE_FINISH_REASONS] == (reply.response_metadata["finish_reason"],)
    assert a[A.DRAFTER] == (spec["drafter"] or "none")
    for name, key in [
        (A.DRAFT_TOKENS, "draft_tokens"),
        (A.ACCEPTED_TOKENS, "accepted_tokens"),
        (A.VERIFY_STEPS, "verify_steps"),
        (A.ACCEPTANCE_RATE, "acceptance_rate"),
        (A.MEAN_ACCEPTANCE_LENGTH, "mean_acceptance_length"),
    ]:
        assert a[name] == spec[key], (name, a[name], spec[key])
    assert list(a[A.ACCEPTANCE_HISTOGRAM]) == spec["acceptance_histogram"]
    assert a[A.FORCED_TOKENS] == stats.get("forced_tokens", 0)
    assert a[A.JUMP_FORWARD_TOKENS] == stats.get("jump_forward_tokens", 0)
    assert a[A.LATENCY_SAVED] == pytest.approx(a[A.BASELINE_ESTIMATE] - a[A.DECODE_TIME])
    duration = (span.end_time - span.start_time) / 1e9
    assert 0 < a[A.DECODE_TIME] <= duration, (a[A.DECODE_TIME], duration)
    assert 0 < a[A.TIME_TO_FIRST_TOKEN] <= duration


# -- spans of chat calls ------------------------------------------------------------------------------


def test_greedy_call(chat_pair, otel):
    exporter, reader, providers = otel
    llm = ChatSpecDecode(pair=chat_pair, max_tokens=12, prefix_cache=False, **providers)
    reply = llm.invoke("Repeat after me: one two three, one two three, one two three.")
    span = _one_span(exporter)
    assert span.name == "chat tiny-smol" and span.kind == SpanKind.INTERNAL
    assert span.status.status_code == StatusCode.UNSET
    a = span.attributes
    assert a[A.OPERATION_NAME] == "chat" and a[A.PROVIDER_NAME] == "agentspec"
    assert a[A.REQUEST_MODEL] == a[A.RESPONSE_MODEL] == "tiny-smol"
    assert a[A.REQUEST_MAX_TOKENS] == 12 and a[A.REQUEST_TEMPERATURE] == 0.0
    assert A.REQUEST_STREAM not in a  # invoke aggregates the chunks: set only when streaming
    assert a[A.REQUEST_SPECULATIVE] is True and a[A.REQUEST_PREFIX_CACHE] is False
    assert a[A.DRAFTER] not in ("none", None) and a[A.VERIFY_STEPS] >= 1  # the default drafter
    for absent in (A.REQUEST_TOP_P, A.REQUEST_TOP_K, A.REQUEST_SEED, A.ERROR_TYPE):
        assert absent not in a, absent
    _check_matches_reply(span, reply)
    # the estimate: a prefill of P tokens, then one pass per further token (after P, P+1, ... cached),
    # at the round costs times the scales this call's plain passes refreshed
    cost = cost_model(chat_pair)
    p, n = a[A.USAGE_INPUT_TOKENS], a[A.USAGE_OUTPUT_TOKENS]
    prefill = (0.1 + 0.01 * p) * cost.prefill_scale
    decode = sum(0.05 + 0.001 * (p + j) for j in range(n - 1)) * cost.decode_scale
    assert a[A.BASELINE_ESTIMATE] == pytest.approx(prefill + decode)


def test_sampled_call(chat_pair, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(
        pair=chat_pair, max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=3, stop=["\n\n"], **providers
    )
    reply = llm.invoke("Say something.")
    span = _one_span(exporter)
    a = span.attributes
    assert a[A.REQUEST_TEMPERATURE] == 0.7 and a[A.REQUEST_TOP_P] == 0.9 and a[A.REQUEST_TOP_K] == 20
    assert a[A.REQUEST_SEED] == 3 and a[A.REQUEST_STOP_SEQUENCES] == ("\n\n",)
    _check_matches_reply(span, reply)


def test_streamed_call_and_prefix_cache_reads(chat_pair, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=chat_pair, max_tokens=6, **providers)
    first = [HumanMessage("The prefix cache keeps this sentence between calls. " * 3)]
    llm.invoke(first)
    chunks = list(llm.stream([*first, AIMessage("ok"), HumanMessage("And this?")]))
    cold, warm = exporter.get_finished_spans()
    assert A.REQUEST_STREAM not in cold.attributes and warm.attributes[A.REQUEST_STREAM] is True
    reply = chunks[0]
    for c in chunks[1:]:
        reply += c
    _check_matches_reply(warm, reply)
    assert warm.attributes[A.USAGE_CACHE_READ_INPUT_TOKENS] >= cold.attributes[A.USAGE_INPUT_TOKENS] - 1
    assert warm.attributes[A.PREFILL_TOKENS] < warm.attributes[A.USAGE_INPUT_TOKENS] / 2


def test_stream_closed_early_is_not_an_error(chat_pair, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=chat_pair, max_tokens=40, prefix_cache=False, **providers)
    stream = llm.stream("Count: one two three four five six seven eight nine ten")
    next(stream)
    stream.close()
    span = _one_span(exporter)
    assert span.attributes[A.CLOSED_EARLY] is True and A.ERROR_TYPE not in span.attributes
    assert span.status.status_code == StatusCode.UNSET
    assert span.attributes[A.USAGE_OUTPUT_TOKENS] < 40


def test_tool_calling_call(chat_pair, otel):
    exporter, _, providers = otel
    llm = WholeCall(pair=chat_pair, max_tokens=30, prefix_cache=False, **providers)
    reply = llm.bind_tools([now], tool_choice="now").invoke("What time is it?")
    assert [c["name"] for c in reply.tool_calls] == ["now"]
    span = _one_span(exporter)
    assert span.attributes[A.RESPONSE_FINISH_REASONS] == ("stop",)
    # the call was complete in the forced text: at most one pass (none when a grammar forces the end)
    assert span.attributes[A.VERIFY_STEPS] <= 1 and span.attributes[A.USAGE_OUTPUT_TOKENS] <= 1
    _check_matches_reply(span, reply)


def test_failing_call(chat_pair, otel):
    exporter, reader, providers = otel
    llm = ChatSpecDecode(pair=chat_pair, max_tokens=4, **providers)
    with pytest.raises(ContextLengthExceeded, match="context"):
        llm.invoke("word " * 1200)  # longer than the 1,024-token context: refused in preparation
    with pytest.raises(ValueError, match="serves"):
        llm.invoke("hi", model="another-model")  # fails in preparation, before decoding
    long, wrong = exporter.get_finished_spans()
    for span, error in ((long, "ContextLengthExceeded"), (wrong, "ValueError")):
        assert span.name == "chat tiny-smol"
        assert span.status.status_code == StatusCode.ERROR
        assert span.attributes[A.ERROR_TYPE] == error
        assert [e.name for e in span.events] == ["exception"]
        assert A.LATENCY_SAVED not in span.attributes  # nothing was decoded
        assert A.REQUEST_MAX_TOKENS not in span.attributes  # refused before it had a config
    points = _points(reader)[A.METRIC_OPERATION_DURATION]  # one series per error type, one call each
    assert sorted((p.attributes[A.ERROR_TYPE], p.count) for p in points) == [
        ("ContextLengthExceeded", 1),
        ("ValueError", 1),
    ]


def test_metrics(chat_pair, otel):
    exporter, reader, providers = otel
    llm = ChatSpecDecode(pair=chat_pair, max_tokens=10, prefix_cache=False, **providers)
    replies = [llm.invoke("one two three one two three one two three"), llm.invoke("four five six")]
    spans = exporter.get_finished_spans()
    points = _points(reader)
    expected = {
        A.METRIC_OPERATION_DURATION,
        A.METRIC_TOKEN_USAGE,
        A.METRIC_TIME_TO_FIRST_TOKEN,
        A.METRIC_TIME_PER_OUTPUT_TOKEN,
        A.METRIC_DRAFT_TOKENS,
        A.METRIC_ACCEPTED_TOKENS,
        A.METRIC_FORCED_TOKENS,
        A.METRIC_CACHE_READ_TOKENS,
        A.METRIC_LATENCY_SAVED,
        A.METRIC_BASELINE_DURATION,
    }
    assert expected <= set(points), expected - set(points)
    by_type = {p.attributes[A.TOKEN_TYPE]: p for p in points[A.METRIC_TOKEN_USAGE]}
    assert by_type["input"].sum == sum(r.usage_metadata["input_tokens"] for r in replies)
    assert by_type["output"].sum == sum(r.usage_metadata["output_tokens"] for r in replies)
    assert by_type["input"].count == 2
    (duration,) = points[A.METRIC_OPERATION_DURATION]
    assert duration.count == 2 and duration.attributes[A.REQUEST_MODEL] == "tiny-smol"
    assert A.ERROR_TYPE not in duration.attributes
    (drafted,) = points[A.METRIC_DRAFT_TOKENS]
    assert drafted.value == sum(s.attributes[A.DRAFT_TOKENS] for s in spans)
    assert drafted.attributes[A.DRAFTER] == spans[0].attributes[A.DRAFTER] != "none"
    (accepted,) = points[A.METRIC_ACCEPTED_TOKENS]
    assert accepted.value == sum(s.attributes[A.ACCEPTED_TOKENS] for s in spans)
    (saved,) = points[A.METRIC_LATENCY_SAVED]
    assert saved.value == pytest.approx(sum(s.attributes[A.LATENCY_SAVED] for s in spans))


def test_no_sdk_records_nothing(chat_pair, monkeypatch):
    telemetry = Telemetry(
        tracer_provider=trace.NoOpTracerProvider(), meter_provider=metrics.NoOpMeterProvider()
    )
    call = telemetry.call(CallInfo("m", None, streamed=True))
    assert not call.enabled
    # the API's global stand-ins (no SDK installed) count as none
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    from opentelemetry.metrics._internal import _ProxyMeterProvider

    monkeypatch.setattr(metrics, "get_meter_provider", lambda: _ProxyMeterProvider())
    assert not Telemetry().call(CallInfo("m", None)).enabled
    reply = ChatSpecDecode(pair=chat_pair, max_tokens=3).invoke("hi")  # and the model works as before
    assert reply.usage_metadata["output_tokens"] == 3


def test_a_deep_copy_of_the_chat_model_records_to_the_same_providers():
    llm = ChatSpecDecode(max_tokens=3)  # the global providers, looked up at each call
    llm._tracing().call(CallInfo("m", None))  # has resolved them once
    copied = copy.deepcopy(llm)  # a Telemetry holds a lock: it copies itself without it
    assert copied._tracing() is not llm._tracing() and copied._tracing().tracer_provider is None


# -- under an agent run ---------------------------------------------------------------------------------


def _agent(llm):
    """A create_agent run whose first model call is forced to call ``now``, the second to answer."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware

    class Script(AgentMiddleware):
        def wrap_model_call(self, request, handler):
            done = any(isinstance(m, AIMessage) for m in request.messages)
            return handler(request.override(tool_choice="none" if done else "now"))

    return create_agent(llm, tools=[now], middleware=[Script()])


def test_spans_are_children_of_the_agent_span(chat_pair, otel):
    exporter, _, providers = otel
    llm = WholeCall(pair=chat_pair, max_tokens=6, **providers)
    tracer = providers["tracer_provider"].get_tracer("test")
    with tracer.start_as_current_span("agent") as outer:
        out = _agent(llm).invoke({"messages": [HumanMessage("What time is it?")]})
    assert [type(m).__name__ for m in out["messages"]] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "AIMessage",
    ]
    spans = exporter.get_finished_spans()
    chats = [s for s in spans if s.name == "chat tiny-smol"]
    assert len(chats) == 2, [s.name for s in spans]
    for span in chats:
        assert span.parent is not None and span.parent.span_id == outer.get_span_context().span_id
        assert span.context.trace_id == outer.get_span_context().trace_id
    assert chats[1].attributes[A.USAGE_CACHE_READ_INPUT_TOKENS] > 0  # the second call reused the first


def test_spans_are_children_of_openinference_llm_spans(chat_pair, otel):
    oi = pytest.importorskip(
        "openinference.instrumentation.langchain",
        reason="openinference-instrumentation-langchain (a dev dependency) is not installed",
    )
    exporter, _, providers = otel
    instrumentor = oi.LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=providers["tracer_provider"])
    try:
        _agent(WholeCall(pair=chat_pair, max_tokens=6, **providers)).invoke(
            {"messages": [HumanMessage("What time is it?")]}
        )
    finally:
        instrumentor.uninstrument()
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    chats = [s for s in spans if s.name == "chat tiny-smol"]
    assert len(chats) == 2, [s.name for s in spans]
    for span in chats:
        parent = by_id[span.parent.span_id]
        assert parent.attributes.get("openinference.span.kind") == "LLM", (
            parent.name,
            dict(parent.attributes),
        )
        root = parent
        while root.parent is not None:
            root = by_id[root.parent.span_id]
        assert root.attributes.get("openinference.span.kind") in ("CHAIN", "AGENT"), root.name


# -- the core entry point -------------------------------------------------------------------------------


def test_traced_stream(pair, otel):
    exporter, _, providers = otel
    set_cost_model(pair, CostModel(**ROUND))
    steps = list(
        # drafter="model" drafts every pass; "auto" may bench the draft on what earlier tests taught
        # the pair's shared DraftMemory about timing (a fresh-clone CI run once saw 0 draft tokens)
        traced_stream(
            pair, [1, 2, 3, 1, 2, 3, 1, 2], drafter="model", max_new_tokens=9, num_draft_tokens=3, **providers
        )
    )
    span = _one_span(exporter)
    a, stats = span.attributes, steps[-1].stats
    assert span.name == "chat tiny" and a[A.REQUEST_MAX_TOKENS] == 9 and a[A.REQUEST_NUM_DRAFT_TOKENS] == 3
    assert a[A.DRAFTER] == stats.drafter and a[A.DRAFT_TOKENS] == stats.draft_tokens > 0
    assert a[A.ACCEPTED_TOKENS] == stats.accepted_tokens and a[A.USAGE_OUTPUT_TOKENS] == 9
    assert a[A.RESPONSE_FINISH_REASONS] == ("length",) and a[A.REQUEST_PREFIX_CACHE] is True


# -- the estimate, by hand ------------------------------------------------------------------------------


def test_baseline_seconds_by_hand():
    cost = CostModel(**ROUND)
    stats = DecodeStats(prompt_tokens=10, output_tokens=3)
    # prefill 10 tokens: 0.1 + 0.1; then 2 passes after 10 and 11 cached tokens: 0.06 + 0.061
    assert baseline_seconds(cost, stats) == pytest.approx(0.2 + 0.06 + 0.061)
    stats.forced_tokens = 2  # plain decoding has no jump-forward: a forced token costs a pass too
    assert baseline_seconds(cost, stats) == pytest.approx(0.2 + 0.06 + 0.061)
    assert baseline_seconds(cost, DecodeStats(prompt_tokens=10, output_tokens=0)) == pytest.approx(0.2)
    quad = CostModel(p0=0.0, p1=0.0, p2=1e-6, d0=0.0, d1=0.0)
    assert quad.prefill_s(1000) == pytest.approx(1.0)
    cost.decode_scale, cost.prefill_scale = 2.0, 3.0
    assert baseline_seconds(cost, stats) == pytest.approx(3 * 0.2 + 2 * (0.06 + 0.061))


def _pass(fed: int, cached: int, drafted: int, seconds: float) -> Step:
    """A Step as the loop yields it for a target pass that fed ``fed`` tokens after ``cached``."""
    return Step([0], "", drafted, 0, 0, seconds, fed=fed, cached=cached)


def _observe(cost: CostModel, steps: list[Step]) -> None:
    """``cost`` told of each pass as the loop tells the pair's cost model (target passes only)."""
    for s in steps:
        if s.target_pass:
            cost.observe_pass(s.fed, s.cached, s.seconds)


def _implied_passes(stats: DecodeStats, steps: list[Step]) -> list[tuple[int, int]]:
    """(fed, cached) of each target pass as the stats imply them.

    The first pass feeds the uncached prompt (``prefill`` + the last prompt token); every later one
    feeds what the cache lacks: the token the last pass added, and any tokens a grammar forced
    since. Tokens forced in a step are fed by its pass, drafts come on top. The cache before a
    pass holds the prompt and the output so far, less those unfed tokens.
    """
    out: list[tuple[int, int]] = []
    emitted = 0  # output tokens before the step
    unfed = 0  # of those, not yet in the target's cache
    for s in steps:
        if s.target_pass:
            if not out:
                out.append((s.prefill + 1 + s.forced + s.drafted, stats.prompt_tokens - s.prefill - 1))
            else:
                out.append((unfed + s.forced + s.drafted, stats.prompt_tokens + emitted - unfed))
            unfed = 1  # the pass's own last token is fed by the next one
        else:
            unfed += len(s.tokens)
        emitted += len(s.tokens)
    return out


def test_steps_say_what_each_pass_fed(chat_pair):
    """The facts the estimate reads (Step.fed, Step.cached, Step.restored) are the passes the stats imply,
    with drafts, a warm prefix cache, and a grammar forcing tokens without a pass."""
    ids = chat_pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Answer yes or no: is a repeated prompt a repeated prompt? " * 3}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    answer = G.regex(r"The answer is (yes|no)\. The answer is (yes|no)\.")
    calls = [
        dict(drafter="suffix", max_new_tokens=12),
        dict(drafter="suffix", max_new_tokens=12),  # the same prompt again: restored from the cache
        dict(drafter="suffix", max_new_tokens=30, grammar=answer),
    ]
    for options in calls:
        steps = list(stream(chat_pair, ids, **options))
        stats = steps[-1].stats
        passes = [(s.fed, s.cached) for s in steps if s.target_pass]
        assert passes == _implied_passes(stats, steps), (options, passes)
        assert steps[0].restored == stats.cached_tokens and all(s.restored == 0 for s in steps[1:])
    assert stats.forced_tokens > 0 and not all(s.target_pass for s in steps)  # the grammar call


def test_the_cost_model_learns_only_from_baseline_like_passes():
    cost = CostModel(**ROUND)
    decode_at_100 = 0.05 + 0.001 * 100
    _observe(cost, [_pass(1, 100, 0, 2 * decode_at_100)] * 50)  # plain passes twice as slow as fitted
    assert cost.decode_scale == pytest.approx(2.0, rel=0.01) and cost.prefill_scale == 1.0
    before = (cost.decode_scale, cost.prefill_scale)
    # a verify pass (k+1 tokens cost more than one, with more work around it), a short pass from
    # scratch (mostly fixed cost), a step the grammar alone made (no pass): none is used
    no_pass = dataclasses.replace(_pass(1, 100, 0, 9.0), target_pass=False)
    _observe(cost, [_pass(4, 100, 3, 9.0), _pass(8, 0, 0, 9.0), no_pass])
    assert (cost.decode_scale, cost.prefill_scale) == before
    _observe(cost, [_pass(100, 0, 0, 0.5 * (0.1 + 0.01 * 100))] * 20)  # a from-scratch prefill at half
    assert cost.prefill_scale == pytest.approx(0.5, rel=0.01)
    # a pass over 33 tokens (3 of them drafts) after 50 cached ones is a prefill as well, here at half
    cost.p2 = 1e-5  # its attention term: 33^2 + 2 * 33 * 50 pairs
    _observe(cost, [_pass(33, 50, 3, 0.5 * (0.1 + 0.01 * 33 + 1e-5 * (33 * 33 + 2 * 33 * 50)))] * 5)
    assert cost.prefill_scale == pytest.approx(0.5, rel=0.01)
    assert cost.prefill_s(33, 50) == pytest.approx(0.5 * (0.1 + 0.33 + 1e-5 * (33 * 33 + 3300)), rel=1e-3)


def test_a_prior_is_rescaled_by_the_first_passes():
    cost = CostModel.for_device("cpu")
    assert cost.prior and cost.source == "prior" and cost.scales() == (1.0, 1.0)
    decode = cost.d0 + cost.d1 * 100
    _observe(cost, [_pass(1, 100, 0, 30 * decode)])  # 30x the prior: its size was a guess
    assert cost.decode_scale == pytest.approx(30.0) and cost.source == "prior"
    assert cost.scales() == pytest.approx((30.0, 30.0))  # the unseen prefill term borrows it
    prefill = cost.p0 + cost.p1 * 200 + cost.p2 * 200 * 200
    _observe(cost, [_pass(200, 0, 0, 10 * prefill)])
    assert cost.scales() == pytest.approx((10.0, 30.0)) and cost.source == "observed"
    _observe(cost, [_pass(1, 100, 0, 3000 * decode)])  # a pause: clipped to 5x the scale so far
    assert cost.decode_scale == pytest.approx(30.0 + (150.0 - 30.0) / 2)  # the mean of two passes
    assert CostModel.for_device("cuda").source == "prior" and CostModel(**ROUND).source == "calibrated"


def test_tracing_runs_no_model_pass(chat_pair, tiny_llama, otel):
    """A traced first call on a fresh pair runs exactly the target passes an untraced one runs."""
    exporter, _, providers = otel
    no_sdk = {"tracer_provider": trace.NoOpTracerProvider(), "meter_provider": metrics.NoOpMeterProvider()}
    forwards = {}
    for kind, telemetry in (("untraced", no_sdk), ("traced", providers)):
        model = tiny_llama(5, vocab_size=len(chat_pair.tokenizer), max_positions=1024)
        seen: list[int] = []
        # every target forward, lean or transformers', embeds its rows once
        model.get_input_embeddings().register_forward_hook(lambda *_, seen=seen: seen.append(1))
        fresh = ModelPair(
            target=model, tokenizer=chat_pair.tokenizer, name="fresh", prefix_cache=PrefixCache(1 << 26)
        )
        ChatSpecDecode(pair=fresh, max_tokens=8, **telemetry).invoke("Count: one two three, one two three")
        forwards[kind] = len(seen)
    assert forwards["traced"] == forwards["untraced"] > 0, forwards
    a = _one_span(exporter).attributes
    assert a[A.COST_SOURCE] in ("prior", "observed") and A.BASELINE_ESTIMATE in a


def test_speculation_attributes_read_forced_tokens():
    stats = DecodeStats(drafter=None, prompt_tokens=5, output_tokens=4)
    assert A.speculation_attributes(stats)[A.FORCED_TOKENS] == 0  # before grammar decoding existed
    stats.forced_tokens = 3
    attrs = A.speculation_attributes(stats)
    assert attrs[A.FORCED_TOKENS] == 3 and attrs[A.DRAFTER] == "none"


def test_calibrate_fits_increasing_costs(pair):
    cost = calibrate(pair, sizes=(8, 32, 64))
    assert cost.p1 >= 0 and cost.p2 >= 0 and cost.d1 >= 0, cost
    assert 0 < cost.prefill_s(8) <= cost.prefill_s(64) and cost.decode_s(10) > 0, cost
    assert cost_model(pair) is cost and cost.source == "calibrated"  # installed on the pair
    set_cost_model(pair, None)  # back to the prior
    assert cost_model(pair).source == "prior"


def _plain_call(pair, providers) -> list[Step]:
    """A traced call that is its own baseline: plain decoding (no drafts), no prefix cache."""
    ids = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": "A prompt of some length for the prefill to matter. " * 8}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    return list(
        traced_stream(pair, ids, speculative=False, prefix_cache=False, max_new_tokens=40, **providers)
    )


def _check_estimates_itself(span, steps: list[Step], expected: CostModel) -> None:
    """The call's passes are the baseline's, one for one; its estimate is ``expected`` (the curve the
    call started from, refreshed by these passes) priced over them: no timing enters but theirs."""
    stats, a = steps[-1].stats, span.attributes
    passes = [s for s in steps if s.target_pass]
    # the baseline: a prefill over the whole prompt, then one pass per further output token
    assert [(s.fed, s.cached) for s in passes] == [(stats.prompt_tokens, 0)] + [
        (1, stats.prompt_tokens + j) for j in range(stats.output_tokens - 1)
    ]
    assert a[A.USAGE_OUTPUT_TOKENS] == 40 and a[A.DRAFT_TOKENS] == 0
    _observe(expected, steps)
    assert a[A.BASELINE_ESTIMATE] == pytest.approx(baseline_seconds(expected, stats), rel=1e-9)
    assert a[A.COST_SOURCE] == expected.source
    assert a[A.LATENCY_SAVED] == pytest.approx(a[A.BASELINE_ESTIMATE] - a[A.DECODE_TIME])
    # how near the estimate lands to the measurement is a benchmark's figure (the loop suite's telemetry
    # part: its baseline runs' own latency_saved_s), not a threshold a busy machine could cross


def test_a_plain_call_estimates_itself_on_a_given_curve(chat_pair, otel):
    exporter, _, providers = otel
    set_cost_model(chat_pair, CostModel(**ROUND))
    try:
        steps = _plain_call(chat_pair, providers)
        refreshed = cost_model(chat_pair)
    finally:
        set_cost_model(chat_pair, CostModel(**ROUND))  # the round numbers, unmoved, for the other tests
    _check_estimates_itself(_one_span(exporter), steps, CostModel(**ROUND))
    assert refreshed.source == "calibrated" and (refreshed.prefill_passes, refreshed.decode_passes) == (1, 39)


def test_a_plain_call_rescales_the_prior_before_its_estimate(chat_pair, otel):
    """With no calibration, the call's own passes move the prior's scales before its estimate is made."""
    exporter, _, providers = otel
    fresh = ModelPair(target=chat_pair.target, tokenizer=chat_pair.tokenizer, name="tiny-smol")
    assert cost_model(fresh).source == "prior"
    steps = _plain_call(fresh, providers)
    _check_estimates_itself(_one_span(exporter), steps, CostModel.for_device("cpu"))
    learned = cost_model(fresh)
    assert learned.source == "observed" and (learned.prefill_passes, learned.decode_passes) == (1, 39)


def test_the_reply_and_the_span_report_the_same_saving(chat_pair, otel):
    """One record per call (agentspec.decode.CallRecord): the span and the reply's metadata read it."""
    exporter, _, providers = otel
    reply = ChatSpecDecode(pair=chat_pair, max_tokens=6, **providers).invoke("one two three")
    latency, a = reply.response_metadata["latency"], _one_span(exporter).attributes
    assert a[A.LATENCY_SAVED] == latency["latency_saved_s"] == latency["baseline_s"] - latency["decode_s"]
    assert a[A.DECODE_TIME] == latency["decode_s"] and a[A.COST_SOURCE] == latency["cost_source"]
