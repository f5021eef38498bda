"""Hundreds of agent calls: memory must plateau, latency must not drift, every error be answered.

    python -m benchmarks soak [--part inprocess] [--calls 500] [--max-tokens 16] [--cache-mb 48]
    python -m benchmarks soak --part serve [--clients 16] [--duration-s 600] [--traces a,b]

Both parts replay the 22 assistant turns of the recorded agent traces (``workloads.TRACES``) as
OpenAI-style messages, greedy, ``--max-tokens`` new tokens a call.

``inprocess`` (8 minutes on 2 CPU cores): ``--calls`` calls on one ``ChatSpecDecode``, invoke and stream
in turn. Each pass over the traces is a session whose system prompt opens with one of 9 customer
headers, so prefixes vary (a header seen before is restored from the prefix cache), and the cache's
budget (``--cache-mb``) is far below what the calls would keep, so it evicts throughout. After every
call: resident memory, the cache's bytes, the drafting memory's tokens, live Python objects, latency and
tokens; every ``TRIM_EVERY`` calls resident memory again right after glibc's ``malloc_trim`` (what is
live, without the pages the allocator keeps). The summary sets the last ``WINDOW`` calls beside the
first (memory, ms per output token) and fits memory slopes over the second half.

``serve`` (16 clients for 10 minutes, after 2 minutes of start-up): one ``agentspec serve`` on every
CPU, admitting twice as many sequences as there are clients (an abandoned request holds its slot until
its pass ends while its client sends the next: the soak looks for errors, not admission's 503). Every
turn first goes to it alone under a cache salt of its own: the solo replies. Then ``--clients`` threads
for ``--duration-s`` each loop over calls drawn (seeded per client) from ``KINDS``: a turn whole or
streamed; a malformed body, an unknown model, a prompt past the context, a bad tool schema (each must
get its 4xx with OpenAI's error body); a stream left after its first events; a socket closed before the
reply; a client timeout. Any other outcome is an unexpected error (the goal: none); a completed reply
must equal its solo reply (the goal: all). Every ``SAMPLE_S``: the server's resident memory, /health,
and its running and waiting sequences and scheduler passes from /metrics. Afterwards: sequences still
running ``SETTLE_S`` after the last client returned (none should), /health, one turn again, and the
tracebacks in the server's log.

Writes one key per part in ``results/soak.json``, and ``soak_inprocess.png`` (memory and the cache
budget; latency per call) or ``soak_serve.png`` (the server's memory; running and waiting sequences).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import random
import re
import socket
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai

from benchmarks import harness, workloads
from benchmarks.harness import CALL_TIMEOUT_S, slope
from benchmarks.workloads import calls, openai_messages

CUSTOMERS = ["Ada Byrne", "Bo Lindqvist", "Chen Wei", "Dario Russo", "Eve Okafor", "Farah Haddad",
             "Gus Moreau", "Hana Sato", "Ivo Petrov"]  # fmt: skip
WINDOW = 50  # in-process calls per window of the summary
TRIM_EVERY = 25  # in-process calls between heap trims


def rss_mb(pid: int | str = "self") -> float | None:
    """Resident memory of process ``pid`` now (Linux's /proc; None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def turns(traces: list[Any]) -> list[tuple[str, list[dict]]]:
    """Every assistant turn of ``traces`` as (key "trace/turn", its history's OpenAI messages)."""
    return [(f"{t.name}/{n}", openai_messages(h)) for t in traces for n, (h, _) in enumerate(calls(t))]


# --- in process ---------------------------------------------------------------------------------------


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; False where there is none).
    Resident memory counts pages the allocator keeps after tensors are freed (glibc raises its mmap
    threshold after large frees, so later KV tensors come from a heap that fragments); right after a
    trim, it counts what is live."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def schedule(n: int, seed: int, traces: list[Any]) -> list[dict[str, Any]]:
    """n calls: passes over every turn, each pass a session whose system prompt names a customer."""
    from langchain_core.messages import convert_to_messages

    rng, keyed, out = random.Random(seed), turns(traces), []
    while len(out) < n:
        header = f"Customer: {rng.choice(CUSTOMERS)}."  # of 9: some sessions repeat an earlier one
        for key, (system, *rest) in keyed:
            messages = [{**system, "content": f"{header}\n\n{system['content']}"}, *rest]
            out.append({"session": len(out) // len(keyed), "key": key,
                        "messages": convert_to_messages(messages)})  # fmt: skip
    return out[:n]


