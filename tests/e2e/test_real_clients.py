"""``agentspec serve`` driven by the clients people point at an OpenAI-compatible URL: the ``openai``
package and langchain-openai's ``ChatOpenAI``.

One server process for the module (``agentspec serve`` on 127.0.0.1, one torch thread, one API key),
started before the tests and always stopped after them, as in ``test_serve.py``. Every greedy reply
(temperature 0) is compared with ``ChatSpecDecode``'s in this process for the same messages, tools
and structured-output method: the server and the chat model share one request layer, so they agree
token for token; a greedy ``/v1/completions`` is ``agentspec.stream``'s over the prompt's ids, its
log-probabilities included. vLLM's ``/tokenize`` and ``/detokenize`` are read through the openai client's
low-level ``post``, their counts checked against the chat route's usage for the same conversation.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from langchain_core.tools import tool
from pydantic import BaseModel

import agentspec
from agentspec.chat import prepare
from agentspec.fleet.process import ServerProcess, agentspec_serve_command, checkout_env, free_port

openai = pytest.importorskip("openai", reason="the openai client (a dev dependency) is not installed")
langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai (dev) is not installed")

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

KEY = "real-clients-key"
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 300.0  # imports and the model load; about 15 s on an idle 2-core machine
CALL_TIMEOUT_S = 120.0
MAX_TOKENS = 12  # short replies: each side decodes every one
CALL_TOKENS = 40  # room for a whole tool call or JSON answer

GREETING = [("system", "You are terse."), ("human", "Name three colours.")]
CAPITAL = "Which city is the capital of France? Answer in JSON with the key city."


@tool
def square(x: int) -> int:
    """Square an integer."""
    return x * x


class Answer(BaseModel):
    """The answer to a question about a place."""

    city: str


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The base URL of a running ``agentspec serve`` (stopped, and killed if need be, afterwards)."""
    port = free_port()
    command = agentspec_serve_command(port, "--threads", "1", "--max-num-seqs", "4", "--api-key", KEY)
    command += ["--log-level", "warning"]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServerProcess(
        command, port, env=checkout_env(), log=log, startup_timeout_s=STARTUP_TIMEOUT_S
    ) as process:
        yield process.url


@pytest.fixture(scope="module")
def local():
    """The in-process pair whose replies the server's must equal."""
    return agentspec.load_pair()


def _chat_openai(server: str, max_tokens: int = MAX_TOKENS, **options):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{server}/v1",
        api_key=KEY,
        model=MODEL,  # another name is a 404, as in vLLM
        max_tokens=max_tokens,
        max_retries=0,
        timeout=CALL_TIMEOUT_S,
        **{"temperature": 0, **options},
    )


def _spec_decode(local, max_tokens: int = MAX_TOKENS):
    from langchain_agentspec import ChatSpecDecode

    return ChatSpecDecode(pair=local, max_tokens=max_tokens)  # greedy by default


def _client(base_url: str) -> openai.OpenAI:
    # no retries: an error must reach the test as it was sent
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=CALL_TIMEOUT_S)


def test_chat_openai_invoke_and_stream_equal_in_process(server, local):
    here = _spec_decode(local).invoke(GREETING)
    remote = _chat_openai(server).invoke(GREETING)
    assert remote.content == here.content
    assert remote.response_metadata["finish_reason"] == here.response_metadata["finish_reason"]
    for side in ("input_tokens", "output_tokens"):
        assert remote.usage_metadata[side] == here.usage_metadata[side], side

    chunks = list(_chat_openai(server, stream_usage=True).stream(GREETING))
    assert "".join(c.content for c in chunks) == here.content
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert [u["output_tokens"] for u in usage] == [here.usage_metadata["output_tokens"]]


def _calls(message) -> list[tuple[str, dict]]:
    return [(c["name"], c["args"]) for c in message.tool_calls]


def test_chat_openai_tool_calls_forced_and_auto_equal_in_process(server, local):
    forced = [("human", "Square 7.")]
    remote = _chat_openai(server, CALL_TOKENS).bind_tools([square], tool_choice="square").invoke(forced)
    here = _spec_decode(local, CALL_TOKENS).bind_tools([square], tool_choice="square").invoke(forced)
    assert _calls(remote) == _calls(here) and _calls(here)[0][0] == "square"
    assert remote.response_metadata["finish_reason"] == "tool_calls"

    # auto: the model may answer or call; whichever it does, it does on both sides
    auto = [("human", "What is 12 squared? Use the tool if it helps.")]
    remote = _chat_openai(server, CALL_TOKENS).bind_tools([square]).invoke(auto)
    here = _spec_decode(local, CALL_TOKENS).bind_tools([square]).invoke(auto)
    assert (remote.content, _calls(remote)) == (here.content, _calls(here))


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_chat_openai_structured_output_equals_in_process(server, local, method):
    schema = None if method == "json_mode" else Answer  # json_mode: any JSON object the prompt asks for
    remote = _chat_openai(server, CALL_TOKENS).with_structured_output(schema, method=method).invoke(CAPITAL)
    here = _spec_decode(local, CALL_TOKENS).with_structured_output(schema, method=method).invoke(CAPITAL)
    assert remote == here
    assert isinstance(remote, Answer if schema else dict)


