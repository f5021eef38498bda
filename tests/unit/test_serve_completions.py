"""The server's ``POST /v1/completions`` (OpenAI's legacy completions, as vLLM serves them), through the
app (FastAPI's TestClient) on a tiny random model behind the embedded tokenizer: a greedy completion is
``agentspec.generate``'s over the prompt's ids, its log-probabilities are the in-process call's in the
legacy shape, streamed or not; a prompt's n choices are its seeds' replies, a batch's prompts each
answered in turn; what the server cannot honour is a 400 with OpenAI's body."""

from __future__ import annotations

import pytest
from conftest import sse_events
from fastapi.testclient import TestClient

import agentspec
from agentspec.serve import create_app
from agentspec.serve import protocol as P

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The three primary colours are"
URL = "/v1/completions"


@pytest.fixture(scope="module")
def client(tiny_app):
    return tiny_app


def _post(client, **fields):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    return response.json() if not fields.get("stream") else sse_events(response.text)


def _ids(pair, text: str = PROMPT) -> list[int]:
    return pair.tokenizer(text)["input_ids"]


def test_a_greedy_completion_is_generates_over_the_prompts_ids(client, tiny_smol):
    here = agentspec.generate(tiny_smol, _ids(tiny_smol), max_new_tokens=8)
    reply = _post(client)
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    assert reply["model"] == "tiny-smol" and "speculative_decoding" in reply["metrics"]
    (choice,) = reply["choices"]
    assert choice == {"index": 0, "text": here.text, "logprobs": None, "finish_reason": "length"}
    usage = reply["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(_ids(tiny_smol)), 8)
    # the same prompt as token ids: the same reply
    assert _post(client, prompt=_ids(tiny_smol))["choices"] == [choice]
    # no max_tokens: OpenAI's and vLLM's 16
    default = _post(client, max_tokens=None)["choices"][0]
    longer = agentspec.generate(tiny_smol, _ids(tiny_smol), max_new_tokens=16)
    assert (default["text"], default["finish_reason"]) == (longer.text, "length")


def test_stop_and_echo(client, tiny_smol):
    whole = agentspec.generate(tiny_smol, _ids(tiny_smol), max_new_tokens=8).text
    stop = whole[len(whole) // 2 :][:3]  # a piece from the middle of the greedy text
    here = agentspec.generate(tiny_smol, _ids(tiny_smol), max_new_tokens=8, stop=(stop,))
    (choice,) = _post(client, stop=[stop])["choices"]
    assert (choice["text"], choice["finish_reason"]) == (here.text, "stop")
    assert stop not in choice["text"] and whole.startswith(choice["text"])
    echoed = _post(client, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + whole
    streamed = _post(client, echo=True, stream=True)
    assert "".join(c["text"] for e in streamed[:-1] for c in e["choices"]) == PROMPT + whole


def _expected(pair, k: int) -> dict:
    """The in-process call's log-probabilities in the legacy shape (``agentspec.stream``'s Steps)."""
    entries = [
        e for step in agentspec.stream(pair, _ids(pair), max_new_tokens=8, logprobs=k) for e in step.logprobs
    ]
    text = pair.tokenizer.decode
    tokens = [text([e.token]) for e in entries]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    top = [{text([e.token]): e.logprob} | {text([t]): lp for t, lp in e.top} for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _same_logprobs(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in want["top_logprobs"]]
    for got_top, want_top in zip(got["top_logprobs"], want["top_logprobs"]):
        assert got_top == pytest.approx(want_top, abs=1e-4)


def test_logprobs_have_the_legacy_shape_whole_and_streamed(client, tiny_smol):
    whole = _post(client, logprobs=2)
    (choice,) = whole["choices"]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(logprobs["tokens"]) == choice["text"] and len(logprobs["tokens"]) == 8
    # each token's own entry first, then its alternatives: k + 1 keys, or k where it is among them
    assert all(
        len(top) in (2, 3) and next(iter(top)) == token
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"])
    )
    _same_logprobs(logprobs, _expected(tiny_smol, 2))
    only = _post(client, logprobs=0)["choices"][0]["logprobs"]  # no alternatives: the token alone
    assert [list(top) for top in only["top_logprobs"]] == [[t] for t in logprobs["tokens"]]

    events = _post(client, logprobs=2, stream=True, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 8
    chunks = [c for e in events[:-2] for c in e["choices"]]
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events[:-1])
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "speculative_decoding" in events[-3]["metrics"]  # on the chunk that finishes the choice
    merged = {key: [v for c in chunks for v in c["logprobs"][key]] for key in logprobs}
    _same_logprobs(merged, logprobs)  # the offsets run on across chunks
    plain = _post(client, stream=True)
    assert all(c["logprobs"] is None for e in plain[:-1] for c in e["choices"])


def test_n_choices_are_their_seeds_replies_and_a_batch_answers_each_prompt(client, tiny_smol):
    fields = dict(temperature=1.0, seed=11, max_tokens=6)
    reply = _post(client, n=3, cache_salt="cmpl-n", **fields)
    texts = [c["text"] for c in reply["choices"]]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    usage = reply["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(_ids(tiny_smol)), 18)
    for j, text in enumerate(texts):
        alone = _post(client, cache_salt=f"cmpl-alone-{j}", **{**fields, "seed": 11 + j})
        assert alone["choices"][0]["text"] == text

    # a batch: prompt p's choice j is the response's choice p * n + j, each prompt counted once
    other = "Speculative decoding is"
    batch = _post(client, prompt=[PROMPT, other], n=3, cache_salt="cmpl-batch", **fields)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    assert [c["text"] for c in batch["choices"][:3]] == texts
    second = _post(client, prompt=other, n=3, cache_salt="cmpl-second", **fields)
    assert [c["text"] for c in batch["choices"][3:]] == [c["text"] for c in second["choices"]]
    usage = batch["usage"]
    assert usage["prompt_tokens"] == len(_ids(tiny_smol)) + len(_ids(tiny_smol, other))
    assert usage["completion_tokens"] == 36 and usage["prompt_tokens_details"]["cached_tokens"] == 0

    events = _post(
        client,
        prompt=[_ids(tiny_smol), _ids(tiny_smol, other)],
        n=3,
        stream=True,
        cache_salt="cmpl-stream",
        **fields,
    )
    streamed = [""] * 6
    for event in events[:-1]:
        for c in event["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == [c["text"] for c in batch["choices"]]


def test_what_the_server_cannot_honour_is_a_400(client, tiny_smol):
    vocab = tiny_smol.target.config.vocab_size
    bad = [
        ({"suffix": "!"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),  # the prompt's own log-probabilities are not computed
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, vocab]}, "prompt"),  # an id outside the vocabulary
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),  # strings and id lists are not mixed
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"model": "gpt-3.5-turbo-instruct"}, "model"),
    ]
    for fields, param in bad:
        response = client.post(URL, json={"prompt": PROMPT, **fields})
        error = response.json()["error"]
        assert response.status_code == (404 if param == "model" else 400), (fields, response.text)
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (fields, error)
    long = client.post(URL, json={"prompt": [1] * tiny_smol.max_context})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert (
        _post(client, best_of=1, suffix="", echo=False, user="u")["choices"][0]["finish_reason"] == "length"
    )


def test_a_batch_past_the_servers_sequences_is_a_400(tiny_smol):
    with TestClient(create_app(tiny_smol, max_num_seqs=2)) as small:
        response = small.post(URL, json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        response = small.post(URL, json={"prompt": "a", "max_tokens": 2, "n": 3})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_legacy_logprobs_of_chat_entries():
    def entry(token: str, logprob: float, *top: tuple[str, float]) -> dict:
        alternatives = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
        return {
            "token": token,
            "logprob": logprob,
            "bytes": list(token.encode()),
            "top_logprobs": alternatives,
        }

    content = [entry("Hi", -0.5, ("Hi", -0.5), ("Yo", -1.0)), entry(" there", -2.0, ("!", -0.1), ("?", -0.2))]
    assert P.text_logprobs(content, offset=4) == {
        "tokens": ["Hi", " there"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"Hi": -0.5, "Yo": -1.0}, {" there": -2.0, "!": -0.1, "?": -0.2}],
        "text_offset": [4, 6],  # from the offset, each token's text after the ones before it
    }
    assert P.text_logprobs([]) == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_a_completion_requests_prompts():
    def prompts(prompt) -> list:
        return P.CompletionRequest(prompt=prompt).prompts

    assert prompts("hi") == ["hi"] and prompts([1, 2]) == [[1, 2]] and prompts([]) == [[]]
    assert prompts(["a", "b"]) == ["a", "b"] and prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert P.CompletionRequest(prompt="hi").length_limit == P.DEFAULT_MAX_TOKENS == 16