def soak_call(llm, pair, n: int, call: dict[str, Any]) -> dict[str, Any]:
    """Call ``n`` of the plan (streamed when odd) and its row: the reply's stats, the process after it."""
    start = time.perf_counter()
    if n % 2:
        reply = None
        for chunk in llm.stream(call["messages"]):
            reply = chunk if reply is None else reply + chunk
    else:
        reply = llm.invoke(call["messages"])
    latency, stats = time.perf_counter() - start, reply.response_metadata["stats"]
    out = stats["output_tokens"]
    decode_s = stats["total_time_s"] - (stats["time_to_first_token_s"] or 0.0)
    store = pair.tenants.memory().store.index
    trace, turn = call["key"].split("/")
    return {
        "call": n, "session": call["session"], "trace": trace, "turn": int(turn),
        "mode": "stream" if n % 2 else "invoke", "latency_s": latency,
        "prompt_tokens": stats["prompt_tokens"], "cached_tokens": stats["cached_tokens"],
        "output_tokens": out, "ms_per_output_token": 1000 * decode_s / (out - 1) if out > 1 else None,
        "drafted": stats["draft_tokens"], "accepted": stats["accepted_tokens"],
        "draft_failures": stats["draft_failures"],
        "rss_mb": rss_mb(), "cache_mb": pair.prefix_cache.bytes_used / (1 << 20),
        "evictions": pair.prefix_cache.tree.evictions,
        "suffix_tree_tokens": store.live, "suffix_tree_dead_entries": store.dead,
        "python_objects": len(gc.get_objects()), "rss_after_trim_mb": None,
    }  # fmt: skip


