"""K concurrent agent sessions on one pair: in process, one after another, through ``agentspec serve``,
beside vLLM and the 2-worker fleet (issue 28's benchmark).

Run from the repository root, with the machine to itself (an hour or more on 2 CPU cores):

    python -m benchmarks.bench_concurrency [--systems inprocess,sequential,serve,vllm_spec,fleet]
        [--k 1,2,4,8,16] [--max-new-tokens 48] [--dtype float32] [--traces a,b] [--out PATH]

Sessions as in ``bench_fleet.py``, whose machinery this reuses: session i replays trace i mod (the
number of traces) turn by turn, a repeated trace tagged in its first user message; greedy, at most
``--max-new-tokens`` a reply. No tools are bound (the traces carry theirs in the system prompt), so
every reply is the model's raw text on every system and replies compare as text. Each system runs
alone, on servers of its own:

- ``inprocess``: K threads calling ``ChatSpecDecode.invoke`` on one embedded pair in this process,
  whose scheduler shares its passes among them; a fresh pair for each K, so nothing an earlier K
  left in its caches is read. Its scheduler's passes, member shares and rows over the run are kept
  (``scheduler``: sequences and rows per pass).
- ``sequential``: the same K sessions one after another on a fresh pair: issue 28's baseline, and
  the solo turns every system's turns are compared with (``same_as_solo``, per turn and per run).
- ``serve``: one ``agentspec serve`` on every CPU (``bench_fleet``'s ``single``), through the
  ``openai`` client.
- ``vllm_spec``: one vLLM worker with n-gram speculation and prefix caching on the same weights
  (``.venv-vllm``: ``make vllm``; it binds its own threads, one NUMA node's cores less one). Each
  turn goes to ``/v1/completions`` as the token ids agentspec renders for it (``agentspec.chat.
  prepare`` with the pair's tokenizer): vLLM's chat endpoint renders the tool history in fewer
  tokens, and the two engines are to read the same prompt.
- ``fleet``: 2 agentspec workers behind vllm-router with consistent hashing (``fleet_hash``).

``--dtype`` (float32 or bfloat16) applies to agentspec and vLLM alike. Every server run of a K
uses a cache salt of its own. Per system and K: per-session latency (median, p90), generated
tokens/s, the share of prompt tokens read from cache, each turn's prompt and cached tokens, how
many replies and prompt lengths equal the sequential run's, and issue 28's goals at K = 8.
Writes JSON (--out) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import openai  # noqa: E402
import torch  # noqa: E402

import agentspec  # noqa: E402
from agentspec.bench.run import environment  # noqa: E402
from agentspec.chat import prepare  # noqa: E402
from benchmarks.agent_traces import TRACES  # noqa: E402
from benchmarks.bench_fleet import (  # noqa: E402
    CALL_TIMEOUT_S,
    System,
    at_once,
    plot,
    replay,
    reply_key,
    run_k,
    running,
    session_traces,
    summary,
    warm,
)
from benchmarks.bench_serve import in_process  # noqa: E402
from langchain_agentspec import ChatSpecDecode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {
    "inprocess": "K threads on one in-process pair (ChatSpecDecode), its scheduler sharing passes",
    "sequential": "the same K sessions one after another on one in-process pair",
    "serve": "one agentspec serve on every CPU, through the openai client",
    "vllm_spec": "one vLLM worker, n-gram speculation, prefix caching, prompts as agentspec's token ids",
    "fleet": "2 agentspec workers (1 CPU each) behind vllm-router, consistent_hash",
}
SERVERS = {"serve": "single", "vllm_spec": "vllm_spec", "fleet": "fleet_hash"}  # bench_fleet's names
REFERENCE = "sequential"  # its turns are the solo turns every run's turns are compared with
GOAL_K = 8
# issue 28's goals at K = GOAL_K: (name, system a, system b, field; a's field over b's, op, bound)
GOALS = [
    ("inprocess_over_vllm_spec_tokens_per_s", "inprocess", "vllm_spec", "tokens_per_s", ">=", 1.5),
    ("vllm_spec_over_inprocess_median_session_s", "vllm_spec", "inprocess", "median_session_s", ">=", 1.0),
    ("inprocess_over_sequential_tokens_per_s", "inprocess", "sequential", "tokens_per_s", ">=", 3.0),
    ("serve_over_inprocess_wall_s", "serve", "inprocess", "wall_s", "<=", 1.10),
]


def session_ids(name: str, k: int) -> list[str]:
    return [f"{name}-k{k}-s{i}" for i in range(k)]


def scheduler_counts(pair: agentspec.ModelPair) -> tuple[int, int, int]:
    stats = pair.scheduler.stats
    return stats.passes, stats.members, stats.rows


def passes_between(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, Any]:
    """The scheduler's work over a run: passes, member shares and rows, and both per pass."""
    passes, members, rows = (b - a for a, b in zip(before, after))
    return {
        "passes": passes,
        "members": members,
        "rows": rows,
        "members_per_pass": round(members / passes, 3) if passes else None,
        "rows_per_pass": round(rows / passes, 3) if passes else None,
    }


