"""The server's pure parts: vLLM's per-request metrics from agentspec's stats, the request model's
checks, the response and chunk bodies, tenants' namespaces, the bound on admitted requests, API keys.

The server itself, on the real model, is ``tests/e2e/test_serve.py``; here a tiny random Llama behind
the embedded tokenizer answers through FastAPI's TestClient where a route is driven.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from agentspec.chat import prepare, reply_deltas
from agentspec.cli import api_keys
from agentspec.decode import Step
from agentspec.models import ensure_default_model
from agentspec.scheduler import SchedulerStats
from agentspec.serve import create_app
from agentspec.serve import protocol as P
from agentspec.serve.app import Server, key_id, namespace
from agentspec.serve.metrics import ServerMetrics
from agentspec.serve.worker import Admission, Engine, Verdict, generation_config
from agentspec.stats import DecodeStats
from agentspec.telemetry import Telemetry


def _stats() -> DecodeStats:
    stats = DecodeStats(drafter="auto", prompt_tokens=20, cached_tokens=12, output_tokens=9)
    stats.observe_step(0, 0)  # two passes with no draft: source "none", not vLLM spec steps
    stats.observe_step(0, 0)
    stats.observe_step(4, 1, "suffix")
    stats.observe_step(4, 4, "suffix")
    stats.observe_step(2, 0, "model")
    return stats


def test_speculative_decoding_has_vllms_meanings():
    stats = _stats()
    assert stats.acceptance_histogram == [3, 1, 0, 0, 1]  # agentspec's: every verify pass
    m = P.speculative_decoding(stats, num_spec_tokens=4)
    assert m == {
        "num_draft_tokens": 10,
        "num_accepted_draft_tokens": 5,
        "num_spec_steps": 3,  # passes over at least one draft token
        "num_spec_tokens": 4,
        "mean_acceptance_length": pytest.approx(1 + 5 / 3),  # the bonus token included, per spec step
        "draft_acceptance_rate": 0.5,
        "acceptance_histogram": [1, 1, 0, 0, 1],  # spec steps by accepted count, k + 1 entries
    }
    # agentspec's own record, by position in the draft (vLLM's /metrics counts the first)
    assert (stats.accepted_per_position, stats.drafted_per_position) == ([2, 1, 1, 1], [3, 3, 2, 2])
    assert sum(m["acceptance_histogram"]) == m["num_spec_steps"]
    longer = P.speculative_decoding(stats, num_spec_tokens=6)["acceptance_histogram"]
    assert longer == [1, 1, 0, 0, 1, 0, 0]
    # a draft length under the histogram's reach cannot shorten it
    assert P.speculative_decoding(stats, num_spec_tokens=2)["num_spec_tokens"] == 4


def test_speculative_decoding_of_plain_decoding():
    stats = DecodeStats(prompt_tokens=5, output_tokens=3)
    for _ in range(3):
        stats.observe_step(0, 0)
    m = P.speculative_decoding(stats, num_spec_tokens=0)
    assert (m["num_spec_steps"], m["num_draft_tokens"], m["acceptance_histogram"]) == (0, 0, [0])
    assert (m["mean_acceptance_length"], m["draft_acceptance_rate"]) == (1.0, 0.0)


def test_usage_carries_cached_tokens():
    assert P.usage(_stats()) == {
        "prompt_tokens": 20,
        "completion_tokens": 9,
        "total_tokens": 29,
        "prompt_tokens_details": {"cached_tokens": 12},
    }
    # n choices: the prompt once, every choice's tokens, the cache's hits before the request
    assert P.usage(_stats(), completion_tokens=30, cached_tokens=0)["total_tokens"] == 50


def _request(**fields) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_request_fields_this_server_cannot_honour():
    assert _request().unsupported() is None
    assert _request(n=1, presence_penalty=0, logprobs=False, user="u", store=False).unsupported() is None
    assert _request(n=4, logprobs=True, top_logprobs=3, priority=-2).unsupported() is None
    assert _request(frequency_penalty=0.5).unsupported() == "frequency_penalty"
    assert _request(presence_penalty=-1).unsupported() == "presence_penalty"
    assert _request(logit_bias={"5": 10}).unsupported() == "logit_bias"
    # vLLM's extras: accepted at the values clients send by default, refused at any other
    defaults = dict(
        repetition_penalty=1.0, min_p=0, ignore_eos=False, stop_token_ids=[], skip_special_tokens=True
    )
    assert _request(**defaults, add_generation_prompt=True, top_k=-1).unsupported() is None
    for field, value in [
        ("repetition_penalty", 1.2),
        ("min_p", 0.1),
        ("ignore_eos", True),
        ("min_tokens", 3),
        ("stop_token_ids", [7]),
        ("chat_template", "{{x}}"),
        ("guided_json", {}),
        ("prompt_logprobs", 1),
        ("continue_final_message", True),
        ("skip_special_tokens", False),
    ]:
        assert _request(**{field: value}).unsupported() == field, field
    assert _request(top_k=-1).top_k_or_none is None and _request(top_k=0).top_k_or_none is None
    assert generation_config(_request(top_k=5)).top_k == 5


def test_logprobs_n_and_priority_reach_the_generation_config():
    assert _request().logprob_count is None and _request(logprobs=True).logprob_count == 0
    config = generation_config(_request(logprobs=True, top_logprobs=5, seed=7, priority=3), index=2)
    assert (config.logprobs, config.seed, config.priority) == (5, 9, 3)  # choice 2 of a seeded request
    assert config.reproducible  # keyed draws: the same request, the same choices
    unseeded = generation_config(_request(), index=2)
    assert unseeded.seed is None and not unseeded.reproducible
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        _request(top_logprobs=2)
    with pytest.raises(ValueError):
        _request(logprobs=True, top_logprobs=21)
    with pytest.raises(ValueError):
        _request(n=0)


def test_request_length_stop_and_temperature():
    assert _request(max_tokens=5).length_limit == 5
    assert _request(max_tokens=5, max_completion_tokens=7).length_limit == 7  # OpenAI's current name wins
    assert _request(stop="x").stop_strings == ("x",)
    assert _request(stop=["a", "b"]).stop_strings == ("a", "b")
    assert generation_config(_request()).temperature == P.DEFAULT_TEMPERATURE == 1.0  # OpenAI's default
    config = generation_config(_request(temperature=0, top_p=0.5, seed=3, stop="z", max_tokens=4))
    assert (config.temperature, config.top_p, config.seed, config.stop, config.max_new_tokens) == (
        0,
        0.5,
        3,
        ("z",),
        4,
    )


def test_message_and_finish_reason():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert P.message("", [call]) == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert P.message("", []) == {"role": "assistant", "content": ""}
    assert P.finish_reason("stop", [call]) == "tool_calls"
    assert P.finish_reason("length", [call]) == "length"  # cut: the calls so far are still sent
    assert P.finish_reason("stop", []) == "stop"


def _data(event: str) -> dict | str:
    assert event.startswith("data: ") and event.endswith("\n\n"), event
    body = event[len("data: ") : -2]
    return body if body == "[DONE]" else json.loads(body)


def test_chunks_are_sse_events_in_openais_shape():
    chunks = P.Chunks("chatcmpl-1", "m", include_usage=True)
    start = _data(chunks.start())
    assert start["object"] == "chat.completion.chunk" and start["id"] == "chatcmpl-1"
    assert start["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert _data(chunks.text("Hel"))["choices"][0]["delta"] == {"content": "Hel"}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    entry = _data(chunks.calls([call], 2))["choices"][0]["delta"]["tool_calls"][0]
    assert entry == {"index": 2, **call}
    finish = _data(chunks.finish("stop", {"speculative_decoding": {}}))
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["metrics"] == {
        "speculative_decoding": {}
    }
    usage, done = (_data(e) for e in chunks.end(P.usage(_stats())))
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}
    assert done == "[DONE]"
    quiet = P.Chunks("chatcmpl-1", "m", include_usage=False).end(P.usage(_stats()))
    assert len(quiet) == 1 and _data(quiet[-1]) == "[DONE]"
    entry = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    second = _data(chunks.text("Hi", index=1, logprobs=[entry]))["choices"][0]
    assert second["index"] == 1 and second["logprobs"] == {"content": [entry], "refusal": None}


def test_error_body_is_openais():
    exc = P.APIError(400, "bad", param="messages")
    assert exc.body() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "messages", "code": None}
    }


def test_namespaces_keep_keys_and_salts_apart():
    assert namespace(None, None) is None  # the shared default, as in-process calls use
    names = {namespace(t, s) for t in (None, "a", "b") for s in (None, "x", "y")} - {None}
    assert len(names) == 8
    assert namespace("a", "x") != namespace("ax", None)
    assert key_id("secret") == key_id("secret") != key_id("secret2")
    assert "secret" not in key_id("secret")


def test_admission_counts_sequences_with_a_share_per_key():
    ok, full, over = Verdict.ADMITTED, Verdict.FULL, Verdict.OVER_SHARE
    alone = Admission(2)  # no keys: every slot for anyone
    assert [alone.enter(None) for _ in range(3)] == [ok, ok, full]
    alone.leave(None)
    assert alone.enter(None) is ok

    keyed = Admission(5, keys=2)
    assert keyed.share == 3  # ceil(5 / 2)
    assert [keyed.enter("a") for _ in range(4)] == [ok, ok, ok, over]
    assert [keyed.enter("b") for _ in range(3)] == [ok, ok, full]  # the other key, up to the limit
    keyed.leave("a")
    assert keyed.enter("a") is ok and keyed.enter("b") is full  # a freed slot, taken back by "a"
    for tenant in ("a", "a", "a", "b", "b"):
        keyed.leave(tenant)
    assert keyed.active == 0 and keyed.held == {}  # a key with nothing in flight keeps no entry

    assert Admission(4, keys=1).share == 4  # a lone key may use every slot
    choices = Admission(4)  # a request's n choices are n sequences
    assert choices.enter(None, 3) is Verdict.ADMITTED and choices.enter(None, 2) is Verdict.FULL
    assert Admission(2, keys=3).share == 1  # more keys than slots: one each, first come
    with pytest.raises(ValueError):
        Admission(0)


def test_api_keys_from_options_and_environment():
    assert api_keys(None, None) == []
    assert api_keys(["k1", " k2 "], "k3, k1,,") == ["k1", "k2", "k3"]


def test_bearer_keys(pair):
    server = Server(Engine(pair, "tiny", "auto", Telemetry()), ["k1", "k2"], max_num_seqs=1)
    try:
        assert server.tenant("Bearer k2") == key_id("k2")
        assert server.tenant("bearer k1") == key_id("k1")
        for header in (None, "", "Bearer", "Bearer k3", "Basic k1", "k1"):
            with pytest.raises(P.APIError) as err:
                server.tenant(header)
            assert err.value.status == 401 and err.value.code == "invalid_api_key"
        open_server = Server(Engine(pair, "tiny", "auto", Telemetry()), [], max_num_seqs=1)
        assert open_server.tenant(None) is None
        open_server.close()
    finally:
        server.close()


def _steps(texts: list[str], last_reason: str | None, stats: DecodeStats) -> list[Step]:
    steps = [
        Step(tokens=[1], text=t, drafted=0, accepted=0, prefill=0, seconds=0.0, stats=stats) for t in texts
    ]
    steps[-1].finish_reason = last_reason
    return steps


def test_reply_deltas_hold_markup_and_end_with_the_loops_finish():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "hi"}]
    free = prepare(tokenizer, messages, [tool], None, constrained=False)
    stats = DecodeStats()
    out = list(
        reply_deltas(
            free, _steps(["Hello", " <tool", "_call>", '{"name": "f"}', "</tool_call>"], "stop", stats)
        )
    )
    # the tag (and the space before it) is never shown; steps that add nothing to show give no delta
    assert [d.text for d in out] == ["Hello", ""]
    assert [d.finish_reason for d in out] == [None, "stop"]
    (call,) = out[1].calls
    assert call["function"] == {"name": "f", "arguments": "{}"} and out[1].first_index == 0

    # one call wanted: the fitted config makes the closing tag a stop string, so the loop finishes
    # there (the tag cut from the text, as for any stop string) and the deltas end with its finish
    named = prepare(tokenizer, messages, [tool], "f", constrained=False)
    assert named.single  # PreparedRequest.fitted adds the closing tag to the stop strings
    stats = DecodeStats()
    out = list(reply_deltas(named, _steps(["<tool_call>", '{"name": "f"}', ""], "stop", stats)))
    assert out[-1].finish_reason == "stop" and all(d.finish_reason is None for d in out[:-1])
    assert [c["function"]["name"] for d in out for c in d.calls] == ["f"]
    assert "".join(d.text for d in out) == ""  # the markup is never text


def test_routes_errors_and_a_reply_through_the_app(tiny_smol):
    with TestClient(create_app(tiny_smol, api_keys=["k"])) as client:
        auth = {"Authorization": "Bearer k"}
        assert client.get("/health").status_code == 200
        denied = client.get("/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers=auth).json()["data"][0]["id"] == "tiny-smol"
        bad = client.post("/v1/chat/completions", headers=auth, json={"messages": "hi"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"  # FastAPI said 422
        other = client.post("/v1/chat/completions", headers=auth, json={"model": "gpt-4", "messages": [{}]})
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        reply = client.post("/v1/chat/completions", headers=auth, json=body).json()
        assert reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["finish_reason"] == "length"
        assert set(reply["metrics"]) == {"speculative_decoding", "agentspec"}
        streamed = client.post("/v1/chat/completions", headers=auth, json={**body, "stream": True})
        events = [_data(line + "\n\n") for line in streamed.text.strip().split("\n\n")]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert text == reply["choices"][0]["message"]["content"]  # greedy: the same reply either way
        metrics = client.get("/metrics", headers=auth).text
        assert 'agentspec_requests_total{model_name="tiny-smol",status="200"} 2.0' in metrics


def _gauge(text: str, name: str) -> float:
    (value,) = re.findall(rf'^{name}{{model_name="tiny-smol"}} (\S+)$', text, re.M)
    return float(value)


def test_metrics_show_the_size_of_what_the_pair_keeps_per_namespace(tiny_smol):
    tenants = tiny_smol.tenants
    with TestClient(create_app(tiny_smol)) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
        for salt in ("metrics-a", "metrics-b", "metrics-a"):
            assert client.post("/v1/chat/completions", json={**body, "cache_salt": salt}).status_code == 200
        held = tenants.namespaces()
        assert {namespace(None, "metrics-a"), namespace(None, "metrics-b")} <= set(held)
        text = client.get("/metrics").text
    assert _gauge(text, "agentspec_tenant_store_namespaces") == len(held)
    assert _gauge(text, "agentspec_tenant_store_bytes") == tenants.bytes > 0
    assert _gauge(text, "agentspec_tenant_store_budget_bytes") == tenants.max_bytes


def test_metrics_read_the_pairs_scheduler_under_vllms_names(tiny_smol):
    stats = SchedulerStats(running=3, waiting=2, passes=4, rows=40, members=10)
    metrics = ServerMetrics("tiny-smol", tiny_smol.tenants, stats)
    text = metrics.exposition().decode()
    # vLLM's names and types for the load a router reads; agentspec's own counters of passes
    for name, kind, value in [
        ("vllm:num_requests_running", "gauge", 3),
        ("vllm:num_requests_waiting", "gauge", 2),
        ("agentspec_scheduler_passes_total", "counter", 4),
        ("agentspec_scheduler_pass_rows_total", "counter", 40),
        ("agentspec_scheduler_pass_sequences_total", "counter", 10),
    ]:
        assert f"# TYPE {name} {kind}" in text, name
        assert _gauge(text, re.escape(name)) == value, name
    stats.passes += 1  # read at each scrape, never copied
    assert _gauge(metrics.exposition().decode(), "agentspec_scheduler_passes_total") == 5


def test_metrics_count_accepted_draft_tokens_by_position(tiny_smol):
    """vLLM's ``spec_decode_num_accepted_tokens_per_pos``: per position in the draft, the tokens
    accepted there, summed over requests."""
    metrics = ServerMetrics("tiny-smol", tiny_smol.tenants, SchedulerStats())
    metrics.decoded(_stats(), spec_steps=3, saved_s=0.0, duration_s=0.1)
    metrics.decoded(_stats(), spec_steps=3, saved_s=0.0, duration_s=0.1)
    text = metrics.exposition().decode()
    name = "agentspec_spec_decode_num_accepted_tokens_per_pos_total"
    found = dict(re.findall(rf'^{name}{{model_name="tiny-smol",position="(\d+)"}} (\S+)$', text, re.M))
    assert {int(k): float(v) for k, v in found.items()} == {0: 4.0, 1: 2.0, 2: 2.0, 3: 2.0}


def test_the_core_imports_no_web_framework():
    code = (
        "import sys, agentspec, agentspec.chat, agentspec.cli;"
        "web = ('fastapi', 'starlette', 'uvicorn', 'prometheus_client');"
        "bad = [m for m in sys.modules if m.split('.')[0] in web];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_verb_options(capsys):
    from agentspec.cli import main

    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--host",
        "--port",
        "--api-key",
        "--max-num-seqs",
        "--threads",
        "--model",
        "--draft-model",
    ):
        assert option in text, option


def test_the_response_and_the_span_report_the_same_saving(tiny_smol):
    """One record per call (agentspec.decode.CallRecord): the span and the response read it alike."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentspec.telemetry import attributes as A

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    with TestClient(create_app(tiny_smol, tracer_provider=provider)) as client:
        response = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "req-42"})
        own = response.json()["metrics"]["agentspec"]
    (span,) = exporter.get_finished_spans()
    assert span.attributes[A.LATENCY_SAVED] == own["latency_saved_s"]
    assert response.headers["x-request-id"] == "req-42"
    assert span.attributes[A.REQUEST_ID_HEADER] == ("req-42",)  # the caller's id finds the span
    assert own["latency_saved_s"] == own["baseline_s"] - own["decode_s"]
    provider.shutdown()
