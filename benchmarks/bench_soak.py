"""Soak: hundreds of agent calls on one ChatSpecDecode; memory must plateau, latency must not drift.

Run from the repository root (about 8 minutes on 2 CPU cores for the default 500 calls):

    python -m benchmarks.bench_soak [--calls 500] [--max-tokens 16] [--cache-mb 48]

The calls replay the agent conversations of ``agent_traces.py`` (inventory, SQL analytics, code
editing, document Q&A: 22 assistant turns over 300-1,100-token prompts) through the LangChain chat
model, as an agent sends them: tool calls as ``AIMessage.tool_calls``, tool results as
``ToolMessage``s. Each pass over the traces is a new session whose system prompt starts with a
customer header drawn from a pool of 9, so prefixes vary (a header seen before can be restored
from the cache; a new one is prefilled) and the prefix cache, whose budget (--cache-mb) is far
below what the calls would keep, evicts throughout. Calls alternate invoke and stream; the drafter
is the default ("auto", with the embedded distilled draft).

Recorded after every call: resident memory (VmRSS), the prefix cache's bytes, the drafters'
memory (tokens in the pair's suffix tree of earlier outputs), live Python objects, the call's
latency, tokens prefilled, restored from the cache and generated, and decode time per output
token; every --trim-every calls, resident memory again right after glibc's ``malloc_trim`` (what
is live, without the pages the C allocator keeps). The summary compares the last window of calls
with the first (memory, latency per output token) and fits memory slopes over the second half.
Writes JSON (--out) and a PNG next to it: memory over calls with the cache budget, latency per
call with a rolling median.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402

import agentspec  # noqa: E402
from benchmarks.agent_traces import TRACES, calls  # noqa: E402
from benchmarks.bench_core import environment  # noqa: E402
from langchain_agentspec import ChatSpecDecode  # noqa: E402
from langchain_agentspec.tool_parsing import parse_tool_calls  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CUSTOMERS = ["Ada Byrne", "Bo Lindqvist", "Chen Wei", "Dario Russo", "Eve Okafor", "Farah Haddad",
             "Gus Moreau", "Hana Sato", "Ivo Petrov"]  # fmt: skip


def rss_mb() -> float:
    """Resident memory of this process now (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``); False where there is none.

    Resident memory counts pages the allocator keeps after tensors are freed (glibc raises its mmap
    threshold after large frees, so later KV tensors come from a heap that fragments). Measured
    right after a trim, it counts what is live.
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


def to_messages(history: list[dict[str, str]], header: str) -> list:
    """A recorded history as LangChain messages: calls parsed into tool_calls, results as ToolMessages."""
    out: list = []
    pending: list[str] = []  # ids of the last assistant message's calls, answered by tool messages
    for m in history:
        role, content = m["role"], m["content"]
        if role == "system":
            out.append(SystemMessage(f"{header}\n\n{content}"))
        elif role == "user":
            out.append(HumanMessage(content))
        elif role == "assistant":
            parsed = parse_tool_calls(content, None)
            out.append(AIMessage(parsed.content, tool_calls=parsed.tool_calls))
            pending = [c["id"] for c in parsed.tool_calls]
        else:
            out.append(ToolMessage(content, tool_call_id=pending.pop(0) if pending else "call_0"))
    return out


def schedule(n: int, seed: int) -> list[dict[str, Any]]:
    """n calls: passes over every trace's turns, each pass a session with a customer header."""
    rng = random.Random(seed)
    turns = [(t.name, i, history) for t in TRACES for i, (history, _) in enumerate(calls(t))]
    out: list[dict[str, Any]] = []
    session = 0
    while len(out) < n:
        customer = rng.choice(CUSTOMERS)
        header = f"Customer: {customer}."  # a pool of 9 headers: some sessions repeat an earlier one
        for name, i, history in turns:
            out.append({"session": session, "customer": customer, "trace": name, "turn": i,
                        "messages": to_messages(history, header)})  # fmt: skip
        session += 1
    return out[:n]


def windows(values: list[float], size: int) -> list[float]:
    return [statistics.median(values[i : i + size]) for i in range(0, len(values) - size + 1, size)]


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs) if len(xs) > 1 else 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _xy(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["call"], r[key]) for r in rows if r[key] is not None]
    return [x for x, _ in pts], [y for _, y in pts]