def run_pair(
    name: str, dtype: str, k: int, n_new: int, traces: Sequence[Any], load_factor: str = "default"
) -> dict[str, Any]:
    """k sessions on a fresh pair in this process: all at once (``inprocess``) or one after another
    (``sequential``); ``load_factor``: the scheduler's (``Scheduler.load_factor``; "none": no bound
    on drafts under load, "default": the scheduler's own)."""
    pair = agentspec.load_pair(dtype=dtype)
    if load_factor != "default":
        pair.scheduler.load_factor = None if load_factor == "none" else float(load_factor)
    llm = ChatSpecDecode(pair=pair, max_tokens=n_new)
    # first-call costs stay out of the timing (the chat template's first few tokens stay in the
    # pair's cache: a first turn reads them, where a server's salted turn reads nothing)
    in_process(llm, [{"role": "user", "content": "Hi"}])

    def session(sid: str, tag: str | None, trace: Any) -> dict[str, Any]:
        return replay(lambda m: in_process(llm, m), sid, tag, trace)

    workers = k if name == "inprocess" else 1
    before = scheduler_counts(pair)
    sessions, wall = at_once(session_ids(name, k), session_traces(k, traces), session, workers)
    return {
        **summary(k, wall, sessions),
        "load_factor": pair.scheduler.load_factor,
        "scheduler": passes_between(before, scheduler_counts(pair)),
        "sessions": sessions,
    }


def completion_turn(
    client: openai.OpenAI, model: str, ids: list[int], session: str, salt: str, n_new: int
) -> dict[str, Any]:
    """One turn as prompt token ids through ``/v1/completions``; the fields of ``bench_fleet.turn``."""
    start = time.perf_counter()
    r = client.completions.create(
        model=model,
        prompt=ids,
        temperature=0,
        max_tokens=n_new,
        extra_headers={"X-Session-ID": session},
        extra_body={"cache_salt": salt},
    )
    seconds = time.perf_counter() - start
    details = r.usage.prompt_tokens_details
    return {
        "seconds": round(seconds, 4),
        "text": r.choices[0].text,
        "tool_calls": [],  # no tools bound: agentspec parses none either
        "prompt_tokens": r.usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details is not None else 0,
        "output_tokens": r.usage.completion_tokens,
    }


