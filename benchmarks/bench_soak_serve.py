"""Soak under concurrency: many clients for minutes against one ``agentspec serve`` (issue 28, item 9).

Run from the repository root, with the machine to itself (16 clients for 10 minutes, after about 2
minutes of start-up and solo replies on 2 CPU cores):

    python -m benchmarks.bench_soak_serve [--clients 16] [--duration-s 600] [--max-tokens 16]
        [--seed 0] [--traces a,b] [--kinds a,b] [--out benchmarks/results/soak_serve.json]

``--clients 2 --duration-s 60 --traces inventory_headset --out /tmp/soak_serve.json`` checks that it
runs (its figures mean nothing).

One ``agentspec serve`` on every CPU serves the embedded pair (``bench_fleet``'s ``single`` worker,
``agentspec_worker``), admitting twice as many sequences as there are clients: a request a client
abandoned holds its slot until its pass ends, while that client already sends its next one, and the
soak looks for errors, not for admission's 503. First every distinct turn (each assistant turn of
the recorded agent traces, ``agent_traces.py``, as ``bench_serve``'s OpenAI messages; greedy,
``--max-tokens``) goes to the server alone, one after another, under a cache salt of its own: the
solo replies. Then ``--clients`` threads, for ``--duration-s``, each loop over calls drawn (seeded per
client) from ``KINDS``:

- ``chat`` / ``chat_stream``: a turn, whole or streamed (``openai`` client), under the soak's salt;
- ``bad_json``, ``bad_model``, ``too_long``, ``bad_tools``: a request that must get its 4xx with
  OpenAI's error body (malformed JSON through ``httpx``; an unknown model, a prompt past the
  context, a malformed tool schema through the ``openai`` client);
- ``stream_disconnect``: a streamed turn whose client closes the connection after its first chunks;
- ``whole_disconnect``: a whole turn whose socket closes before the reply (a raw socket);
- ``timeout``: a whole turn under a client timeout of 0.05-0.5 s: the client gives up.

``--kinds`` draws from some kinds only. Every call's outcome is recorded (an HTTP status, or
"timeout" / "closed" where none came); one outside its kind's ``EXPECTED``, or a 4xx without
OpenAI's error body, is an unexpected error. A client told to retry (``Retry-After``) waits that
long first. Every reply that completes is compared with its solo reply (whole: the message's
content; streamed: the deltas joined). Every ``--sample-s``: the server's resident memory (VmRSS of
its process), /health, and from /metrics the running and waiting sequences and the scheduler's
passes, sequences and rows fed. Afterwards: the sequences still running once every client has
returned (after ``SETTLE_S``; none should be), /health, one turn again, and the tracebacks in the
server's log.

The summary: calls and outcomes per kind, expected errors per kind, unexpected errors (the goal:
none), resident memory in the first and last ``--window-s`` and its slope over the second half
(memory flat), replies equal to solo (the goal: all), sequences and rows per pass, the longest time
with sequences running and no pass, wall time. Writes JSON (--out) and a PNG next to it: resident
memory and running sequences over time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import httpx  # noqa: E402
import openai  # noqa: E402

import agentspec  # noqa: E402
from agentspec.bench.run import environment  # noqa: E402
from agentspec.fleet.workers import agentspec_worker, cpu_shares  # noqa: E402
from benchmarks.agent_traces import TRACES, calls  # noqa: E402
from benchmarks.bench_fleet import CALL_TIMEOUT_S  # noqa: E402
from benchmarks.bench_serve import openai_messages  # noqa: E402
from benchmarks.bench_soak import slope  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
URL_PATH = "/v1/chat/completions"
KINDS = {  # kind: its weight in each client's draws
    "chat": 33,
    "chat_stream": 33,
    "bad_json": 3,
    "bad_model": 3,
    "too_long": 3,
    "bad_tools": 3,
    "stream_disconnect": 6,
    "whole_disconnect": 6,
    "timeout": 10,
}
EXPECTED: dict[str, set[int | str]] = {  # kind: the outcomes it may have
    "chat": {200},
    "chat_stream": {200},
    "bad_json": {400},
    "bad_model": {404},
    "too_long": {400},
    "bad_tools": {400},
    "stream_disconnect": {200},  # the status line came before the client left
    "whole_disconnect": {"closed"},
    "timeout": {"timeout", 200},  # a reply faster than the client's patience is a reply
}
# a tool whose parameters are not a JSON schema (properties must be an object)
BAD_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"properties": "sku"}}}]
SETTLE_S = 10.0  # after the soak: time for abandoned requests' passes to end before counting them
SCRAPED = {  # sample field: the /metrics family it reads
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "passes": "agentspec_scheduler_passes_total",
    "sequences": "agentspec_scheduler_pass_sequences_total",
    "rows": "agentspec_scheduler_pass_rows_total",
}


@dataclass
class Target:
    """What every client calls: the server, its model and context, the turns, the reply length."""

    url: str
    model: str
    max_context: int
    turns: list[tuple[str, list[dict]]]  # (key "trace/turn", the turn's OpenAI messages)
    max_tokens: int
    salt: str  # the soak's cache salt: the solo replies ran under another

    def request(self, messages: list[dict], **options: Any) -> dict[str, Any]:
        """The ``openai`` client's arguments for ``messages``, greedy, under the soak's salt."""
        return {
            "model": self.model,
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "extra_body": {"cache_salt": self.salt},
            **options,
        }

    def body(self, messages: list[dict], **options: Any) -> dict[str, Any]:
        """The same request as a JSON body, for the raw clients."""
        args = self.request(messages, **options)
        return {**{k: v for k, v in args.items() if k != "extra_body"}, **args["extra_body"]}


@dataclass
class Outcome:
    """What one call came to."""

    status: int | str  # the HTTP status, or "timeout" / "closed" where none came, "exception"
    text: str | None = None  # a completed reply's text
    code: str | None = None  # an error body's OpenAI code
    problem: str | None = None  # what was wrong, where something was (makes the call unexpected)
    retry_after: float | None = None  # the server's Retry-After (a full server's 503, a key's 429)


@dataclass
class Clients:
    """One soak client's connections: its ``openai`` client and its ``httpx`` client."""

    openai: openai.OpenAI
    http: httpx.Client
    rng: random.Random


