"""Verify-pass cost with transformers' ``sdpa`` attention vs ``agentspec_sdpa`` (grouped KV heads on CPU).

Run from the repository root (about 2 minutes on one thread):

    OMP_NUM_THREADS=1 python -m benchmarks.bench_attention [--contexts 300 1100] [--repeats 9]

On the embedded target (SmolLM2-135M-Instruct: 9 query heads share 3 KV heads), after a cache of
each context length, times one forward pass over n = 1, 2, 4, 8, 16 new tokens (rolled back after
each pass) with each attention implementation, interleaved repeat by repeat so machine drift hits
both alike; reports the medians, T(n)/T(1) per implementation, the ratio between them, and the
largest logit difference between the two on the same pass (0 means bit-identical). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import agentspec
from agentspec.attention import NAME

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("sdpa", NAME)
SIZES = (1, 2, 4, 8, 16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1100])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/attention.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = agentspec.load_pair(draft_model=False).target
    rows = []
    with torch.no_grad():
        for ctx in args.contexts:
            cache = DynamicCache(config=model.config)
            model(torch.randint(0, 1000, (1, ctx)), cache=cache, use_cache=True)
            times = {(impl, n): [] for impl in IMPLS for n in SIZES}
            diff = {n: 0.0 for n in SIZES}
            for r in range(args.repeats + 1):  # the first round warms up
                for n in SIZES:
                    new = torch.randint(0, 1000, (1, n))
                    logits = {}
                    for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                        model.set_attn_implementation(impl)
                        t0 = time.perf_counter()
                        logits[impl] = model(new, cache=cache, use_cache=True).logits
                        if r:
                            times[(impl, n)].append(time.perf_counter() - t0)
                        cache.crop(-n)
                    diff[n] = max(diff[n], float((logits[IMPLS[0]] - logits[IMPLS[1]]).abs().max()))
            med = {k: statistics.median(v) for k, v in times.items()}
            for n in SIZES:
                rows.append(
                    {
                        "context": ctx,
                        "new_tokens": n,
                        **{f"{impl}_ms": 1000 * med[(impl, n)] for impl in IMPLS},
                        **{f"{impl}_verify_ratio": med[(impl, n)] / med[(impl, 1)] for impl in IMPLS},
                        "speedup": med[("sdpa", n)] / med[(NAME, n)],
                        "max_abs_logit_diff": diff[n],
                    }
                )
                a, b = rows[-1], NAME
                print(
                    f"ctx {ctx:5d} n {n:2d}: sdpa {a['sdpa_ms']:6.1f} ms  {b} {a[b + '_ms']:6.1f} ms  "
                    f"x{a['speedup']:.2f}  V {a['sdpa_verify_ratio']:.2f} -> {a[b + '_verify_ratio']:.2f}  "
                    f"max|dlogit| {diff[n]:.2g}",
                    flush=True,
                )
    result = {
        "benchmark": "attention",
        "model": "SmolLM2-135M-Instruct (embedded), float32",
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "load_average_end": list(os.getloadavg()),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
