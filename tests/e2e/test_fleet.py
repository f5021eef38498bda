"""The fleet end to end: 2 ``agentspec serve`` workers behind vllm-router, driven by the ``openai`` client.

One fleet for the module (``agentspec.fleet.Fleet``: two workers of one torch thread each, pinned to
one CPU each, consistent hashing on ``X-Session-ID``), started before the tests and always stopped
after them. A fault-free pass of four sessions (three turns each, the model's own replies fed
back, all sessions at once turn by turn) gives the placement and the reference replies; then the
same sessions run again and the worker holding the most sessions is killed after their first turn.
The CLI test starts ``agentspec fleet`` of one worker and stops it with SIGTERM.
"""

from __future__ import annotations

import re
import shutil
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agentspec.fleet import Fleet
from agentspec.fleet.process import ServerProcess, checkout_env, free_port, healthy
from agentspec.fleet.router import router_binary
from agentspec.fleet.workers import cpu_shares, pinned

openai = pytest.importorskip("openai", reason="the openai client (a dev dependency) is not installed")

needs_router = pytest.mark.skipif(
    router_binary() is None,
    reason="vllm-router is not installed: agentspec-decode's dev extra brings it (docs/install.md)",
)

MODEL = "SmolLM2-135M-Instruct"
CALL_TIMEOUT_S = 120.0
ATTEMPTS = 5  # the client's own retries on a 5xx, as an agent's client would make them
SYSTEM = (
    "You are the order desk of a small shop. Answer in one short sentence. Quote names and order "
    "numbers exactly as the customer gave them."
)
CUSTOMERS = (("Ada", "A-1001"), ("Grace", "G-2002"), ("Linus", "L-3003"), ("Barbara", "B-4004"))
QUESTIONS = (
    "Hello, I am {name} and my order is {order}. Please greet me.",
    "Which order number did I give you?",
    "And what is my name?",
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if router_binary() is None:
        pytest.skip("vllm-router is not installed: agentspec-decode's dev extra brings it (docs/install.md)")
    log_dir = tmp_path_factory.mktemp("fleet")
    with Fleet(2, threads_per_worker=1, worker_options=["--log-level", "warning"], log_dir=log_dir) as f:
        yield f


def _ask(client, session: str, messages: list[dict]) -> tuple[object, int]:
    """One call under ``session``, retried on 5xx and refused connections; the reply and the number of
    failed attempts before it."""
    for failures in range(ATTEMPTS):
        try:
            r = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                temperature=0,
                max_tokens=16,
                extra_headers={"X-Session-ID": session},
            )
            return r, failures
        except (openai.InternalServerError, openai.APIConnectionError):
            time.sleep(0.5)
    raise AssertionError(f"{session}: no answer after {ATTEMPTS} attempts")


class Session:
    """A conversation under one id: its history grows by the model's own replies."""

    def __init__(self, i: int, client):
        name, order = CUSTOMERS[i]
        self.id, self.client = f"session-{name.lower()}", client
        self.questions = [q.format(name=name, order=order) for q in QUESTIONS]
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.turns: list[dict] = []

    def turn(self, n: int) -> None:
        self.messages.append({"role": "user", "content": self.questions[n]})
        r, failures = _ask(self.client, self.id, self.messages)
        reply = r.choices[0].message.content
        self.messages.append({"role": "assistant", "content": reply})
        details = r.usage.prompt_tokens_details
        self.turns.append(
            {
                "reply": reply,
                "prompt": r.usage.prompt_tokens,
                "cached": details.cached_tokens if details is not None else 0,
                "failures": failures,
            }
        )


def _sessions(fleet: Fleet) -> list[Session]:
    client = openai.OpenAI(
        base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    return [Session(i, client) for i in range(len(CUSTOMERS))]


def _run_turn(sessions: list[Session], n: int) -> None:
    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(lambda s: s.turn(n), sessions))  # list(): a failed turn raises here


def _placement(choices: list[tuple[str, str]]) -> dict[str, list[str]]:
    placed: dict[str, list[str]] = {}
    for session, worker in choices:
        placed.setdefault(session, []).append(worker)
    return placed