def run_completions(
    system: System, model: str, tokenizer: Any, k: int, n_new: int, traces: Sequence[Any]
) -> dict[str, Any]:
    """k sessions at once through ``system``'s ``/v1/completions``, each turn as agentspec's prompt ids."""
    client = openai.OpenAI(
        base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    salt = uuid.uuid4().hex

    def session(sid: str, tag: str | None, trace: Any) -> dict[str, Any]:
        def ask(messages: list[dict]) -> dict[str, Any]:
            ids = prepare(tokenizer, messages).prompt.ids  # as ChatSpecDecode and agentspec serve render
            return completion_turn(client, model, ids, sid, salt, n_new)

        return replay(ask, sid, tag, trace)

    sessions, wall = at_once(session_ids(system.name, k), session_traces(k, traces), session)
    return {**summary(k, wall, sessions), "sessions": sessions}


def report(name: str, run: dict[str, Any]) -> None:
    shared = run.get("scheduler", {}).get("members_per_pass")
    print(
        f"{name:>10} K={run['k']}: median {run['median_session_s']:7.2f} s, "
        f"p90 {run['p90_session_s']:7.2f} s, "
        f"{run['tokens_per_s']:6.2f} tok/s, cache {run['cache_share']:.2f}"
        + ("" if shared is None else f", {shared} sequences per pass"),
        flush=True,
    )


def server_run(
    name: str, tokenizer: Any, n_new: int, traces: Sequence[Any]
) -> Callable[[System, str, int], dict]:
    """How server system ``name`` runs k sessions: vLLM by prompt ids, agentspec's servers by chat."""
    if name == "vllm_spec":
        return lambda system, model, k: run_completions(system, model, tokenizer, k, n_new, traces)
    return lambda system, model, k: run_k(system, model, k, n_new, traces)


def measure_servers(
    name: str, ks: list[int], run: Callable[[System, str, int], dict], dtype: str, log_dir: Path
) -> list[dict] | str:
    """``run(system, model, k)`` for each k on a freshly started system ``name``, or why it cannot run."""
    with running(SERVERS[name], log_dir, dtype) as system:
        if isinstance(system, str):
            return system
        model = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused").models.list().data[0].id
        warm(system, model)
        runs = []
        for k in ks:
            runs.append(run(system, model, k))
            report(name, runs[-1])
        return runs


def measure(
    names: list[str],
    ks: list[int],
    n_new: int,
    dtype: str,
    traces: Sequence[Any],
    tokenizer: Any,
    load_factor: str = "default",
) -> tuple[dict, dict]:
    """The runs of each system that can run here, one system after another, and why the others
    were skipped."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    print(f"servers' logs in {log_dir}", flush=True)
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if name in ("inprocess", "sequential"):
            runs[name] = []
            for k in ks:
                runs[name].append(run_pair(name, dtype, k, n_new, traces, load_factor))
                report(name, runs[name][-1])
            continue
        got = measure_servers(name, ks, server_run(name, tokenizer, n_new, traces), dtype, log_dir)
        if isinstance(got, str):
            skipped[name] = got
            print(f"{name}: skipped, {got}", flush=True)
        else:
            runs[name] = got
    return runs, skipped


def by_history(run: dict[str, Any]) -> Iterator[tuple[tuple, dict]]:
    """(key of the history it answers, turn) of every turn of ``run``."""
    for s in run["sessions"]:
        for n, t in enumerate(s["turns"]):
            yield reply_key(s, n), t


def mark(turn: dict[str, Any], solo: dict[str, Any] | None) -> dict[str, bool] | None:
    """``turn``'s ``same_as_solo``: its reply and its prompt length each equal to the solo turn's
    (None where there is no solo turn for its history)."""
    turn["same_as_solo"] = None
    if solo is not None:
        same_reply = (turn["text"], turn["tool_calls"]) == (solo["text"], solo["tool_calls"])
        turn["same_as_solo"] = {
            "reply": same_reply,
            "prompt_tokens": turn["prompt_tokens"] == solo["prompt_tokens"],
        }
    return turn["same_as_solo"]


def compare_with_solo(runs: dict[str, list[dict]]) -> None:
    """Mark every turn against the sequential run's turn for the same history, and count per run
    (``same_as_solo``: replies equal, prompt lengths equal, turns compared)."""
    solo = {key: t for run in runs.get(REFERENCE, []) for key, t in by_history(run)}
    for system_runs in runs.values():
        for run in system_runs:
            marks = [m for key, t in by_history(run) if (m := mark(t, solo.get(key))) is not None]
            run["same_as_solo"] = {
                "replies": sum(m["reply"] for m in marks),
                "prompt_tokens": sum(m["prompt_tokens"] for m in marks),
                "turns": len(marks),
            }


def goals(runs: dict[str, list[dict]], k: int = GOAL_K) -> dict[str, Any]:
    """Issue 28's goals at ``k`` where their systems ran."""
    at = {(name, run["k"]): run for name, system_runs in runs.items() for run in system_runs}
    out: dict[str, Any] = {}
    for name, a, b, field, op, bound in GOALS:
        if (a, k) in at and (b, k) in at:
            value = at[a, k][field] / at[b, k][field]
            met = value >= bound if op == ">=" else value <= bound
            out[f"k{k}_{name}"] = {"value": round(value, 3), "goal": f"{op} {bound}", "met": met}
    if ("inprocess", k) in at:
        same = at["inprocess", k]["same_as_solo"]
        value = [same["replies"], same["turns"]]
        out[f"k{k}_inprocess_replies_as_solo"] = {"value": value, "met": 0 < same["turns"] == same["replies"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--systems",
        default="inprocess,sequential,serve,vllm_spec",
        help=f"comma-separated, of {', '.join(SYSTEMS)}",
    )
    ap.add_argument("--k", default="1,2,4,8,16", help="comma-separated session counts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--traces", default=None, help="comma-separated trace names (default: all)")
    ap.add_argument(
        "--load-factor",
        default="default",
        help='the in-process pair\'s Scheduler.load_factor: "default", "none" or a number',
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/concurrency.json")
    args = ap.parse_args(argv)
    names, ks = args.systems.split(","), [int(k) for k in args.k.split(",")]
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    traces = [t for t in TRACES if args.traces is None or t.name in args.traces.split(",")]
    # the in-process pair gets what the serve worker gets: a thread per CPU (agentspec_worker)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    pair = agentspec.load_pair(dtype=args.dtype)
    env, tokenizer = environment(pair), pair.tokenizer  # at the start: the commit, the machine, the load
    del pair  # each in-process run loads a fresh one
    runs, skipped = measure(names, ks, args.max_new_tokens, args.dtype, traces, tokenizer, args.load_factor)
    compare_with_solo(runs)
    result = {
        "benchmark": "K concurrent agent sessions: in process, sequential, agentspec serve, vLLM, fleet",
        "environment": env,
        "dtype": args.dtype,
        "systems": {name: SYSTEMS[name] for name in names},
        "skipped": skipped,
        "k": ks,
        "traces": [t.name for t in traces],
        "max_new_tokens": args.max_new_tokens,
        "reference": REFERENCE,
        "goals": goals(runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if runs:
        plot(result, args.out.with_suffix(".png"), title=f"Agent sessions at once, {args.dtype}")
    summary_rows = {
        n: [(r["k"], r["median_session_s"], r["tokens_per_s"], r["same_as_solo"]["replies"]) for r in rs]
        for n, rs in runs.items()
    }
    print(
        json.dumps(
            {"goals": result["goals"], "k_median_tok_s_same": summary_rows, "skipped": skipped}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