def error_outcome(response: httpx.Response) -> Outcome:
    """A non-200 answer: its status, code and ``Retry-After``, and a problem where the body is not
    OpenAI's error or the status is not a 4xx."""
    status, body = response.status_code, _json(response)
    retry = response.headers.get("retry-after")
    retry_after = float(retry) if retry is not None else None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= error.keys():
        return Outcome(
            status, problem=f"not an OpenAI error body: {str(body)[:300]}", retry_after=retry_after
        )
    problem = None if 400 <= status < 500 else error["message"][:300]
    return Outcome(status, code=error["code"], problem=problem, retry_after=retry_after)


def guarded(call: Callable[..., Outcome], *args: Any) -> Outcome:
    """``call(*args)``, whatever it raises turned into its outcome (the soak records, never stops)."""
    try:
        return call(*args)
    except openai.APITimeoutError:  # before APIConnectionError, its base
        return Outcome("timeout")
    except openai.APIStatusError as exc:
        return error_outcome(exc.response)
    except Exception as exc:  # a stream's error event, a connection refused: all unexpected
        return Outcome("exception", problem=f"{type(exc).__name__}: {exc}"[:300])


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def whole(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    r = c.openai.chat.completions.create(**target.request(messages))
    return Outcome(200, text=r.choices[0].message.content or "")


def streamed(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    parts = []
    for chunk in c.openai.chat.completions.create(**target.request(messages, stream=True)):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
    return Outcome(200, text="".join(parts))


def bad_json(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    cut = json.dumps(target.body(messages))[:-7]  # the body's last characters lost: malformed
    r = c.http.post(f"{target.url}{URL_PATH}", content=cut, headers={"Content-Type": "application/json"})
    return error_outcome(r) if r.status_code != 200 else Outcome(200)


def refused(c: Clients, request: dict[str, Any]) -> Outcome:
    """A request that must be refused: an answer to it is the problem."""
    r = c.openai.chat.completions.create(**request)
    return Outcome(200, problem=f"answered: {r.choices[0].message}"[:300])


def bad_model(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    return refused(c, target.request(messages, model="no-such-model"))


def too_long(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    # two words a token at least: past the context however the words tokenize
    flood = [{"role": "user", "content": "lorem ipsum " * target.max_context}]
    return refused(c, target.request(flood))


def bad_tools(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    return refused(c, target.request(messages, tools=BAD_TOOLS))


def stream_disconnect(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    """A streamed turn left after 1-3 events: leaving the block closes the half-read connection."""
    keep = c.rng.randint(1, 3)
    with c.http.stream("POST", f"{target.url}{URL_PATH}", json=target.body(messages, stream=True)) as r:
        if r.status_code != 200:
            r.read()
            return error_outcome(r)
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for n, _ in enumerate(events, 1):
            if n == keep:
                break
    return Outcome(200)


def whole_disconnect(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    """A whole turn sent on a raw socket closed 0.05-1 s later, its reply never read."""
    data = json.dumps(target.body(messages)).encode()
    where = urlsplit(target.url)
    head = f"POST {URL_PATH} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((where.hostname, where.port), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(c.rng.uniform(0.05, 1.0))
    return Outcome("closed")


def timeout(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    patient = c.openai.with_options(timeout=c.rng.uniform(0.05, 0.5))
    return whole(Clients(patient, c.http, c.rng), target, messages)


CALLS: dict[str, Callable[[Clients, Target, list[dict]], Outcome]] = {
    "chat": whole,
    "chat_stream": streamed,
    "bad_json": bad_json,
    "bad_model": bad_model,
    "too_long": too_long,
    "bad_tools": bad_tools,
    "stream_disconnect": stream_disconnect,
    "whole_disconnect": whole_disconnect,
    "timeout": timeout,
}


@contextlib.contextmanager
def connections(target: Target, rng: random.Random) -> Iterator[Clients]:
    """A client's connections to ``target``, closed after the block."""
    with (
        openai.OpenAI(
            base_url=f"{target.url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
        ) as oa,
        httpx.Client(timeout=CALL_TIMEOUT_S) as http,
    ):
        yield Clients(oa, http, rng)


def record(
    client: int, kind: str, key: str, outcome: Outcome, solo: str, at_s: float, seconds: float
) -> dict:
    """A call's line in the results: its outcome, whether it was expected, its reply against solo."""
    same = None if outcome.text is None else outcome.text == solo
    return {
        "client": client,
        "kind": kind,
        "key": key,
        "t_s": round(at_s, 3),
        "seconds": round(seconds, 3),
        "status": outcome.status,
        "code": outcome.code,
        "unexpected": outcome.status not in EXPECTED[kind] or outcome.problem is not None,
        "problem": outcome.problem,
        "same_as_solo": same,
        **({"text": outcome.text, "solo": solo} if same is False else {}),
    }


def client(
    i: int, target: Target, solo: dict[str, str], mix: dict[str, int], seed: int, t0: float, until: float
) -> list[dict]:
    """Client ``i``: calls drawn from ``mix`` (kind: weight; its own seeded draws) one after another
    until ``until`` (monotonic); their records."""
    rng = random.Random(f"{seed}/{i}")  # a string seed: the same draws in every run
    kinds, weights, records = list(mix), list(mix.values()), []
    with connections(target, rng) as c:
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            key, messages = rng.choice(target.turns)
            start = time.monotonic()
            outcome = guarded(CALLS[kind], c, target, messages)
            records.append(record(i, kind, key, outcome, solo[key], start - t0, time.monotonic() - start))
            if outcome.retry_after is not None:  # as a polite client does: a full server is not flooded
                time.sleep(max(0.0, min(outcome.retry_after, until - time.monotonic())))
    return records


def solo_replies(target: Target) -> dict[str, str]:
    """Each distinct turn once, alone, one after another, under a salt of its own (so the soak reads
    nothing these left in the prefix cache): the reply every soak reply is held against."""
    alone = dataclasses.replace(target, salt=f"solo-{target.salt}")
    with connections(alone, random.Random(0)) as c:
        return {key: whole(c, alone, messages).text or "" for key, messages in target.turns}


def server_rss_mb(pid: int) -> float | None:
    """The server's resident memory now (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def scraped(text: str, family: str) -> float | None:
    """The value of ``family`` in a /metrics exposition (summed over its label sets)."""
    values = re.findall(rf"^{re.escape(family)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values) if values else None


def sample(url: str, pid: int, t0: float) -> dict[str, Any]:
    """The server now: resident memory, /health, and the scheduler's families from /metrics."""
    row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 2), "rss_mb": server_rss_mb(pid)}
    try:
        row["health"] = httpx.get(f"{url}/health", timeout=CALL_TIMEOUT_S).status_code
        text = httpx.get(f"{url}/metrics", timeout=CALL_TIMEOUT_S).text
        row.update({name: scraped(text, family) for name, family in SCRAPED.items()})
    except httpx.HTTPError as exc:
        row["problem"] = f"{type(exc).__name__}: {exc}"
    return row


class Sampler:
    """``sample`` every ``every_s`` seconds in a thread of its own, from entering the block until
    leaving it (and once more then)."""

    def __init__(self, url: str, pid: int, t0: float, every_s: float):
        self.url, self.pid, self.t0, self.every_s = url, pid, t0, every_s
        self.rows: list[dict[str, Any]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            self.rows.append(sample(self.url, self.pid, self.t0))
            r = self.rows[-1]
            print(
                f"{r['t_s']:7.1f} s  rss {r['rss_mb'] or 0:7.1f} MB  running {r.get('running')}  "
                f"waiting {r.get('waiting')}  passes {r.get('passes')}",
                flush=True,
            )
            self.done.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.rows.append(sample(self.url, self.pid, self.t0))


def stranded(url: str) -> float | None:
    """Sequences still running ``SETTLE_S`` after the last client returned (none should: an
    abandoned request leaves after the pass in progress)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        running = scraped(httpx.get(f"{url}/metrics", timeout=CALL_TIMEOUT_S).text, SCRAPED["running"])
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.5)


def after(target: Target, solo: dict[str, str]) -> dict[str, Any]:
    """The server once the soak is over: no sequence left running, still healthy, and a turn's reply
    still its solo reply."""
    key, messages = target.turns[0]
    left = stranded(target.url)
    with connections(target, random.Random(0)) as c:
        outcome = guarded(whole, c, target, messages)
        health = c.http.get(f"{target.url}/health").status_code
    return {
        "stranded_sequences": left,
        "health": health,
        "key": key,
        "status": outcome.status,
        "same_as_solo": outcome.text == solo[key],
    }


def log_tracebacks(log: Path) -> dict[str, Any]:
    """The tracebacks in the server's log: how many, and the first few (a soak's errors the
    clients may not see, such as a failure after a client left)."""
    text = log.read_text(errors="replace")
    starts = [m.start() for m in re.finditer(r"^Traceback", text, re.M)]
    return {"path": str(log), "tracebacks": len(starts), "first": [text[s : s + 2000] for s in starts[:3]]}


# -- the summary ---------------------------------------------------------------------------------------


def per_kind(records: list[dict]) -> dict[str, Any]:
    """Per kind: its calls, their outcomes, and how many were expected errors (a refusal, a timeout,
    a closed socket: every expected outcome but a 200)."""
    out: dict[str, Any] = {}
    for kind in [k for k in KINDS if any(r["kind"] == k for r in records)]:
        mine = [r for r in records if r["kind"] == kind]
        out[kind] = {
            "calls": len(mine),
            "outcomes": dict(Counter(str(r["status"]) for r in mine)),
            "expected_errors": sum(not r["unexpected"] and r["status"] != 200 for r in mine),
            "codes": dict(Counter(r["code"] for r in mine if r["code"] is not None)),
        }
    return out


def memory(samples: list[dict], window_s: float) -> dict[str, Any]:
    """Resident memory: medians of the first and last ``window_s``, and the slope over the second
    half (a flat memory has a slope near 0 and a last window near the first)."""
    points = [(r["t_s"], r["rss_mb"]) for r in samples if r["rss_mb"] is not None]
    end = points[-1][0]
    first = [mb for t, mb in points if t <= window_s]
    last = [mb for t, mb in points if t >= end - window_s]
    half = [(t, mb) for t, mb in points if t >= end / 2]
    return {
        "rss_mb_first_window_median": round(statistics.median(first), 1),
        "rss_mb_last_window_median": round(statistics.median(last), 1),
        "rss_mb_max": round(max(mb for _, mb in points), 1),
        "rss_slope_mb_per_min_second_half": round(60 * slope(*map(list, zip(*half))), 3),
    }


def scheduler(samples: list[dict]) -> dict[str, Any]:
    """The pair's scheduler over the soak: sequences per pass (sequences fed over passes run between
    the first and last samples), running and waiting sequences as sampled."""
    read = [r for r in samples if r.get("passes") is not None]
    passes = read[-1]["passes"] - read[0]["passes"]
    fed = read[-1]["sequences"] - read[0]["sequences"]
    running = [r["running"] for r in read]
    stall = longest = 0.0  # seconds with sequences running and no pass run: a wedged scheduler
    for a, b in zip(read, read[1:]):
        stall = stall + b["t_s"] - a["t_s"] if b["running"] and b["passes"] == a["passes"] else 0.0
        longest = max(longest, stall)
    return {
        "passes": int(passes),
        "sequences_per_pass": round(fed / passes, 3) if passes else None,
        "rows_per_pass": round((read[-1]["rows"] - read[0]["rows"]) / passes, 3) if passes else None,
        "running_mean": round(statistics.fmean(running), 2),
        "running_max": max(running),
        "waiting_max": max(r["waiting"] for r in read),
        "longest_stall_s": round(longest, 1),
    }


def replies(records: list[dict]) -> dict[str, Any]:
    """Completed replies against their solo replies: equal, different, and each different one."""
    compared = [r for r in records if r["same_as_solo"] is not None]
    different = [r for r in compared if not r["same_as_solo"]]
    return {
        "equal": len(compared) - len(different),
        "different": len(different),
        "differences": [
            {k: r[k] for k in ("key", "kind", "client", "t_s", "text", "solo")} for r in different
        ],
    }


def summarise(records: list[dict], samples: list[dict], wall_s: float, window_s: float) -> dict[str, Any]:
    unexpected = [r for r in records if r["unexpected"]]
    bad_samples = [r for r in samples if r.get("problem") or r.get("health") != 200 or r["rss_mb"] is None]
    return {
        "wall_s": round(wall_s, 1),
        "calls": len(records),
        "kinds": per_kind(records),
        "expected_errors": sum(k["expected_errors"] for k in per_kind(records).values()),
        "unexpected_errors": len(unexpected),
        "unexpected_by_outcome": dict(
            Counter(f"{r['kind']} {r['status']}: {r['problem']}" for r in unexpected)
        ),
        "unexpected_first": [  # every one is in the records
            {k: r[k] for k in ("kind", "key", "client", "t_s", "status", "problem")} for r in unexpected[:20]
        ],
        "bad_samples": bad_samples,
        "memory": memory(samples, window_s),
        "replies_as_solo": replies(records),
        "scheduler": scheduler(samples),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plots import finish

    rows = [r for r in result["samples"] if r.get("running") is not None]
    t = [r["t_s"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    a.plot(t, [r["rss_mb"] for r in rows], label="server's resident memory")
    a.set_ylabel("MB")
    a.legend()
    args = result["args"]
    a.set_title(f"Soak: {args['clients']} clients against agentspec serve for {args['duration_s']:.0f} s")
    b.plot(t, [r["running"] for r in rows], label="running sequences")
    b.plot(t, [r["waiting"] for r in rows], label="waiting calls")
    finish(fig, b, path, ylabel="sequences", title="the pair's scheduler, sampled", dpi=110, xlabel="seconds")


# -- the run -------------------------------------------------------------------------------------------


def turns(traces: list[Any]) -> list[tuple[str, list[dict]]]:
    """Every assistant turn of ``traces`` as (key, its history's OpenAI messages)."""
    return [
        (f"{t.name}/{n}", openai_messages(history)) for t in traces for n, (history, _) in enumerate(calls(t))
    ]


def connect(url: str, traces: list[Any], max_tokens: int) -> Target:
    """The target at ``url``: its model's name and context from /v1/models, a fresh soak salt."""
    card = httpx.get(f"{url}/v1/models", timeout=CALL_TIMEOUT_S).json()["data"][0]
    return Target(url, card["id"], card["max_model_len"], turns(traces), max_tokens, uuid.uuid4().hex)


def soak(
    url: str, pid: int, args: argparse.Namespace, traces: list[Any], mix: dict[str, int]
) -> dict[str, Any]:
    """The solo replies, then ``args.clients`` clients for ``args.duration_s`` with the server
    sampled throughout, then the check after."""
    target = connect(url, traces, args.max_tokens)
    started = time.monotonic()
    solo = solo_replies(target)
    print(f"{len(solo)} solo replies in {time.monotonic() - started:.1f} s", flush=True)
    t0 = time.monotonic()
    until = t0 + args.duration_s
    with Sampler(url, pid, t0, args.sample_s) as sampler, ThreadPoolExecutor(args.clients) as pool:
        jobs = [pool.submit(client, i, target, solo, mix, args.seed, t0, until) for i in range(args.clients)]
        records = sorted((r for job in jobs for r in job.result()), key=lambda r: r["t_s"])
    wall = time.monotonic() - t0
    return {
        "summary": summarise(records, sampler.rows, wall, args.window_s),
        "after": after(target, solo),
        "solo": solo,
        "samples": sampler.rows,
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples of the server")
    ap.add_argument("--window-s", type=float, default=60.0, help="the first and last windows of memory")
    ap.add_argument("--max-num-seqs", type=int, help="the server's (default: twice --clients)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--traces", default=None, help="comma-separated trace names (default: all)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds of call to draw from")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/soak_serve.json")
    args = ap.parse_args(argv)
    traces = [t for t in TRACES if args.traces is None or t.name in args.traces.split(",")]
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}; choose from {list(KINDS)}")
    mix = {kind: KINDS[kind] for kind in args.kinds.split(",")}
    env = environment(agentspec.load_pair(dtype=args.dtype))  # at the start: the commit, the machine
    seqs = args.max_num_seqs or 2 * args.clients
    options = ["--log-level", "warning", "--dtype", args.dtype, "--max-num-seqs", str(seqs)]
    log = Path(tempfile.mkdtemp(prefix="bench-soak-serve-")) / "serve.log"
    print(f"the server's log: {log}", flush=True)
    with agentspec_worker(cpu_shares(1)[0], options=options, log=log) as server:
        run = soak(server.url, server.process.pid, args, traces, mix)
    result = {
        "benchmark": "soak: clients with bad requests, disconnects and timeouts against agentspec serve",
        "environment": env,
        "args": {**vars(args), "out": str(args.out), "max_num_seqs": seqs},
        "traces": [t.name for t in traces],
        "kinds": mix,
        "expected": {kind: sorted(map(str, outcomes)) for kind, outcomes in EXPECTED.items()},
        "server_log": log_tracebacks(log),
        **run,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    summary = {k: v for k, v in result["summary"].items() if k not in ("bad_samples", "unexpected_first")}
    print(
        json.dumps(
            {"summary": summary, "after": result["after"], "tracebacks": result["server_log"]["tracebacks"]},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