def _served(url: str) -> int:
    """Requests a worker answered with 200, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        int(float(v)) for v in re.findall(r'agentspec_requests_total\{[^}]*status="200"[^}]*\} (\S+)', text)
    )


@pytest.fixture(scope="module")
def fault_free(fleet):
    """The fault-free pass: its sessions and where the router sent each one."""
    sessions = _sessions(fleet)
    for n in range(len(QUESTIONS)):
        _run_turn(sessions, n)
    return sessions, _placement(fleet.session_choices())


def test_cpu_shares_split_the_cpus_evenly():
    assert cpu_shares(2, [0, 1]) == [(0,), (1,)]
    assert cpu_shares(2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    assert cpu_shares(3, [4, 5]) == [(4,), (5,), (4,)]  # more workers than CPUs: shared in turn
    assert cpu_shares(1, [0, 1]) == [(0, 1)]
    taskset = shutil.which("taskset")
    assert pinned(["x"], (0, 1)) == ([taskset, "-c", "0,1", "x"] if taskset else ["x"])


@needs_router
def test_each_session_stays_on_one_worker_and_reads_its_cache(fleet, fault_free):
    sessions, placed = fault_free
    report = {s.id: sorted(set(placed.get(s.id, []))) for s in sessions}
    print(f"placement: {report}")
    for s in sessions:
        assert len(placed.get(s.id, [])) == len(QUESTIONS) and len(report[s.id]) == 1, f"{report=}"
        assert s.turns[0]["failures"] == 0, f"{s.id}: {s.turns=}"
        for before, after in zip(s.turns, s.turns[1:]):
            # the whole earlier prompt comes from the cache: the session's own worker holds it
            assert after["cached"] >= before["prompt"], f"{s.id} on {report[s.id]}: {s.turns=}"
    by_worker = Counter(w for ws in report.values() for w in ws)
    served = {url: _served(url) for url in fleet.workers}
    expected = {url: by_worker[url] * len(QUESTIONS) for url in fleet.workers}
    assert served == expected, f"requests answered by each worker {served=}, by the router's log {expected=}"


@needs_router
def test_the_demo_agent_runs_unchanged_against_the_fleet(fleet, fault_free):
    """The demo's create_agent agent on ``ChatSpecDecode(base_url=<the router>)``: the same answers as
    in process, each LangGraph thread (its id sent as X-Session-ID) on one worker, reading its cache."""
    import agentspec
    from examples import agent_demo as demo
    from langchain_agentspec import ChatSpecDecode

    tasks = demo.TASKS[:2]
    start = len(fleet.session_choices())
    remote = ChatSpecDecode(
        base_url=f"{fleet.url}/v1", api_key="unused", max_tokens=64, timeout=CALL_TIMEOUT_S
    )
    _, states, meter = demo.run(remote, "fleet", tasks)
    local = ChatSpecDecode(pair=agentspec.load_pair(), max_tokens=64)
    _, states_local, _ = demo.run(local, "local", tasks)
    assert [demo.replies(s) for s in states] == [demo.replies(s) for s in states_local]
    for (_, subject), state in zip(tasks, states):
        ok, verdict = demo.check(subject, state)
        assert ok, verdict
    placed = _placement(fleet.session_choices()[start:])
    print(f"demo placement: { {k: sorted(set(v)) for k, v in placed.items()} }")
    for i in range(len(tasks)):
        workers = placed.get(f"fleet-{i + 1}", [])
        assert len(workers) == 2 and len(set(workers)) == 1, f"thread fleet-{i + 1}: {placed=}"
    assert meter.calls[1]["cached"] > 0  # the answer's call reads the tool call's prompt on its worker


@needs_router
def test_a_killed_worker_costs_only_cache_misses(fleet, fault_free):
    reference, placed = fault_free
    home = {s.id: placed[s.id][0] for s in reference}
    victim = Counter(home.values()).most_common(1)[0][0]
    survivor = next(url for url in fleet.workers if url != victim)
    sessions = _sessions(fleet)
    _run_turn(sessions, 0)
    fleet.stop_worker(fleet.workers.index(victim), kill=True)
    start = len(fleet.session_choices())
    for n in range(1, len(QUESTIONS)):
        _run_turn(sessions, n)
    after = _placement(fleet.session_choices()[start:])
    moved = [s for s in sessions if home[s.id] == victim]
    report = {
        "killed": victim,
        "moved": [s.id for s in moved],
        "after the kill": {sid: sorted(set(ws)) for sid, ws in after.items()},
        "failed attempts": {s.id: [t["failures"] for t in s.turns] for s in sessions},
    }
    print(f"fault run: {report}")
    for s, ref in zip(sessions, reference):
        assert [t["reply"] for t in s.turns] == [t["reply"] for t in ref.turns], f"{s.id}: {report=}"
        assert after[s.id][-1] == survivor, f"{s.id} was last sent to {after[s.id][-1]}: {report=}"
    for s, ref in zip(sessions, reference):
        if s in moved:  # its first turn on the survivor had none of its history cached there
            assert s.turns[1]["cached"] < ref.turns[1]["cached"], f"{s.id}: {s.turns=} {ref.turns=}"


@needs_router
def test_the_cli_verb_serves_and_stops_its_workers_on_sigterm(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "agentspec.cli", "fleet", "--workers", "1", "--port", str(port)]
    command += ["--threads-per-worker", "1", "--log-dir", str(tmp_path)]
    with ServerProcess(command, port, env=checkout_env(), log=tmp_path / "cli.log") as cli:
        client = openai.OpenAI(
            base_url=f"{cli.url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
        )
        r, _ = _ask(client, "cli-session", [{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content, r
        worker = re.search(r"worker (http://127\.0\.0\.1:\d+) on CPUs", cli.log_tail()).group(1)
        assert healthy(worker)
        cli.process.send_signal(signal.SIGTERM)
        assert cli.process.wait(timeout=60) == 0, cli.log_tail()
    assert not healthy(worker) and not healthy(cli.url), cli.log_tail()
