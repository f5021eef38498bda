"""A long prompt joining calls that are decoding: how much it stalls them, per prefill chunk size.

Run from the repository root, with the machine to itself (a few minutes on 2 CPU cores):

    python -m benchmarks.bench_join [--chunks 0,256,64,32] [--prompt-tokens 4000] [--calls 4]

``--calls`` calls (plain greedy decoding, so every pass gives each one token) start together on the
embedded pair; once each has its first ``--warm`` tokens, a call with a ``--prompt-tokens`` prompt
joins. The scheduler feeds that prompt ``prefill_chunk`` tokens a pass beside the others' rows
(0: the whole prompt in one pass). Per chunk size: the running calls' time between tokens (median
and p90 over all their tokens; issue 28's goal is p90 within 2x the median), the longest gap, and
the joining call's time to first token. Every output is compared with the same call alone.
Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import agentspec  # noqa: E402
from agentspec.bench.run import environment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "Explain how a hash map handles collisions.",
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system with one fact each.",
    "Describe how to make bread at home.",
    "What are the rules of chess for the knight and the bishop?",
    "Summarise the causes of the French Revolution.",
    "How does a bicycle stay upright?",
    "Give advice for a first marathon.",
]


def prompt_ids(pair, text: str) -> list[int]:
    return pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


def long_prompt(pair, tokens: int) -> list[int]:
    """A chat prompt of about ``tokens`` tokens: a document to summarise."""
    words = " ".join(
        f"Item {i}: the shipment of part {i * 7 % 97} arrived on day {i % 31}." for i in range(tokens)
    )
    ids = prompt_ids(pair, "Summarise this log.\n" + words)
    head = ids[: tokens - 8]
    return head + ids[-8:]  # the chat template's end, so the model answers


def token_times(steps: list) -> list[float]:
    """Each output token's time since the one before it (a pass's tokens share its interval)."""
    out = []
    for prev, step in zip(steps, steps[1:]):
        gap = (step.started + step.seconds) - (prev.started + prev.seconds)
        out += [gap / max(1, len(step.tokens))] * len(step.tokens)
    return out


def one_run(pair, prompts: list[list[int]], joiner: list[int], n_new: int, warm: int) -> dict[str, Any]:
    """The calls started together, the long prompt joining once each has ``warm`` tokens."""
    steps: list[list] = [[] for _ in prompts]
    warmed = threading.Barrier(len(prompts) + 1)

    def call(i: int) -> None:
        reached = False
        for step in agentspec.stream(pair, prompts[i], None, False, max_new_tokens=n_new, speculative=False):
            steps[i].append(step)
            if not reached and sum(len(s.tokens) for s in steps[i]) >= warm:
                reached = True
                warmed.wait()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    warmed.wait()
    t0 = time.perf_counter()
    joined = list(agentspec.stream(pair, joiner, None, False, max_new_tokens=8, speculative=False))
    ttft = joined[0].started + joined[0].seconds - t0
    for t in threads:
        t.join()
    gaps = [g for s in steps for g in token_times(s)]
    return {
        "outputs": [[t for s in st for t in s.tokens] for st in steps],
        "joiner_output": [t for s in joined for t in s.tokens],
        "median_ms": statistics.median(gaps) * 1e3,
        "p90_ms": statistics.quantiles(gaps, n=10)[-1] * 1e3,
        "max_ms": max(gaps) * 1e3,
        "joiner_ttft_s": ttft,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="0,256,64,32", help="prefill chunk sizes (0: no chunking)")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--warm", type=int, default=8, help="tokens each call has when the long prompt joins")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/join.json")
    args = ap.parse_args(argv)
    pair = agentspec.load_pair()
    prompts = [prompt_ids(pair, q) for q in QUESTIONS[: args.calls]]
    joiner = long_prompt(pair, args.prompt_tokens)
    solo = [
        agentspec.generate(pair, p, None, False, max_new_tokens=args.max_new_tokens).token_ids
        for p in prompts
    ]
    runs = {}
    for chunk in [int(c) for c in args.chunks.split(",")]:
        pair.scheduler.prefill_chunk = chunk or pair.max_context
        run = one_run(pair, prompts, joiner, args.max_new_tokens, args.warm)
        run["identical_to_alone"] = run.pop("outputs") == solo
        run["p90_over_median"] = run["p90_ms"] / run["median_ms"]
        runs[str(chunk)] = run
        print(
            f"chunk {chunk}: {json.dumps({k: v for k, v in run.items() if k != 'joiner_output'})}", flush=True
        )
    result = {
        "benchmark": "a long prompt joining decoding calls, per prefill chunk size",
        "environment": environment(pair),
        "calls": args.calls,
        "prompt_tokens": len(joiner),
        "max_new_tokens": args.max_new_tokens,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
