"""An agent run's speculation totals (``langchain_agentspec.totals``), the model's name in telemetry
(``attributes.model_label``), and the late parent of a call traced by LangSmith's exporter.

No model runs: replies come from LangChain's fake chat model, carrying the metadata a
``ChatSpecDecode`` reply carries (locally, or from an agentspec or vLLM server).
"""

from __future__ import annotations

import time
import uuid

import pytest
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import StatusCode

from agentspec.telemetry import CallInfo, Telemetry
from agentspec.telemetry import attributes as A
from langchain_agentspec import (
    SpeculationCallbackHandler,
    SpeculationTotals,
    _run,
    get_speculation_callback,
    remote_span,
    totals,
)


def _local(drafted: int, accepted: int, cached: int, saved: float) -> AIMessage:
    """A reply as a local ``ChatSpecDecode`` makes it (the keys the totals read)."""
    return AIMessage(
        "ok",
        usage_metadata={
            "input_tokens": 10,
            "output_tokens": 2,
            "total_tokens": 12,
            "input_token_details": {"cache_read": cached},
        },
        response_metadata={
            "speculative": {"drafter": "auto", "draft_tokens": drafted, "accepted_tokens": accepted},
            "latency": {"decode_s": 0.5, "baseline_s": 0.5 + saved, "latency_saved_s": saved},
        },
    )


def test_totals_add_local_agentspec_server_and_vllm_replies():
    t = SpeculationTotals()
    assert t.add(_local(4, 3, 7, 0.25))
    server = AIMessage(  # an agentspec server's figures come under "agentspec"
        "ok",
        response_metadata={
            "speculative": {"draft_tokens": 2, "accepted_tokens": 1},
            "agentspec": {"latency_saved_s": -0.05, "baseline_s": 0.2, "decode_s": 0.25},
        },
    )
    vllm = AIMessage("ok", response_metadata={"speculative": {"draft_tokens": 5, "accepted_tokens": 5}})
    assert t.add(server) and t.add(vllm)  # vLLM: speculation, no latency estimate
    assert not t.add(AIMessage("ok", response_metadata={"model_name": "gpt"}))  # another model's reply
    assert (t.calls, t.draft_tokens, t.accepted_tokens, t.cache_read_tokens) == (3, 11, 9, 7)
    assert t.latency_saved_s == pytest.approx(0.2) and t.decode_s == pytest.approx(0.75)
    assert t.acceptance_rate == pytest.approx(9 / 11)
    assert t.attributes()[A.RUN_LATENCY_SAVED] == pytest.approx(0.2)
    assert SpeculationTotals().attributes() == {  # no time before a reply carries one
        A.RUN_CALLS: 0,
        A.RUN_DRAFT_TOKENS: 0,
        A.RUN_ACCEPTED_TOKENS: 0,
        A.RUN_CACHE_READ_TOKENS: 0,
    }


def test_the_run_names_are_the_engines():
    written = {n: v for n, v in vars(totals).items() if n.startswith("RUN_") and isinstance(v, str)}
    assert len(written) == 7
    assert all(getattr(A, name) == value for name, value in written.items())
    assert set(totals.RUN_ATTRIBUTES.values()) == set(written.values())


def _chain(*replies: AIMessage):
    """A two-step chain around a fake chat model answering ``replies`` in turn."""
    llm = GenericFakeChatModel(messages=iter(replies))
    return RunnableLambda(lambda x: x) | llm


def test_the_callback_sums_the_block_and_nested_blocks_count_in_the_outer():
    chain = _chain(_local(4, 3, 7, 0.25), _local(2, 2, 0, 0.5), _local(1, 0, 1, -0.1))
    with get_speculation_callback() as outer:
        chain.invoke("a")
        with get_speculation_callback() as inner:
            chain.invoke("b")
        assert (inner.totals.calls, inner.totals.draft_tokens) == (1, 2)
    chain.invoke("c")  # after the block: counted by none
    t = outer.totals
    assert (t.calls, t.draft_tokens, t.accepted_tokens, t.cache_read_tokens) == (2, 6, 5, 7)
    assert t.latency_saved_s == pytest.approx(0.75)
    assert outer._parents == {} and outer._runs == {}  # nothing kept once the runs ended


def test_a_handler_passed_to_one_run_counts_that_run():
    handler = SpeculationCallbackHandler()
    chain = _chain(_local(4, 3, 7, 0.25), _local(2, 2, 0, 0.5))
    chain.invoke("a", config={"callbacks": [handler]})
    chain.invoke("b")
    assert handler.totals.calls == 1 and handler.totals.latency_saved_s == pytest.approx(0.25)


def test_model_label_keeps_names_and_drops_paths():
    cases = {
        "SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "/home/alice/models/tiny-smol": "tiny-smol",
        "/home/alice/models/tiny-smol/": "tiny-smol",
        "./checkpoints/run-3": "run-3",
        "~/models/qwen": "qwen",
        "models/ft/final": "final",
        "C:\\models\\llama": "llama",
        "/data/SmolLM2-135M-Instruct-Q8_0.gguf": "SmolLM2-135M-Instruct-Q8_0",
        "/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/0123456789abcdef": "Qwen/Qwen3-0.6B",
    }
    for given, label in cases.items():
        assert A.model_label(given) == label, given
        assert remote_span.model_label(given) == label, given  # the remote path's copy
    assert A.span_name("/home/alice/models/tiny-smol") == "chat tiny-smol"


def test_a_late_parent_is_asked_at_the_end_and_the_span_backdated(spans):
    exporter, provider = spans
    parent = provider.get_tracer("test").start_span("made later")
    asked = []

    def late():
        asked.append(time.time_ns())
        return trace.set_span_in_context(parent)

    call = Telemetry(provider).call(CallInfo("/srv/models/m", None, parent=late, usage=False))
    start = time.time_ns()
    call.fail(ValueError("bad"))
    assert asked == [] and call.span is None  # nothing made before the end
    call.end()
    parent.end()
    span = next(s for s in exporter.get_finished_spans() if s.name == "chat m")
    assert asked and span.parent.span_id == parent.get_span_context().span_id
    assert span.start_time <= start and span.status.status_code == StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"] and span.attributes[A.REQUEST_MODEL] == "m"


def test_late_parent_waits_a_bounded_time_for_langsmith(monkeypatch):
    pytest.importorskip("langsmith")
    from langchain_core.tracers.langchain import LangChainTracer
    from langsmith import Client

    client = Client(
        api_url="http://127.0.0.1:9",
        api_key="offline",
        tracing_mode="otel",
        otel_tracer_provider=TracerProvider(),
    )
    tracer = LangChainTracer(client=client)
    manager = CallbackManagerForLLMRun(run_id=uuid.uuid4(), handlers=[tracer], inheritable_handlers=[])
    assert _run.tracer_reports_usage(manager)
    monkeypatch.setattr(_run, "LATE_PARENT_WAIT_S", 0.05)
    wait = _run.late_parent(manager)
    assert callable(wait)  # the exporter has no span for the run yet
    start = time.monotonic()
    assert wait() is None and time.monotonic() - start < 1.0  # never made: the current span then
    plain = CallbackManagerForLLMRun(run_id=uuid.uuid4(), handlers=[], inheritable_handlers=[])
    assert _run.late_parent(plain) is None and not _run.tracer_reports_usage(plain)
