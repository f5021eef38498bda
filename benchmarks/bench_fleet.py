"""K concurrent agent sessions: one agentspec worker, a 2-worker fleet (two policies), vLLM.

Run from the repository root, with the machine to itself (all five systems at K = 1, 2, 4, 8 and
48 new tokens: 20-30 minutes on 2 CPU cores, two of them vLLM start-ups):

    python -m benchmarks.bench_fleet [--systems single,fleet_hash,...] [--k 1,2,4,8] [--max-new-tokens 48]

K sessions at once replay the recorded agent traces of ``agent_traces.py`` (session i replays trace
i mod 5; a repeated trace gets a session tag in its first user message, so no two sessions send the
same history) turn by turn through the ``openai`` client, each under its own ``X-Session-ID``,
greedy. The systems run one after another, each alone on the machine:

- ``single``: one ``agentspec serve`` on both CPUs with two torch threads, called directly (the
  stand-in for one in-process ChatSpecDecode pair: the HTTP path costs within a few percent of it,
  ``bench_serve.py``, and it queues concurrent sessions as the pair's lock would);
- ``fleet_hash``: ``agentspec.fleet.Fleet``, 2 workers of one CPU and one thread each behind
  vllm-router with ``consistent_hash``; ``fleet_rr``: the same with ``round_robin``;
- ``vllm_spec``: one vLLM worker with n-gram speculation and prefix caching
  (``agentspec.fleet.vllm.vllm_worker_command``, in ``.venv-vllm``: ``make vllm``); ``vllm_plain``:
  the same without speculation. Skipped, with a note in the JSON, where either is missing.

Every K runs under a cache salt of its own (``cache_salt``, which agentspec and vLLM both take), so
a run reads nothing an earlier K left in the caches. Per system and K: per-session end-to-end
latency (median, p90), generated tokens per second across sessions, the share of prompt tokens read
from cache, where each session ran (the router's log for consistent hashing; each worker's count of
answered requests otherwise), and how many replies equal the ``single`` system's. Writes JSON
(--out) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import httpx  # noqa: E402
import openai  # noqa: E402

import agentspec  # noqa: E402
from agentspec.bench.run import environment  # noqa: E402
from agentspec.fleet import Fleet  # noqa: E402
from agentspec.fleet.process import ServerProcess, free_port  # noqa: E402
from agentspec.fleet.workers import agentspec_worker, cpu_shares  # noqa: E402
from benchmarks.agent_traces import TRACES, calls  # noqa: E402
from benchmarks.bench_serve import openai_messages  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {
    "single": "one agentspec serve, 2 threads on both CPUs",
    "fleet_hash": "2 agentspec workers (1 CPU each) behind vllm-router, consistent_hash",
    "fleet_rr": "2 agentspec workers (1 CPU each) behind vllm-router, round_robin",
    "vllm_spec": "one vLLM worker, n-gram speculation, prefix caching",
    "vllm_plain": "one vLLM worker, prefix caching, no speculation",
}
CALL_TIMEOUT_S = 900.0  # a turn queued behind 7 others on a slow system


class System:
    """A running system: the URL its clients call, its workers' URLs, and where sessions ran."""

    def __init__(self, name: str, url: str, workers: list[str], fleet: Fleet | None = None):
        self.name, self.url, self.workers, self.fleet = name, url, workers, fleet

    def served(self) -> list[int]:
        """Requests each agentspec worker answered with 200 so far (its /metrics); [] for vLLM."""
        if self.name.startswith("vllm"):
            return []
        pattern = r'agentspec_requests_total\{[^}]*status="200"[^}]*\} (\S+)'
        texts = [httpx.get(f"{w}/metrics", timeout=10).text for w in self.workers]
        return [sum(int(float(v)) for v in re.findall(pattern, t)) for t in texts]

    def placement(self, sessions: list[str]) -> dict[str, list[int]] | None:
        """The worker index of each request of each session: all on worker 0 without a router; from the
        router's log with consistent hashing; None where the router logs no choices (round robin)."""
        if self.fleet is None:
            return {s: [0] for s in sessions}
        if self.fleet.policy != "consistent_hash":
            return None
        placed: dict[str, list[int]] = {s: [] for s in sessions}
        for session, worker in self.fleet.session_choices():
            if session in placed:
                placed[session].append(self.workers.index(worker))
        return placed


def vllm_command(port: int, speculative: bool, dtype: str = "float32") -> list[str] | str:
    """The vLLM worker's command, or why there is none here."""
    try:
        from agentspec.fleet.vllm import vllm_worker_command
    except ImportError as exc:
        return f"agentspec.fleet.vllm is missing ({exc})"
    command = vllm_worker_command(port, speculative=speculative, dtype=dtype)
    if shutil.which(command[0]) is None:
        return f"{command[0]} is missing: make vllm creates .venv-vllm"
    return command