def inprocess_summary(rows: list[dict[str, Any]], budget_mb: float) -> dict[str, Any]:
    half, first, last = rows[len(rows) // 2 :], rows[:WINDOW], rows[-WINDOW:]
    rss, half_rss = [r["rss_mb"] for r in rows], [(r["call"], r["rss_mb"]) for r in half]
    trimmed = [(r["call"], r["rss_after_trim_mb"]) for r in half if r["rss_after_trim_mb"]]

    def med(part: list[dict], key: str) -> float | None:
        vals = [r[key] for r in part if r[key] is not None]
        return statistics.median(vals) if vals else None

    tpot_first, tpot_last = med(first, "ms_per_output_token"), med(last, "ms_per_output_token")
    return {
        "calls": len(rows),
        "cache_budget_mb": budget_mb,
        "cache_mb_max": max(r["cache_mb"] for r in rows),
        "cache_within_budget": all(r["cache_mb"] <= budget_mb for r in rows),
        "rss_mb_first_window_median": statistics.median(rss[:WINDOW]),
        "rss_mb_last_window_median": statistics.median(rss[-WINDOW:]),
        "rss_mb_max": max(rss),
        "rss_slope_mb_per_100_calls_second_half": 100 * slope(*zip(*half_rss)),
        "rss_after_trim_slope_mb_per_100_calls_second_half": 100 * slope(*zip(*trimmed)) if trimmed else 0.0,
        "python_objects_first": rows[0]["python_objects"],
        "python_objects_last": rows[-1]["python_objects"],
        "suffix_tree_tokens_last": rows[-1]["suffix_tree_tokens"],
        "ms_per_output_token_first_window_median": tpot_first,
        "ms_per_output_token_last_window_median": tpot_last,
        "ms_per_output_token_drift": tpot_last / tpot_first if tpot_first and tpot_last else None,
        "latency_s_first_window_median": med(first, "latency_s"),
        "latency_s_last_window_median": med(last, "latency_s"),
        "cached_fraction": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "acceptance_rate": sum(r["accepted"] for r in rows) / max(1, sum(r["drafted"] for r in rows)),
        "draft_failures": sum(r["draft_failures"] for r in rows),
        "evictions": rows[-1]["evictions"],
        "window": WINDOW,
    }  # fmt: skip


def inprocess(args: argparse.Namespace, traces: list[Any]) -> dict[str, Any]:
    import agentspec
    from langchain_agentspec import ChatSpecDecode

    pair = agentspec.load_pair(prefix_cache_bytes=int(args.cache_mb * (1 << 20)), dtype=args.dtype)
    llm = ChatSpecDecode(pair=pair, max_tokens=args.max_tokens)
    env, plan, rows = harness.environment(pair), schedule(args.calls, args.seed, traces), []
    t_start = time.perf_counter()
    for n, call in enumerate(plan):
        rows.append(soak_call(llm, pair, n, call))
        if (n % TRIM_EVERY == TRIM_EVERY - 1 or n == len(plan) - 1) and trim_heap():
            rows[-1]["rss_after_trim_mb"] = rss_mb()
        if n % 25 == 0 or n == len(plan) - 1:
            r = rows[-1]
            print(
                f"call {n:4d}  {r['latency_s']:5.2f} s  rss {r['rss_mb']:7.1f} MB  "
                f"cache {r['cache_mb']:5.1f} MB  cached {r['cached_tokens']}/{r['prompt_tokens']}",
                flush=True,
            )
    summary = inprocess_summary(rows, args.cache_mb) | {"wall_s": time.perf_counter() - t_start}
    return {"environment": env, "summary": summary, "rows": rows}


def plot_inprocess(result: dict[str, Any], out: Path) -> None:
    rows, summary = result["rows"], result["summary"]
    x, lat = [r["call"] for r in rows], [r["latency_s"] for r in rows]
    with harness.figure(out, 2, part="inprocess") as (a, b):
        a.plot(x, [r["rss_mb"] for r in rows], label="resident memory")
        trimmed = [(r["call"], r["rss_after_trim_mb"]) for r in rows if r["rss_after_trim_mb"]]
        if trimmed:
            a.plot(*zip(*trimmed), marker="o", ls="", label="resident memory right after a heap trim")
        a.plot(x, [r["cache_mb"] for r in rows], label="prefix cache")
        a.axhline(summary["cache_budget_mb"], ls="--", c="grey", label="cache budget")
        a.set(xlabel="call", ylabel="MB", title=f"{len(rows)} agent calls on one ChatSpecDecode")
        a.legend(loc="center right")
        b.scatter(x, lat, s=4, alpha=0.4, label="call latency")
        roll = [statistics.median(lat[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(lat))]
        b.plot(x, roll, c="C3", label=f"rolling median ({WINDOW} calls)")
        b.set(xlabel="call", ylabel="seconds", title=f"latency ({result['environment']['cpu_count']} CPUs)")
        b.legend(loc="upper right")


# --- through agentspec serve ------------------------------------------------------------------------

URL_PATH = "/v1/chat/completions"
# a tool whose parameters are not a JSON schema (properties must be an object)
BAD_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"properties": "sku"}}}]
SAMPLE_S = 5.0  # seconds between samples of the server
WINDOW_S = 60.0  # the first and last windows of the server's memory
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
    turns: list[tuple[str, list[dict]]]
    max_tokens: int
    salt: str  # the soak's cache salt: the solo replies ran under another

    def request(self, messages: list[dict], **options: Any) -> dict[str, Any]:
        """The ``openai`` client's arguments for ``messages``, greedy, under the soak's salt."""
        return {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": self.max_tokens,
                "extra_body": {"cache_salt": self.salt}, **options}  # fmt: skip

    def body(self, messages: list[dict], **options: Any) -> dict[str, Any]:
        """The same request as a JSON body, for the raw clients."""
        request = self.request(messages, **options)
        return {k: v for k, v in request.items() if k != "extra_body"} | request["extra_body"]


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
    """One soak client's connections and its seeded draws."""

    openai: openai.OpenAI
    http: httpx.Client
    rng: random.Random


