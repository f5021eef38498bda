"""Verify-pass cost of masked grouped-query attention: ``repeat_kv`` vs ``enable_gqa`` vs the fold.

Run from the repository root (about 3 minutes on one thread):

    OMP_NUM_THREADS=1 python -m benchmarks.probes.attention [--contexts 300 1100] [--repeats 9] [--device cpu]

On the embedded target (SmolLM2-135M-Instruct: 9 query heads share 3 KV heads), after a cache of
each context length, times one forward pass over n = 1, 2, 4, 8, 16 new tokens (rolled back after
each pass) with each attention implementation, interleaved repeat by repeat (the order rotating)
so machine drift hits all alike: transformers' ``sdpa`` (``repeat_kv``: a KV copy per query group
in every layer), ``enable_gqa`` (SDPA's own grouped heads with the mask: CPU kernels take it, CUDA's
fused ones do not) and ``agentspec_sdpa`` (query groups folded into rows). Reports the medians,
T(n)/T(1) per implementation, each one's speed-up over ``sdpa``, and the largest logit difference
from ``sdpa`` on the same pass (0 means bit-identical). Writes JSON.
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
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import agentspec
from agentspec.attention import NAME

ROOT = Path(__file__).resolve().parents[2]
GQA = "enable_gqa"
IMPLS = ("sdpa", GQA, NAME)
SIZES = (1, 2, 4, 8, 16)


def enable_gqa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_kwargs):
    """SDPA over the grouped KV heads with the mask as is (the models here have no softcap or bias)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=attention_mask is None and query.shape[2] > 1,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA, enable_gqa_forward)
AttentionMaskInterface.register(GQA, sdpa_mask)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1100])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/attention.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = agentspec.load_pair(draft_model=False).target.to(device)
    rows = []
    with torch.no_grad():
        for ctx in args.contexts:
            rows += time_context(model, ctx, args.repeats, device)
    result = {
        "benchmark": "attention",
        "model": "SmolLM2-135M-Instruct (embedded), float32",
        "device": str(device),
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


def time_context(model, ctx: int, repeats: int, device: torch.device) -> list[dict]:
    """Rows of medians for each pass size after a cache of ``ctx`` tokens."""
    cache = DynamicCache(config=model.config)
    model(torch.randint(0, 1000, (1, ctx), device=device), cache=cache, use_cache=True)
    times = {(impl, n): [] for impl in IMPLS for n in SIZES}
    diff = {(impl, n): 0.0 for impl in IMPLS for n in SIZES}
    for r in range(repeats + 1):  # the first round warms up
        order = IMPLS[r % len(IMPLS) :] + IMPLS[: r % len(IMPLS)]
        for n in SIZES:
            new = torch.randint(0, 1000, (1, n), device=device)
            logits = {}
            for impl in order:
                model.set_attn_implementation(impl)
                sync(device)
                t0 = time.perf_counter()
                logits[impl] = model(new, cache=cache, use_cache=True).logits
                sync(device)
                if r:
                    times[(impl, n)].append(time.perf_counter() - t0)
                cache.crop(-n)
            for impl in IMPLS:
                d = float((logits[impl] - logits["sdpa"]).abs().max())
                diff[(impl, n)] = max(diff[(impl, n)], d)
    model.set_attn_implementation(NAME)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for n in SIZES:
        row = {"context": ctx, "new_tokens": n}
        for impl in IMPLS:
            row[f"{impl}_ms"] = 1000 * med[(impl, n)]
            row[f"{impl}_verify_ratio"] = med[(impl, n)] / med[(impl, 1)]
            row[f"{impl}_speedup"] = med[("sdpa", n)] / med[(impl, n)]
            row[f"{impl}_max_abs_logit_diff"] = diff[(impl, n)]
        rows.append(row)
        cells = "  ".join(
            f"{impl} {row[impl + '_ms']:6.1f} ms x{row[impl + '_speedup']:.2f} d{diff[(impl, n)]:.1g}"
            for impl in IMPLS
        )
        print(f"ctx {ctx:5d} n {n:2d}: {cells}", flush=True)
    return rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
