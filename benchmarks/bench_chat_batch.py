"""``ChatSpecDecode.batch()`` of short prompts against the same prompts one after another.

Run from the repository root, with the machine to itself (a minute or two on 2 CPU cores):

    python -m benchmarks.bench_chat_batch [--prompts 8] [--max-tokens 48] [--rounds 2]

Issue 28's first measurement: on a fresh pair each, ``batch()`` of N short prompts (LangChain runs
them on a thread pool; the pair's scheduler shares its passes among them) and the same N prompts
invoked one after another. Rounds alternate the order of the two. Greedy; every batched reply is
compared with its sequential one. Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import agentspec  # noqa: E402
from agentspec.bench.run import environment  # noqa: E402
from benchmarks.bench_join import QUESTIONS  # noqa: E402
from langchain_agentspec import ChatSpecDecode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def timed_replies(how: str, prompts: list[str], max_tokens: int) -> tuple[float, list[str], dict]:
    """(seconds, replies, the scheduler's passes and member shares) on a fresh pair."""
    llm = ChatSpecDecode(pair=agentspec.load_pair(), max_tokens=max_tokens)
    llm.invoke("Hi")  # first-call costs out of the timing
    before = (llm.pair.scheduler.stats.passes, llm.pair.scheduler.stats.members)
    t0 = time.perf_counter()
    if how == "batch":
        replies = [m.content for m in llm.batch(prompts, config={"max_concurrency": len(prompts)})]
    else:
        replies = [llm.invoke(p).content for p in prompts]
    seconds = time.perf_counter() - t0
    stats = llm.pair.scheduler.stats
    passes, members = stats.passes - before[0], stats.members - before[1]
    return seconds, replies, {"passes": passes, "calls_per_pass": members / passes if passes else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/chat_batch.json")
    args = ap.parse_args(argv)
    prompts = QUESTIONS[: args.prompts]
    rows: list[dict] = []
    for r in range(args.rounds):
        order = ["batch", "sequential"] if r % 2 == 0 else ["sequential", "batch"]
        got = {how: timed_replies(how, prompts, args.max_tokens) for how in order}
        row = {how: {"seconds": got[how][0], **got[how][2]} for how in order}
        row["replies_identical"] = got["batch"][1] == got["sequential"][1]
        row["sequential_over_batch"] = got["sequential"][0] / got["batch"][0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "benchmark": "ChatSpecDecode.batch() against the same prompts one after another, fresh pairs",
        "environment": environment(agentspec.load_pair()),
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "rounds": rows,
        "median_sequential_over_batch": statistics.median(r["sequential_over_batch"] for r in rows),
        "all_replies_identical": all(r["replies_identical"] for r in rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