@contextlib.contextmanager
def running(name: str, log_dir: Path, dtype: str = "float32") -> Iterator[System | str]:
    """System ``name`` started (stopped after the block), or a string saying why it cannot run;
    every engine in it computes in ``dtype``."""
    options = ["--log-level", "warning", "--dtype", dtype]
    if name == "single":
        worker = agentspec_worker(cpu_shares(1)[0], options=options, log=log_dir / "single.log")
        with worker:
            yield System(name, worker.url, [worker.url])
    elif name in ("fleet_hash", "fleet_rr"):
        policy = "consistent_hash" if name == "fleet_hash" else "round_robin"
        opts = {"threads_per_worker": 1, "worker_options": options}
        with Fleet(2, policy=policy, log_dir=log_dir / name, **opts) as fleet:
            yield System(name, fleet.url, fleet.workers, fleet)
    else:
        port = free_port()
        command = vllm_command(port, speculative=name == "vllm_spec", dtype=dtype)
        if isinstance(command, str):
            yield command
            return
        with ServerProcess(command, port, log=log_dir / f"{name}.log") as worker:
            yield System(name, worker.url, [worker.url])


def session_traces(k: int, traces: Sequence[Any] = TRACES) -> list[tuple[str | None, Any]]:
    """(tag, trace) of each of k sessions over ``traces``: a repeated trace's first user turn gets a tag."""
    return [(None if i < len(traces) else f"session {i}", traces[i % len(traces)]) for i in range(k)]


def tagged(messages: list[dict], tag: str | None) -> list[dict]:
    if tag is None:
        return messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return [
        *messages[:first],
        {**messages[first], "content": f"[{tag}] {messages[first]['content']}"},
        *messages[first + 1 :],
    ]


def turn(
    client: openai.OpenAI, model: str, messages: list[dict], session: str, salt: str, n_new: int
) -> dict:
    start = time.perf_counter()
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=n_new,
        extra_headers={"X-Session-ID": session},
        extra_body={"cache_salt": salt},
    )
    seconds = time.perf_counter() - start
    message, details = r.choices[0].message, r.usage.prompt_tokens_details
    return {
        "seconds": round(seconds, 4),
        "text": message.content or "",
        "tool_calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
        "prompt_tokens": r.usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details is not None else 0,
        "output_tokens": r.usage.completion_tokens,
    }


def replay(ask: Callable[[list[dict]], dict], session: str, tag: str | None, trace) -> dict[str, Any]:
    """One session: ``trace``'s turns one after another, each history (OpenAI messages) answered by
    ``ask``, which returns the turn's record (``turn``'s fields)."""
    start = time.perf_counter()
    turns = [ask(tagged(openai_messages(history), tag)) for history, _ in calls(trace)]
    return {
        "session": session,
        "trace": trace.name,
        "tag": tag,
        "seconds": time.perf_counter() - start,
        "turns": turns,
    }


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]  # nearest rank


def at_once(
    ids: list[str],
    traces: list[tuple[str | None, Any]],
    session: Callable[[str, str | None, Any], dict],
    workers: int | None = None,
) -> tuple[list[dict], float]:
    """``session(id, tag, trace)`` for each id and (tag, trace), ``workers`` at a time (default: all
    at once); the sessions' records, in order, and the wall time of them all."""
    start = time.perf_counter()
    with ThreadPoolExecutor(workers or len(ids)) as pool:
        jobs = [pool.submit(session, sid, tag, trace) for sid, (tag, trace) in zip(ids, traces)]
        sessions = [job.result() for job in jobs]
    return sessions, time.perf_counter() - start


def summary(k: int, wall: float, sessions: list[dict]) -> dict[str, Any]:
    """A run's figures: session latency (median, p90), generated tokens/s, share of prompt from cache."""
    turns = [t for s in sessions for t in s["turns"]]
    latencies = [s["seconds"] for s in sessions]
    return {
        "k": k,
        "wall_s": round(wall, 3),
        "median_session_s": round(statistics.median(latencies), 3),
        "p90_session_s": round(p90(latencies), 3),
        "tokens_per_s": round(sum(t["output_tokens"] for t in turns) / wall, 3),
        "cache_share": round(
            sum(t["cached_tokens"] for t in turns) / sum(t["prompt_tokens"] for t in turns), 4
        ),
    }


def run_k(system: System, model: str, k: int, n_new: int, traces: Sequence[Any] = TRACES) -> dict[str, Any]:
    """k sessions at once through ``system``; their turns and the run's summary."""
    client = openai.OpenAI(
        base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    salt, ids = uuid.uuid4().hex, [f"{system.name}-k{k}-s{i}" for i in range(k)]

    def session(sid: str, tag: str | None, trace: Any) -> dict[str, Any]:
        return replay(lambda m: turn(client, model, m, sid, salt, n_new), sid, tag, trace)

    served = system.served()
    sessions, wall = at_once(ids, session_traces(k, traces), session)
    return {
        **summary(k, wall, sessions),
        "requests_per_worker": [b - a for a, b in zip(served, system.served())],
        "placement": system.placement(ids),
        "sessions": sessions,
    }


def warm(system: System, model: str) -> None:
    """One short call to every worker: first-call costs stay out of the timing."""
    for url in system.workers:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )


def reply_key(session: dict[str, Any], n: int) -> tuple:
    return session["trace"], session["tag"], n


def same_replies(runs: dict[str, list[dict]]) -> None:
    """Count, in every run, the replies equal to the ``single`` system's reply to the same history."""
    reference = {
        reply_key(s, n): (t["text"], t["tool_calls"])
        for run in runs.get("single", [])
        for s in run["sessions"]
        for n, t in enumerate(s["turns"])
    }
    for system_runs in runs.values():
        for run in system_runs:
            pairs = [
                (reference[reply_key(s, n)], (t["text"], t["tool_calls"]))
                for s in run["sessions"]
                for n, t in enumerate(s["turns"])
                if reply_key(s, n) in reference
            ]
            run["same_replies_as_single"] = [sum(a == b for a, b in pairs), len(pairs)]


def goals(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """The issue's goals where their systems ran (``single`` stands in for the in-process pair)."""
    at = {(name, run["k"]): run for name, system_runs in runs.items() for run in system_runs}
    out: dict[str, Any] = {}
    if ("single", 1) in at and ("vllm_spec", 1) in at:
        ratio = at["vllm_spec", 1]["median_session_s"] / at["single", 1]["median_session_s"]
        out["k1_vllm_spec_over_single"] = {"value": round(ratio, 3), "goal": ">= 1.5", "met": ratio >= 1.5}
    if ("single", 8) in at and ("fleet_hash", 8) in at:
        single, fleet = at["single", 8], at["fleet_hash", 8]
        ratio = single["median_session_s"] / fleet["median_session_s"]
        gap = abs(single["cache_share"] - fleet["cache_share"])
        out["k8_single_over_fleet_hash"] = {"value": round(ratio, 3), "goal": ">= 1.3", "met": ratio >= 1.3}
        out["k8_cache_share_gap"] = {"value": round(gap, 4), "goal": "<= 0.05", "met": gap <= 0.05}
    return out


def plot(result: dict[str, Any], path: Path, title: str = "Agent sessions at once") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plots import finish

    panels = [
        ("median_session_s", "median session latency (s)"),
        ("tokens_per_s", "generated tokens/s, all sessions"),
        ("cache_share", "share of prompt tokens from cache"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (field, label) in zip(axes, panels):
        for name, system_runs in result["runs"].items():
            ks = [run["k"] for run in system_runs]
            ax.plot(ks, [run[field] for run in system_runs], "o-", label=name)
            if field == "median_session_s":
                ax.plot(
                    ks, [run["p90_session_s"] for run in system_runs], ":", color=ax.lines[-1].get_color()
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["k"], [str(k) for k in result["k"]])
        ax.set_xlabel("concurrent sessions K")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    finish(fig, axes[0], path, ylabel=panels[0][1], title=f"{title} (dotted: p90)", dpi=110)


def measure(names: list[str], ks: list[int], n_new: int, log_dir: Path) -> tuple[dict, dict]:
    """The runs of each system that can run here, one system after another (each has the machine to
    itself), and why the others were skipped."""
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        with running(name, log_dir) as system:
            if isinstance(system, str):
                skipped[name] = system
                print(f"{name}: skipped, {system}", flush=True)
                continue
            model = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused").models.list().data[0].id
            warm(system, model)
            runs[name] = []
            for k in ks:
                run = run_k(system, model, k, n_new)
                runs[name].append(run)
                print(
                    f"{name:>10} K={k}: median {run['median_session_s']:7.2f} s, "
                    f"p90 {run['p90_session_s']:7.2f} s, {run['tokens_per_s']:6.2f} tok/s, "
                    f"cache {run['cache_share']:.2f}, requests per worker {run['requests_per_worker']}",
                    flush=True,
                )
    return runs, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--k", default="1,2,4,8", help="comma-separated session counts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fleet.json")
    args = ap.parse_args(argv)
    names, ks = args.systems.split(","), [int(k) for k in args.k.split(",")]
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    env = environment(agentspec.load_pair())  # at the start: the commit, the machine, the load
    log_dir = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    print(f"servers' logs in {log_dir}", flush=True)
    runs, skipped = measure(names, ks, args.max_new_tokens, log_dir)
    same_replies(runs)
    result = {
        "benchmark": "K concurrent agent sessions: one worker, a 2-worker fleet, vLLM",
        "environment": env,
        "systems": {name: SYSTEMS[name] for name in names},
        "skipped": skipped,
        "k": ks,
        "max_new_tokens": args.max_new_tokens,
        "goals": goals(runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if runs:
        plot(result, args.out.with_suffix(".png"))
    summary = {
        n: [(r["k"], r["median_session_s"], r["same_replies_as_single"]) for r in rs]
        for n, rs in runs.items()
    }
    print(
        json.dumps(
            {"goals": result["goals"], "median_s_and_same_replies": summary, "skipped": skipped}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