def summarise(rows: list[dict[str, Any]], budget_mb: float, window: int) -> dict[str, Any]:
    half = rows[len(rows) // 2 :]
    rss = [r["rss_mb"] for r in rows]
    tpot = [r["ms_per_output_token"] for r in rows if r["ms_per_output_token"] is not None]
    lat = [r["latency_s"] for r in rows]
    first, last = rows[:window], rows[-window:]

    def med(part, key):
        vals = [r[key] for r in part if r[key] is not None]
        return statistics.median(vals) if vals else None

    return {
        "calls": len(rows),
        "cache_budget_mb": budget_mb,
        "cache_mb_max": max(r["cache_mb"] for r in rows),
        "cache_within_budget": all(r["cache_mb"] <= budget_mb for r in rows),
        "rss_mb_first_window_median": statistics.median(rss[:window]),
        "rss_mb_last_window_median": statistics.median(rss[-window:]),
        "rss_mb_max": max(rss),
        "rss_slope_mb_per_100_calls_second_half": 100
        * slope([r["call"] for r in half], [r["rss_mb"] for r in half]),
        "rss_after_trim_mb": [(r["call"], r["rss_after_trim_mb"]) for r in rows if r["rss_after_trim_mb"]],
        "rss_after_trim_slope_mb_per_100_calls_second_half": 100 * slope(*_xy(half, "rss_after_trim_mb")),
        "python_objects_first": rows[0]["python_objects"],
        "python_objects_last": rows[-1]["python_objects"],
        "suffix_tree_tokens_last": rows[-1]["suffix_tree_tokens"],
        "ms_per_output_token_first_window_median": med(first, "ms_per_output_token"),
        "ms_per_output_token_last_window_median": med(last, "ms_per_output_token"),
        "ms_per_output_token_drift": med(last, "ms_per_output_token") / med(first, "ms_per_output_token"),
        "latency_s_first_window_median": med(first, "latency_s"),
        "latency_s_last_window_median": med(last, "latency_s"),
        "latency_window_medians_s": windows(lat, window),
        "ms_per_output_token_window_medians": windows(tpot, window),
        "cached_fraction": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "acceptance_rate": sum(r["accepted"] for r in rows) / max(1, sum(r["drafted"] for r in rows)),
        "draft_failures": sum(r["draft_failures"] for r in rows),
        "evictions": rows[-1]["evictions"],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["call"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    a.plot(x, [r["rss_mb"] for r in rows], label="resident memory (MB)")
    trimmed = [(r["call"], r["rss_after_trim_mb"]) for r in rows if r["rss_after_trim_mb"]]
    if trimmed:
        a.plot(*zip(*trimmed), marker="o", ls="", label="resident memory right after a heap trim (MB)")
    a.plot(x, [r["cache_mb"] for r in rows], label="prefix cache (MB)")
    a.axhline(result["summary"]["cache_budget_mb"], ls="--", c="grey", label="cache budget")
    a.set_ylabel("MB")
    a.legend(loc="center right")
    a.set_title(
        f"Soak: {len(rows)} agent calls on one ChatSpecDecode ({result['environment']['cpu_count']} CPUs)"
    )
    lat = [r["latency_s"] for r in rows]
    b.scatter(x, lat, s=4, alpha=0.4, label="call latency")
    w = result["summary"]["window"]
    roll = [statistics.median(lat[max(0, i - w + 1) : i + 1]) for i in range(len(lat))]
    b.plot(x, roll, c="C3", label=f"rolling median ({w} calls)")
    b.set_ylabel("seconds")
    b.set_xlabel("call")
    b.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cache-mb", type=float, default=48)
    ap.add_argument("--window", type=int, default=50, help="calls per window in the summary")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trim-every", type=int, default=25, help="calls between heap trims (0: never)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    args = ap.parse_args(argv)

    budget = int(args.cache_mb * (1 << 20))
    pair = agentspec.load_pair(prefix_cache_bytes=budget)
    llm = ChatSpecDecode(pair=pair, max_tokens=args.max_tokens)
    env = environment(pair)
    plan = schedule(args.calls, args.seed)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for n, call in enumerate(plan):
        start = time.perf_counter()
        if n % 2:
            reply = None
            for chunk in llm.stream(call["messages"]):
                reply = chunk if reply is None else reply + chunk
        else:
            reply = llm.invoke(call["messages"])
        latency = time.perf_counter() - start
        stats = reply.response_metadata["stats"]
        out = stats["output_tokens"]
        decode_s = stats["total_time_s"] - (stats["time_to_first_token_s"] or 0.0)
        store = pair.tenants.memory().store.index
        rows.append({
            "call": n,
            "session": call["session"],
            "trace": call["trace"],
            "turn": call["turn"],
            "mode": "stream" if n % 2 else "invoke",
            "latency_s": latency,
            "prompt_tokens": stats["prompt_tokens"],
            "cached_tokens": stats["cached_tokens"],
            "output_tokens": out,
            "ms_per_output_token": 1000 * decode_s / (out - 1) if out > 1 else None,
            "drafted": stats["draft_tokens"],
            "accepted": stats["accepted_tokens"],
            "draft_failures": stats["draft_failures"],
            "rss_mb": rss_mb(),
            "cache_mb": pair.prefix_cache.bytes_used / (1 << 20),
            "evictions": pair.prefix_cache.tree.evictions,
            "suffix_tree_tokens": store.live,
            "suffix_tree_dead_entries": store.dead,
            "python_objects": len(gc.get_objects()),
            "rss_after_trim_mb": None,
        })  # fmt: skip
        if (
            args.trim_every
            and (n % args.trim_every == args.trim_every - 1 or n == len(plan) - 1)
            and trim_heap()
        ):
            rows[-1]["rss_after_trim_mb"] = rss_mb()
        if n % 25 == 0 or n == len(plan) - 1:
            r = rows[-1]
            print(f"call {n:4d}  {latency:5.2f} s  rss {r['rss_mb']:7.1f} MB  cache {r['cache_mb']:5.1f} MB  "
                  f"cached {r['cached_tokens']}/{r['prompt_tokens']}", flush=True)  # fmt: skip
    summary = summarise(rows, args.cache_mb, args.window)
    summary["window"] = args.window
    summary["wall_s"] = time.perf_counter() - t_start
    result = {
        "environment": env,
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(
        json.dumps(
            {k: v for k, v in summary.items() if not k.endswith("medians") and "window_medians" not in k},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