def test_openai_client_chat_and_stream_equal_in_process(server, local):
    messages = [{"role": "user", "content": "Say hello to Ada."}]
    here = _spec_decode(local).invoke(messages)
    client = _client(f"{server}/v1")
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS
    )
    assert whole.choices[0].message.content == here.content
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == here.content


def test_openai_client_completions_equal_in_process(server, local):
    prompt = "The capital of France is"
    ids = local.tokenizer(prompt)["input_ids"]
    steps = list(agentspec.stream(local, ids, max_new_tokens=MAX_TOKENS, logprobs=2))  # greedy
    here = [e for step in steps for e in step.logprobs if e.token not in local.eos_token_ids]
    text = "".join(step.text for step in steps)
    client = _client(f"{server}/v1")
    ask = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    whole = client.completions.create(**ask)
    (choice,) = whole.choices
    assert whole.object == "text_completion" and choice.text == text
    assert choice.finish_reason == steps[-1].finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        len(ids),
        steps[-1].stats.output_tokens,
    )
    logprobs = choice.logprobs
    assert logprobs.tokens == [local.tokenizer.decode([e.token]) for e in here]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in here], abs=1e-3)
    assert [next(iter(top)) for top in logprobs.top_logprobs] == logprobs.tokens  # each token first

    chunks = [c for chunk in client.completions.create(**ask, stream=True) for c in chunk.choices]
    assert "".join(c.text for c in chunks) == text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == logprobs.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == logprobs.text_offset


def _tokenize(client: openai.OpenAI, **body) -> dict:
    # vLLM's routes sit beside /v1, not under it: the client's base URL is the server's root
    return client.post("/tokenize", body={"model": MODEL, **body}, cast_to=object)


def _detokenize(client: openai.OpenAI, tokens: list[int]) -> str:
    return client.post("/detokenize", body={"model": MODEL, "tokens": tokens}, cast_to=object)["prompt"]


def test_tokenize_a_conversation_as_the_chat_route_renders_it(server, local):
    tools = [{"type": "function", "function": {"name": "square", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Square 3."}]
    root = _client(server)
    counted = _tokenize(root, messages=messages, tools=tools)
    reply = _client(f"{server}/v1").chat.completions.create(
        model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=1
    )
    assert counted["count"] == len(counted["tokens"]) == reply.usage.prompt_tokens
    prompt = prepare(local.tokenizer, messages, tools).prompt  # the chat model's rendering, in process
    assert counted["tokens"] == prompt.ids
    assert _detokenize(root, counted["tokens"]) == prompt.text
    assert counted["max_model_len"] == local.max_context and counted["token_strs"] is None


def test_tokenize_and_detokenize_a_prompt(server, local):
    root = _client(server)
    text = "Speculative decoding, token by token."
    counted = _tokenize(root, prompt=text, return_token_strs=True)
    assert counted["tokens"] == local.tokenizer(text)["input_ids"]
    assert counted["token_strs"] == local.tokenizer.convert_ids_to_tokens(counted["tokens"])
    assert _detokenize(root, counted["tokens"]) == text
    assert _detokenize(root, []) == ""


def test_tokenize_errors_are_openai_bodies(server, local):
    root = _client(server)
    with pytest.raises(openai.NotFoundError) as err:
        root.post("/tokenize", body={"model": "gpt-4o", "prompt": "hi"}, cast_to=object)
    assert err.value.body["code"] == "model_not_found"
    vocab = max(len(local.tokenizer), local.target.config.vocab_size)
    assert isinstance(_detokenize(root, [vocab - 1]), str)  # the last id is in it
    hi = [{"role": "user", "content": "hi"}]
    bad = [
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [1, vocab]}, "tokens"),  # one past the last id
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, "prompt"),  # neither a prompt nor messages
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": hi, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": hi, "chat_template": "{{ messages }}"}, "chat_template"),
    ]
    for path, body, param in bad:  # each refused as sent, with the field it names
        with pytest.raises(openai.BadRequestError) as err:
            root.post(path, body=body, cast_to=object)
        assert err.value.status_code == 400, (path, body)  # never FastAPI's 422
        error = err.value.body
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, (path, body, error)
    unauthorised = httpx.post(f"{server}/tokenize", json={"prompt": "hi"}, timeout=CALL_TIMEOUT_S)
    assert unauthorised.status_code == 401


