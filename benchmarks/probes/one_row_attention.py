"""One query row's attention on a CPU, per dtype and key count: SDPA over grouped heads against the
query heads folded into rows of their KV head (``attention._folded_one_row``), side by side.

Run from the repository root (about a minute on 2 cores):

    python -m benchmarks.probes.one_row_attention [--keys 400 2000] [--threads 2 1] [--repeats 200]
        [--out benchmarks/results/one_row_attention.json]

The embedded target's shapes (SmolLM2-135M: 9 query heads over 3 KV heads, 64 dims). For each
(threads, dtype, keys), in rounds whose order turns: ``enable_gqa`` (SDPA's own grouped heads, what
transformers' ``sdpa`` attention runs on a CPU), ``repeat_kv`` (the KV heads copied per group
first, outside the timing: the kernel alone) and ``folded`` (one call of G rows a KV head). Reports
median microseconds per call, each form over ``folded``, and whether ``folded``'s output is
bit-identical to ``enable_gqa``'s. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from agentspec.bench.run import environment

ROOT = Path(__file__).resolve().parents[2]
HEADS, KV_HEADS, DIM = 9, 3, 64
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def forms(dtype: torch.dtype, keys: int) -> dict:
    """Each form as a call of no arguments over the same query and keys."""
    gen = torch.Generator().manual_seed(keys)
    q = torch.randn(1, HEADS, 1, DIM, generator=gen).to(dtype)
    k, v = (torch.randn(1, KV_HEADS, keys, DIM, generator=gen).to(dtype) for _ in range(2))
    groups = HEADS // KV_HEADS
    k_rep, v_rep = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    folded = q.reshape(1, KV_HEADS, groups, DIM)
    return {
        "enable_gqa": lambda: sdpa(q, k, v, enable_gqa=True),
        "repeat_kv": lambda: sdpa(q, k_rep, v_rep),
        "folded": lambda: sdpa(folded, k, v).reshape(1, HEADS, 1, DIM),
    }


def median_us(call, repeats: int) -> float:
    for _ in range(10):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(threads: int, dtype: str, keys: int, repeats: int, rounds: int = 3) -> dict:
    torch.set_num_threads(threads)
    calls = forms(DTYPES[dtype], keys)
    names = list(calls)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(median_us(calls[name], repeats))
    us = {name: round(min(v), 1) for name, v in runs.items()}
    return {
        "threads": threads,
        "dtype": dtype,
        "keys": keys,
        "us": us,
        "over_folded": {name: round(us[name] / us["folded"], 2) for name in names},
        "folded_bit_identical": torch.equal(calls["folded"](), calls["enable_gqa"]()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[400, 2000])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/one_row_attention.json")
    args = ap.parse_args(argv)
    rows = []
    for threads in args.threads:
        for dtype in DTYPES:
            for keys in args.keys:
                rows.append(measure(threads, dtype, keys, args.repeats))
                print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