def error_outcome(response: httpx.Response) -> Outcome:
    """A non-200 answer: its status, code and ``Retry-After``, and a problem where the body is not
    OpenAI's error or the status is not a 4xx."""
    status, retry = response.status_code, response.headers.get("retry-after")
    retry_after = float(retry) if retry else None
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):  # not JSON, or not an object
        error = None
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= error.keys():
        return Outcome(
            status, problem=f"not an OpenAI error body: {response.text[:300]}", retry_after=retry_after
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


def whole(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    r = c.openai.chat.completions.create(**target.request(messages))
    return Outcome(200, text=r.choices[0].message.content or "")


def streamed(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    chunks = c.openai.chat.completions.create(**target.request(messages, stream=True))
    return Outcome(200, text="".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))


def bad_json(c: Clients, target: Target, messages: list[dict]) -> Outcome:
    cut = json.dumps(target.body(messages))[:-7]  # the body's last characters lost: malformed
    r = c.http.post(f"{target.url}{URL_PATH}", content=cut, headers={"Content-Type": "application/json"})
    return error_outcome(r) if r.status_code != 200 else Outcome(200)


def refused(c: Clients, request: dict[str, Any]) -> Outcome:
    """A request that must be refused: an answer to it is the problem."""
    r = c.openai.chat.completions.create(**request)
    return Outcome(200, problem=f"answered: {r.choices[0].message}"[:300])


def flood(tokens: int) -> list[dict]:
    """A message past a context of ``tokens``: two words a token at least, however they tokenize."""
    return [{"role": "user", "content": "lorem ipsum " * tokens}]


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


KINDS: dict[str, tuple[Callable[[Clients, Target, list[dict]], Outcome], int, set[int | str]]] = {
    # kind: (the call, its weight in each client's draws, the outcomes it may have)
    "chat": (whole, 33, {200}),
    "chat_stream": (streamed, 33, {200}),
    "bad_json": (bad_json, 3, {400}),
    "bad_model": (lambda c, t, m: refused(c, t.request(m, model="no-such-model")), 3, {404}),
    "too_long": (lambda c, t, m: refused(c, t.request(flood(t.max_context))), 3, {400}),
    "bad_tools": (lambda c, t, m: refused(c, t.request(m, tools=BAD_TOOLS)), 3, {400}),
    "stream_disconnect": (stream_disconnect, 6, {200}),  # the status line came before the client left
    "whole_disconnect": (whole_disconnect, 6, {"closed"}),
    "timeout": (timeout, 10, {"timeout", 200}),  # a reply faster than the client's patience is a reply
}


@contextlib.contextmanager
def connections(target: Target, rng: random.Random) -> Iterator[Clients]:
    with harness.client(target.url) as oa, httpx.Client(timeout=CALL_TIMEOUT_S) as http:
        yield Clients(oa, http, rng)


def record(i: int, kind: str, key: str, outcome: Outcome, solo: str, at_s: float, seconds: float) -> dict:
    """A call's line in the results: its outcome, whether it was expected, its reply against solo."""
    same = None if outcome.text is None else outcome.text == solo
    return {
        "client": i, "kind": kind, "key": key, "t_s": round(at_s, 3), "seconds": round(seconds, 3),
        "status": outcome.status, "code": outcome.code,
        "unexpected": outcome.status not in KINDS[kind][2] or outcome.problem is not None,
        "problem": outcome.problem, "same_as_solo": same,
        **({"text": outcome.text, "solo": solo} if same is False else {}),
    }  # fmt: skip


def client(i: int, target: Target, solo: dict[str, str], seed: int, t0: float, until: float) -> list[dict]:
    """Client ``i``: calls drawn from ``KINDS`` (its own seeded draws) one after another until ``until``
    (monotonic); their records."""
    rng = random.Random(f"{seed}/{i}")  # a string seed: the same draws in every run
    kinds, weights, records = list(KINDS), [w for _, w, _ in KINDS.values()], []
    with connections(target, rng) as c:
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            key, messages = rng.choice(target.turns)
            start = time.monotonic()
            outcome = guarded(KINDS[kind][0], c, target, messages)
            records.append(record(i, kind, key, outcome, solo[key], start - t0, time.monotonic() - start))
            if outcome.retry_after is not None:  # as a polite client does: a full server is not flooded
                time.sleep(max(0.0, min(outcome.retry_after, until - time.monotonic())))
    return records


def scraped(text: str, family: str) -> float | None:
    """The value of ``family`` in a /metrics exposition (summed over its label sets)."""
    values = re.findall(rf"^{re.escape(family)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values) if values else None


def sample(url: str, pid: int, t0: float) -> dict[str, Any]:
    """The server now: resident memory, /health, and the scheduler's families from /metrics."""
    row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 2), "rss_mb": rss_mb(pid)}
    try:
        row["health"] = httpx.get(f"{url}/health", timeout=CALL_TIMEOUT_S).status_code
        text = httpx.get(f"{url}/metrics", timeout=CALL_TIMEOUT_S).text
        row.update({name: scraped(text, family) for name, family in SCRAPED.items()})
    except httpx.HTTPError as exc:
        row["problem"] = f"{type(exc).__name__}: {exc}"
    print(f"{row['t_s']:7.1f} s  rss {row['rss_mb'] or 0:7.1f} MB  running {row.get('running')}  "
          f"waiting {row.get('waiting')}  passes {row.get('passes')}", flush=True)  # fmt: skip
    return row


def after(target: Target, solo: dict[str, str]) -> dict[str, Any]:
    """The server after the soak: no sequence running ``SETTLE_S`` after the last client returned (an
    abandoned request leaves after its pass), still healthy, a turn's reply still its solo reply."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = scraped(httpx.get(f"{target.url}/metrics", timeout=CALL_TIMEOUT_S).text, SCRAPED["running"])
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    key, messages = target.turns[0]
    with connections(target, random.Random(0)) as c:
        outcome = guarded(whole, c, target, messages)
        health = c.http.get(f"{target.url}/health").status_code
    return {"stranded_sequences": left, "health": health, "key": key, "status": outcome.status,
            "same_as_solo": outcome.text == solo[key]}  # fmt: skip


def log_tracebacks(log: Path) -> dict[str, Any]:
    """The tracebacks in the server's log: how many, and the first few (errors the clients may not
    see, such as a failure after a client left)."""
    text = log.read_text(errors="replace")
    starts = [m.start() for m in re.finditer(r"^Traceback", text, re.M)]
    return {"path": str(log), "tracebacks": len(starts), "first": [text[s : s + 2000] for s in starts[:3]]}


def per_kind(records: list[dict]) -> dict[str, Any]:
    """Per kind: its calls, their outcomes and codes, and how many were expected errors (a refusal, a
    timeout, a closed socket: every expected outcome but a 200)."""
    mine = {kind: [r for r in records if r["kind"] == kind] for kind in KINDS}
    return {kind: {"calls": len(rs), "outcomes": dict(Counter(str(r["status"]) for r in rs)),
                   "expected_errors": sum(not r["unexpected"] and r["status"] != 200 for r in rs),
                   "codes": dict(Counter(r["code"] for r in rs if r["code"] is not None))}
            for kind, rs in mine.items() if rs}  # fmt: skip


def memory(samples: list[dict]) -> dict[str, Any]:
    """Resident memory: medians of the first and last ``WINDOW_S``, and the slope over the second half
    (a flat memory has a slope near 0 and a last window near the first)."""
    points = [(r["t_s"], r["rss_mb"]) for r in samples if r["rss_mb"] is not None]
    end = points[-1][0]
    half = [(t, mb) for t, mb in points if t >= end / 2]
    first, last = [mb for t, mb in points if t <= WINDOW_S], [mb for t, mb in points if t >= end - WINDOW_S]
    return {
        "rss_mb_first_window_median": round(statistics.median(first), 1),
        "rss_mb_last_window_median": round(statistics.median(last), 1),
        "rss_mb_max": round(max(mb for _, mb in points), 1),
        "rss_slope_mb_per_min_second_half": round(60 * slope(*zip(*half)), 3),
    }  # fmt: skip


def scheduler(samples: list[dict]) -> dict[str, Any]:
    """The pair's scheduler over the soak: sequences and rows per pass (fed over passes run between
    the first and last samples), running and waiting sequences as sampled."""
    read = [r for r in samples if r.get("passes") is not None]
    passes = read[-1]["passes"] - read[0]["passes"]
    stall = longest = 0.0  # seconds with sequences running and no pass run: a wedged scheduler
    for a, b in zip(read, read[1:]):
        stall = stall + b["t_s"] - a["t_s"] if b["running"] and b["passes"] == a["passes"] else 0.0
        longest = max(longest, stall)

    def per_pass(field: str) -> float | None:
        return round((read[-1][field] - read[0][field]) / passes, 3) if passes else None

    return {"passes": int(passes), "sequences_per_pass": per_pass("sequences"),
            "rows_per_pass": per_pass("rows"), "running_max": max(r["running"] for r in read),
            "running_mean": round(statistics.fmean(r["running"] for r in read), 2),
            "waiting_max": max(r["waiting"] for r in read), "longest_stall_s": round(longest, 1)}  # fmt: skip


def serve_summary(records: list[dict], samples: list[dict], wall_s: float) -> dict[str, Any]:
    kinds, bad = per_kind(records), [r for r in records if r["unexpected"]]
    compared = [r for r in records if r["same_as_solo"] is not None]
    different = [r for r in compared if not r["same_as_solo"]]
    return {
        "wall_s": round(wall_s, 1),
        "calls": len(records),
        "kinds": kinds,
        "expected_errors": sum(k["expected_errors"] for k in kinds.values()),
        "unexpected_errors": len(bad),
        "unexpected_by_outcome": dict(Counter(f"{r['kind']} {r['status']}: {r['problem']}" for r in bad)),
        "bad_samples": [r for r in samples if r.get("problem") or r.get("health") != 200 or not r["rss_mb"]],
        "memory": memory(samples),
        "replies_as_solo": {
            "equal": len(compared) - len(different),
            "different": len(different),
            "differences": [{k: r[k] for k in ("key", "kind", "t_s", "text", "solo")} for r in different],
        },
        "scheduler": scheduler(samples),
    }  # fmt: skip


def serve(args: argparse.Namespace, traces: list[Any]) -> dict[str, Any]:
    """The server started; the solo replies, then ``args.clients`` clients for ``args.duration_s`` with
    the server sampled every ``SAMPLE_S`` meanwhile, then the check after."""
    import agentspec
    from agentspec.fleet.workers import agentspec_worker, cpu_shares

    env = harness.environment(agentspec.load_pair(dtype=args.dtype, warm_up=False))  # commit, machine
    seqs = 2 * args.clients
    options = ["--log-level", "warning", "--dtype", args.dtype, "--max-num-seqs", str(seqs)]
    log = Path(tempfile.mkdtemp(prefix="soak-serve-")) / "serve.log"
    print(f"the server's log: {log}", flush=True)
    with agentspec_worker(cpu_shares(1)[0], threads=args.threads, options=options, log=log) as server:
        url, pid = server.url, server.process.pid
        m = httpx.get(f"{url}/v1/models", timeout=CALL_TIMEOUT_S).json()["data"][0]  # the model's card
        target = Target(url, m["id"], m["max_model_len"], turns(traces), args.max_tokens, uuid.uuid4().hex)
        alone = dataclasses.replace(target, salt=f"solo-{target.salt}")  # nothing of theirs for the soak
        with connections(alone, random.Random(0)) as c:  # each turn alone: what every reply is held to
            solo = {key: whole(c, alone, messages).text or "" for key, messages in target.turns}
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            until = t0 + args.duration_s
            jobs = [pool.submit(client, i, target, solo, args.seed, t0, until) for i in range(args.clients)]
            samples = [sample(url, pid, t0)]
            while futures.wait(jobs, timeout=SAMPLE_S).not_done:
                samples.append(sample(url, pid, t0))
            samples.append(sample(url, pid, t0))
        records = sorted((r for job in jobs for r in job.result()), key=lambda r: r["t_s"])
        summary = serve_summary(records, samples, time.monotonic() - t0)
        done = after(target, solo)
    expected = {kind: sorted(map(str, outcomes)) for kind, (_, _, outcomes) in KINDS.items()}
    return {"environment": env, "max_num_seqs": seqs, "traces": [t.name for t in traces],
            "expected": expected, "server_log": log_tracebacks(log), "summary": summary, "after": done,
            "solo": solo, "samples": samples, "records": records}  # fmt: skip


def plot_serve(result: dict[str, Any], out: Path) -> None:
    rows = [r for r in result["samples"] if r.get("running") is not None]
    t = [r["t_s"] for r in rows]
    args = result["args"]
    with harness.figure(out, 2, part="serve") as (a, b):
        a.plot(t, [r["rss_mb"] for r in rows], label="server's resident memory")
        a.set(xlabel="seconds", ylabel="MB")
        a.set_title(f"{args['clients']} clients against agentspec serve for {args['duration_s']:.0f} s")
        a.legend()
        b.plot(t, [r["running"] for r in rows], label="running sequences")
        b.plot(t, [r["waiting"] for r in rows], label="waiting calls")
        b.set(xlabel="seconds", ylabel="sequences", title="the pair's scheduler, sampled")
        b.legend()


PARTS = {"inprocess": (inprocess, plot_inprocess), "serve": (serve, plot_serve)}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("soak", __doc__, dtype=True)
    ap.add_argument("--part", choices=PARTS, default="inprocess")
    ap.add_argument("--max-tokens", type=int, default=16, help="new tokens a call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", help="comma-separated trace names (default: all)")
    ap.add_argument("--calls", type=int, default=500, help="inprocess: calls")
    ap.add_argument("--cache-mb", type=float, default=48, help="inprocess: the prefix cache's budget")
    ap.add_argument("--clients", type=int, default=16, help="serve: concurrent clients")
    ap.add_argument("--duration-s", type=float, default=600.0, help="serve: seconds the clients call")
    args = ap.parse_args(argv)
    harness.set_threads(args.threads)
    result = harness.run_part(args, PARTS, workloads.traces_named(args.traces))
    brief = {k: v for k, v in result["summary"].items() if not isinstance(v, list)}
    print(json.dumps({"summary": brief, "after": result.get("after")}, indent=1))
    return 0