def test_x_request_id_is_echoed_or_made(server):
    client = _client(f"{server}/v1")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 2}
    given = uuid.uuid4().hex
    reply = client.chat.completions.create(**ask, extra_headers={"X-Request-Id": given})
    assert reply._request_id == given  # the openai client reads the header into its responses
    made = [client.chat.completions.create(**ask)._request_id for _ in range(2)]
    assert made[0] != made[1] and all(len(m) == 32 and set(m) <= set("0123456789abcdef") for m in made)

    auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": given}
    url = f"{server}/v1/chat/completions"
    streamed = {**ask, "stream": True}
    with httpx.stream("POST", url, json=streamed, headers=auth, timeout=CALL_TIMEOUT_S) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert stream.headers["X-Request-Id"] == given
    assert events[-1] == "data: [DONE]" and json.loads(events[0][len("data: ") :])["choices"]
    refused = httpx.post(url, json={"messages": []}, headers=auth)
    assert refused.status_code == 400 and refused.headers["X-Request-Id"] == given
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        answered = httpx.post(f"{server}{path}", json=body, headers=auth)
        assert answered.status_code == 200 and answered.headers["X-Request-Id"] == given
    assert httpx.get(f"{server}/health", headers={"X-Request-Id": given}).headers["X-Request-Id"] == given


def _entries(content: list[dict]) -> list[tuple[str, float, list[str]]]:
    return [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in content]


def _same_logprobs(got: list[dict], want: list[dict]) -> None:
    assert [(t, top) for t, _, top in _entries(got)] == [(t, top) for t, _, top in _entries(want)]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)


def test_logprobs_through_chat_openai_and_the_openai_client_equal_in_process(server, local):
    from langchain_agentspec import ChatSpecDecode

    here = ChatSpecDecode(pair=local, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3).invoke(GREETING)
    want = here.response_metadata["logprobs"]["content"]
    assert len(want) == here.usage_metadata["output_tokens"] - (
        here.response_metadata["finish_reason"] == "stop"
    )
    remote = _chat_openai(server, logprobs=True, top_logprobs=3).invoke(GREETING)
    assert remote.content == here.content
    _same_logprobs(remote.response_metadata["logprobs"]["content"], want)
    ours = ChatSpecDecode(
        base_url=f"{server}/v1", api_key=KEY, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3
    )
    _same_logprobs(ours.invoke(GREETING).response_metadata["logprobs"]["content"], want)
    streamed = [c.response_metadata.get("logprobs", {}).get("content", []) for c in ours.stream(GREETING)]
    _same_logprobs([e for part in streamed for e in part], want)

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ]
    stream = _client(f"{server}/v1").chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3,
        stream=True,
    )  # fmt: skip
    streamed = [
        e.model_dump() for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content
    ]
    _same_logprobs(streamed, want)


def test_n_choices_through_the_openai_client_and_chat_openai(server):
    client = _client(f"{server}/v1")
    messages = [{"role": "user", "content": "Write a word."}]
    options = dict(model=MODEL, messages=messages, temperature=1.0, max_tokens=MAX_TOKENS, seed=5)
    reply = client.chat.completions.create(n=3, **options)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == sum(
        client.chat.completions.create(**{**options, "seed": 5 + i}).usage.completion_tokens for i in range(3)
    )
    for i, text in enumerate(texts):  # choice i is the reply of seed + i alone
        assert client.chat.completions.create(**{**options, "seed": 5 + i}).choices[0].message.content == text
    from langchain_core.messages import HumanMessage

    result = _chat_openai(server, n=3, temperature=1.0, seed=5).generate([[HumanMessage("Write a word.")]])
    assert [g.message.content for g in result.generations[0]] == texts


def test_a_seeded_sampled_reply_is_the_same_in_process_and_over_http(server, local):
    """Seeded draws are keyed by position on both sides: the sample does not depend on what either
    side's drafters learned or caches hold."""
    from langchain_agentspec import ChatSpecDecode

    here = ChatSpecDecode(pair=local, max_tokens=MAX_TOKENS, temperature=0.9, seed=11).invoke(GREETING)
    assert _chat_openai(server, temperature=0.9, seed=11).invoke(GREETING).content == here.content
