"""Prefix cache on vs off on a multi-turn agent conversation, in one run.

    python -m benchmarks.bench_prefix_cache [--max-tokens 32] [--threads N] \
        [--out benchmarks/results/prefix_cache.json]

Replays the scripted conversation of ``agent_conversation.py`` (8 calls over a ~1,100-token
system prompt) with the embedded pair. Each call runs twice, interleaved so machine drift hits both
alike: with the pair's prefix cache, and with ``prefix_cache=False`` (same loop, no reuse). The
answers of the cached run are fed to the next call, and both runs must produce the same tokens.
Writes JSON (per call: time to first token, total time, tokens restored, prefilled) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

import agentspec
from agentspec.bench.conversation import TURNS, messages_for_call, prompt_ids
from benchmarks.plots import finish


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run(max_tokens: int, drafter: str) -> dict:
    pair = agentspec.load_pair(draft_model=False)  # as in the committed results: no draft model
    tok = pair.tokenizer
    agentspec.generate(
        pair, prompt_ids(tok, [{"role": "user", "content": "hi"}]), max_new_tokens=2, prefix_cache=False
    )  # warm-up
    answers: list[str] = []
    calls = []
    for n in range(len(TURNS)):
        ids = prompt_ids(tok, messages_for_call(n, answers))
        row = {"call": n, "prompt_tokens": len(ids)}
        outs = {}
        for mode, cache in (("cache_on", True), ("cache_off", False)):
            t0 = time.perf_counter()
            r = agentspec.generate(pair, ids, drafter, prefix_cache=cache, max_new_tokens=max_tokens)
            wall = time.perf_counter() - t0
            outs[mode] = r
            row[mode] = {
                "ttft_s": r.stats.time_to_first_token_s,
                "total_s": wall,
                "output_tokens": len(r.token_ids),
                "restored_tokens": r.stats.cached_tokens,
                "prefill_tokens": r.stats.prefill_tokens,
                "acceptance_rate": r.stats.acceptance_rate,
            }
        row["identical"] = outs["cache_on"].token_ids == outs["cache_off"].token_ids
        row["ttft_ratio_off_over_on"] = row["cache_off"]["ttft_s"] / row["cache_on"]["ttft_s"]
        answers.append(outs["cache_on"].text)
        calls.append(row)
        print(
            f"call {n}: {len(ids)} prompt tokens, restored {row['cache_on']['restored_tokens']}, "
            f"TTFT {row['cache_on']['ttft_s']:.2f}s vs {row['cache_off']['ttft_s']:.2f}s "
            f"({row['ttft_ratio_off_over_on']:.1f}x), identical={row['identical']}",
            flush=True,
        )
    later = calls[1:]
    on_total = sum(c["cache_on"]["total_s"] for c in calls)
    off_total = sum(c["cache_off"]["total_s"] for c in calls)
    return {
        "benchmark": "prefix_cache",
        "drafter": drafter,
        "max_new_tokens": max_tokens,
        "system_prompt_tokens": len(prompt_ids(tok, messages_for_call(0, [])[:1])),
        "calls": calls,
        "summary": {
            "total_s_cache_on": on_total,
            "total_s_cache_off": off_total,
            "total_ratio": off_total / on_total,
            "ttft_ratio_calls_2_to_n_mean": sum(c["ttft_ratio_off_over_on"] for c in later) / len(later),
            "ttft_ratio_calls_2_to_n_min": min(c["ttft_ratio_off_over_on"] for c in later),
            "all_identical": all(c["identical"] for c in calls),
            "cache_bytes_after": pair.prefix_cache.bytes_used,
            "peak_rss_mb": peak_rss_mb(),
        },
        "environment": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    calls = result["calls"]
    x = [c["call"] + 1 for c in calls]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [c["cache_off"]["ttft_s"] for c in calls], "o-", label="prefix_cache=False")
    ax.plot(x, [c["cache_on"]["ttft_s"] for c in calls], "o-", label="prefix cache on")
    title = "Time to first token across an agent conversation (SmolLM2-135M, CPU)"
    finish(fig, ax, path, xlabel="agent call", ylabel="time to first token (s)", title=title, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.max_tokens, args.drafter)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
