"""The server's logprobs and n choices, through the app (FastAPI's TestClient) on a tiny
random model behind the embedded tokenizer: log-probabilities are the target's log-softmax at the
emitted tokens (computed here with transformers directly), streamed or not; a request's n choices
share one prefill, and choice i of a seeded request is the reply that seed + i gives alone."""

from __future__ import annotations

import pytest
import torch
from conftest import sse_events
from fastapi.testclient import TestClient

from agentspec.chat import prepare
from agentspec.serve import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "user", "content": "Count from one to ten, in words."}]


@pytest.fixture(scope="module")
def client(tiny_app):
    return tiny_app


def _post(client, **fields) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json() if not fields.get("stream") else sse_events(response.text)


@torch.inference_mode()
def _reference(pair, entries: list[dict]) -> None:
    """``entries`` against the target's log-softmax after the prompt, token by token."""
    prompt = prepare(pair.tokenizer, MESSAGES).prompt.ids
    out = _ids(pair, prompt, len(entries))
    logits = pair.target(input_ids=torch.tensor([prompt + out])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(out)]
    for i, (token, entry) in enumerate(zip(out, entries)):
        assert entry["token"] == pair.tokenizer.decode([token])
        assert entry["logprob"] == pytest.approx(ref[i, token].item(), abs=1e-4)
        top = ref[i].topk(3)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t["token"] for t in entry["top_logprobs"]] == [
            pair.tokenizer.decode([t]) for t in top.indices
        ]


def _ids(pair, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, one uncached forward per token."""
    out: list[int] = []
    for _ in range(n):
        logits = pair.target(input_ids=torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


def test_logprobs_are_the_targets_whole_and_streamed(client, tiny_smol):
    whole = _post(client, logprobs=True, top_logprobs=3)
    (choice,) = whole["choices"]
    entries = choice["logprobs"]["content"]
    assert len(entries) == whole["usage"]["completion_tokens"] == 12 and choice["logprobs"]["refusal"] is None
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    _reference(tiny_smol, entries)
    events = _post(client, logprobs=True, top_logprobs=3, stream=True)
    streamed = [
        e for ev in events[:-1] for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]
    ]
    # the same tokens, each logprob to float32 rounding: a float32 pass's rows need not be bit-equal to
    # another pass's over other drafts (the second request drafts from the first's reply), so the
    # logits' last bits follow the pass's row count on some CPUs (an AMD EPYC: 1e-6 apart)
    assert [_tokens(e) for e in streamed] == [_tokens(e) for e in entries]
    assert _logprobs(streamed) == pytest.approx(_logprobs(entries), abs=1e-5)
    plain = _post(client)
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"] == choice["message"]  # asking for them changes no token


def _tokens(entry: dict) -> list[str]:
    return [entry["token"], *(t["token"] for t in entry["top_logprobs"])]


def _logprobs(entries: list[dict]) -> list[float]:
    """Every logprob of ``entries``, the emitted token's and its top ones', in order."""
    return [x for e in entries for x in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]


def test_n_choices_share_a_prefill_and_each_is_its_seeds_reply(client):
    fields = dict(temperature=1.0, seed=11, max_tokens=10, cache_salt="n-choices")
    reply = _post(client, n=3, **fields)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert (
        reply["usage"]["completion_tokens"] == 30
        and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    )
    assert reply["metrics"]["agentspec"]["prefill_tokens"] == 1  # the prompt came from the one prefill
    texts = [c["message"]["content"] for c in reply["choices"]]
    assert len(set(texts)) > 1  # sampled choices differ
    assert [c["message"]["content"] for c in _post(client, n=3, **fields)["choices"]] == texts  # seeded
    for i, text in enumerate(texts):
        alone = _post(client, **{**fields, "seed": 11 + i, "cache_salt": f"alone-{i}"})
        assert alone["choices"][0]["message"]["content"] == text
    events = _post(client, n=3, stream=True, stream_options={"include_usage": True}, **fields)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 30
    streamed = ["", "", ""]
    finished = set()
    for event in events[:-2]:
        for c in event["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"] is not None:
                finished.add(c["index"])
    assert streamed == texts and finished == {0, 1, 2}


def test_n_past_the_servers_sequences_is_a_400(tiny_smol):
    with TestClient(create_app(tiny_smol, max_num_seqs=2)) as small:
        body = {"messages": MESSAGES, "max_tokens": 2, "n": 3}
        response = small.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        bad = small.post("/v1/chat/completions", json={**body, "n": 1, "top_logprobs": 2})
        assert bad.status_code == 400 and "top_logprobs needs logprobs" in bad.json()["error"]["message"]
