"""The server's failures, in this process: a decode that fails before its reply starts, one that fails
mid-stream, and a whole reply whose client goes away; after each, the pair's lock is free and the next
request is answered, from a cache that still holds what was verified.

A tiny random Llama behind the embedded tokenizer answers (conftest's ``tiny_smol``): the app needs
the real chat template, not sensible replies. Failures are injected in the target's ``forward`` at a
chosen pass, as ``tests/unit/test_oom.py`` injects its OOMs. The disconnect test holds a pass on an
event the test controls and closes its socket while that pass waits, so what it checks is counted
(passes run, requests closed early), never timed. That test runs uvicorn on 127.0.0.1 (a client
going away is a closed connection); the others use FastAPI's TestClient.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from agentspec.fleet.process import free_port
from agentspec.serve import create_app

URL = "/v1/chat/completions"
FAILURE = "RuntimeError: the device went away (simulated)"
WAIT_S = 60.0  # a bound on waits for the other thread, never reached when the test passes


def _body(salt: str, **options) -> dict:
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    return {"messages": messages, "max_tokens": 12, "temperature": 0, "cache_salt": salt, **options}


def _salt() -> str:
    return uuid.uuid4().hex  # a namespace of its own: no earlier test's cache


def fail_at(monkeypatch, model, n: int) -> list[int]:
    """Make ``model``'s ``n``-th forward from now (0-based) raise; returns the forwards seen. Set on
    its embedding, which every forward of a pass (the lean one, transformers') calls once."""
    embed = model.get_input_embeddings()
    real, calls = embed.forward, []

    def forward(ids):
        calls.append(1)
        if len(calls) - 1 == n:
            raise RuntimeError("the device went away (simulated)")
        return real(ids)

    monkeypatch.setattr(embed, "forward", forward)
    return calls


def _events(text: str) -> list:
    """An SSE body's events: JSON objects, and "[DONE]"."""
    out = []
    for event in text.split("\n\n"):
        if event:
            assert event.startswith("data: "), event
            data = event[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _streamed_text(events: list) -> str:
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)


def _server_error() -> dict:
    return {"error": {"message": FAILURE, "type": "server_error", "param": None, "code": None}}


def _answered(metrics: str, status: int) -> float:
    line = f'agentspec_requests_total{{model_name="tiny-smol",status="{status}"}} '
    return float(next(x for x in metrics.splitlines() if x.startswith(line)).rsplit(" ", 1)[1])


def _lock_is_free(pair) -> bool:
    if not pair.lock.acquire(blocking=False):
        return False
    pair.lock.release()
    return True


@pytest.fixture
def client(tiny_smol):
    # an unhandled error answers 500 and is then raised again by Starlette: the client gets the answer
    with TestClient(create_app(tiny_smol), raise_server_exceptions=False) as client:
        yield client


def test_a_decode_that_fails_before_the_reply_answers_500(client, tiny_smol, monkeypatch):
    salt = _salt()
    want = client.post(URL, json=_body(_salt())).json()  # the reply, from another namespace
    calls = fail_at(monkeypatch, tiny_smol.target, 0)  # the first pass: the prompt's prefill
    failed = client.post(URL, json=_body(salt), headers={"X-Request-Id": "req-7"})
    assert failed.status_code == 500 and failed.json() == _server_error()
    assert failed.headers["X-Request-Id"] == "req-7"  # sent from outside the middleware, with the id
    assert len(calls) == 1  # nothing ran after the failed pass
    assert _answered(client.get("/metrics").text, 500) == 1
    assert _lock_is_free(tiny_smol)  # released in the worker's thread before the answer was sent

    again = client.post(URL, json=_body(salt))
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"] == want["choices"][0]["message"]
    # the failed prefill was rolled back: it left nothing in the cache to read
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_stream_whose_request_fails_in_preparing_answers_500(client, tiny_smol, monkeypatch):
    """Before its "ready" a stream has sent nothing: a failure then is a status, as for a whole reply."""

    def render(*args, **kwargs):
        raise RuntimeError("the device went away (simulated)")

    monkeypatch.setattr(tiny_smol.tokenizer, "apply_chat_template", render)
    failed = client.post(URL, json=_body(_salt(), stream=True))
    assert failed.status_code == 500 and failed.json() == _server_error()
    monkeypatch.undo()
    assert _lock_is_free(tiny_smol)
    assert client.post(URL, json=_body(_salt(), stream=True)).status_code == 200


@pytest.mark.parametrize("at", [0, 3], ids=["first-pass", "mid-stream"])
def test_a_stream_that_fails_while_decoding_ends_with_an_error_event(client, tiny_smol, monkeypatch, at):
    """The status line (200) went with the stream's start: the failure is its last event, and no
    [DONE] follows. The stream's text so far is the reply's start; what its passes verified is
    saved, and the same request again reads it back and gives the whole reply."""
    salt = _salt()
    want = _streamed_text(_events(client.post(URL, json=_body(_salt(), stream=True)).text))
    calls = fail_at(monkeypatch, tiny_smol.target, at)
    failed = client.post(URL, json=_body(salt, stream=True))
    assert failed.status_code == 200 and len(calls) == at + 1
    events = _events(failed.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == _server_error()  # the last event: no finish chunk, no [DONE]
    assert all("error" not in e for e in events[:-1])
    sent = _streamed_text(events[:-1])
    assert want.startswith(sent) and (sent != "") == (at > 0), (sent, want)
    assert _answered(client.get("/metrics").text, 200) == 2  # counted once, when the stream began
    assert _lock_is_free(tiny_smol)

    again = client.post(URL, json=_body(salt)).json()
    assert again["choices"][0]["message"]["content"] == want
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the passes before the failure verified the prompt (all of it but the last token is saved); the
    # failed first pass verified nothing
    assert cached == (again["usage"]["prompt_tokens"] - 1 if at > 0 else 0)


# -- a client that goes away ----------------------------------------------------------------------------


@contextlib.contextmanager
def _served(app):
    """``app`` behind uvicorn on a free port of 127.0.0.1, in a thread; the base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_for(lambda: server.started, "uvicorn to start")
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def hold_at(monkeypatch, model, n: int, reached: threading.Event, release: threading.Event) -> list[int]:
    """Make ``model``'s ``n``-th forward from now (0-based) wait for ``release``, having set ``reached``
    (at its embedding, as ``fail_at``)."""
    embed = model.get_input_embeddings()
    real, calls = embed.forward, []

    def forward(ids):
        calls.append(1)
        if len(calls) - 1 == n:
            reached.set()
            release.wait(WAIT_S)
        return real(ids)

    monkeypatch.setattr(embed, "forward", forward)
    return calls


def _post_raw(sock: socket.socket, body: dict) -> None:
    data = json.dumps(body).encode()
    head = f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)


def test_a_whole_reply_whose_client_goes_away_frees_the_pair(tiny_smol, monkeypatch):
    """The client of a whole (not streamed) reply closes its connection while the third pass runs:
    the server cancels the decode, which stops after that pass, saves what it verified and frees the
    pair for the next request."""
    app, salt = create_app(tiny_smol), _salt()
    server = app.state.server
    reached, release = threading.Event(), threading.Event()
    calls = hold_at(monkeypatch, tiny_smol.target, 2, reached, release)
    try:
        with _served(app) as url:
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
                _post_raw(sock, _body(salt, max_tokens=400))
                assert reached.wait(WAIT_S), "the decode never reached its third pass"
                (job,) = server.jobs
            # the connection is closed; the third pass still waits
            assert job.cancelled.wait(WAIT_S), "the server never noticed its client had gone"
            release.set()
            _wait_for(lambda: server.admission.active == 0, "the cancelled decode to end")
            assert job.closed_early and len(job.record.steps) == 3 and len(calls) == 3  # no pass after it
            metrics = httpx.get(f"{url}/metrics").text
            assert 'agentspec_requests_closed_early_total{model_name="tiny-smol"} 1.0' in metrics
            monkeypatch.undo()
            again = httpx.post(f"{url}{URL}", json=_body(salt, max_tokens=2), timeout=WAIT_S)
    finally:
        release.set()  # never leave the worker waiting, whatever failed
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2
    # the cancelled decode saved its verified part: the whole prompt but its last token comes back
    usage = again.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
