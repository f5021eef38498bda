"""The server feeds the pair's scheduler: concurrent requests share passes, reply as they would alone,
and admission counts them, with a share per API key.

A tiny random Llama behind the embedded tokenizer answers (conftest's ``tiny_smol``), served by
uvicorn on 127.0.0.1 in a thread of this process, so a test can hold the first request's first pass
on an event it controls (``hold_at``) while the others arrive: what it checks is counted (requests
admitted, callers waiting, passes and sequences fed), never timed.
"""

from __future__ import annotations

import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from test_serve_errors import _served, _wait_for, hold_at  # a server in a thread, bounded waits, a held pass

from agentspec.serve import create_app

URL = "/v1/chat/completions"
WAIT_S = 60.0  # a bound on waits for other threads, never reached when the test passes
TOPICS = ["a lighthouse", "bread", "the moon", "a small red fox", "rain", "trains", "an old map", "tea"]


def _salt() -> str:
    return uuid.uuid4().hex  # a namespace of its own: nothing cached for it


def _body(i: int, **options) -> dict:
    # prompts of different lengths, so the sequences sharing a pass differ
    content = f"Tell me about {TOPICS[i]}." + " Please." * i
    messages = [{"role": "user", "content": content}]
    return {"messages": messages, "max_tokens": 10, "temperature": 0, "cache_salt": _salt(), **options}


def _post(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{URL}", json=body, headers=headers, timeout=WAIT_S)


def _metric(text: str, name: str) -> float:
    (value,) = re.findall(rf'^{re.escape(name)}{{model_name="tiny-smol"}} (\S+)$', text, re.M)
    return float(value)


def _scrape(url: str, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/metrics", headers=headers, timeout=WAIT_S).text


def test_eight_requests_share_passes_and_reply_as_each_would_alone(tiny_smol, monkeypatch):
    """The first request's first pass waits until the seven others wait to join; then all eight
    decode together, and each reply equals that request's reply sent alone."""
    app = create_app(tiny_smol)
    stats = tiny_smol.scheduler.stats
    reached, release = threading.Event(), threading.Event()
    with _served(app) as url:
        alone = [_post(url, _body(i)).json()["choices"][0]["message"]["content"] for i in range(8)]
        before = _scrape(url)
        hold_at(monkeypatch, tiny_smol.target, 0, reached, release)
        with ThreadPoolExecutor(8) as pool:
            try:
                first = pool.submit(_post, url, _body(0))
                assert reached.wait(WAIT_S), "the first request's first pass never ran"
                others = [pool.submit(_post, url, _body(i)) for i in range(1, 8)]
                _wait_for(lambda: stats.waiting == 7, "the seven others to wait to join")
                held = _scrape(url)
            finally:
                release.set()  # never leave the pass waiting, whatever failed
            replies = [f.result() for f in [first, *others]]
        after = _scrape(url)
    # vLLM's gauges while the first pass was held: one sequence in it, seven callers waiting
    assert _metric(held, "vllm:num_requests_running") == 1
    assert _metric(held, "vllm:num_requests_waiting") == 7
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    together = [r.json()["choices"][0]["message"]["content"] for r in replies]
    assert together == alone
    passes, sequences = (
        _metric(after, name) - _metric(before, name)
        for name in ("agentspec_scheduler_passes_total", "agentspec_scheduler_pass_sequences_total")
    )
    assert sequences > passes > 0, f"{sequences=} {passes=}"  # more than one sequence per pass
    assert _metric(after, "vllm:num_requests_running") == _metric(after, "vllm:num_requests_waiting") == 0


def test_a_key_over_its_share_gets_429_while_the_other_key_is_served(tiny_smol, monkeypatch):
    """Three sequences, two keys: a share of ceil(3 / 2) = 2 each. Key A's first request is held in
    its first pass; A's second is admitted, its third gets 429; B's first is admitted (the server is
    full now), and B's second gets the full server's 503. Released, the three admitted ones answer."""
    app = create_app(tiny_smol, api_keys=["key-a", "key-b"], max_num_seqs=3)
    admission = app.state.server.admission
    reached, release = threading.Event(), threading.Event()
    hold_at(monkeypatch, tiny_smol.target, 0, reached, release)
    with _served(app) as url, ThreadPoolExecutor(3) as pool:
        try:
            admitted = [pool.submit(_post, url, _body(0), "key-a")]
            assert reached.wait(WAIT_S), "key A's first request never reached its first pass"
            admitted.append(pool.submit(_post, url, _body(1), "key-a"))
            _wait_for(lambda: admission.active == 2, "key A's second request to be admitted")
            over = _post(url, _body(2), "key-a")
            admitted.append(pool.submit(_post, url, _body(3), "key-b"))
            _wait_for(lambda: admission.active == 3, "key B's request to be admitted")
            full = _post(url, _body(4), "key-b")
        finally:
            release.set()
        replies = [f.result() for f in admitted]
        metrics = _scrape(url, "key-b")
    assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
    error = over.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
    assert full.status_code == 503 and int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["code"] == "queue_full"
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert 'agentspec_requests_total{model_name="tiny-smol",status="429"} 1.0' in metrics
    # each slot was freed before its reply went out: a key at its share may send its next at once
    assert admission.active == 0 and admission.held == {}
