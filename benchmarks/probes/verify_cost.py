"""What a verify pass costs on this CPU, with its large linears computed two ways.

Run from the repository root (about 5 minutes on 2 cores, 7 GB of memory):

    python -m benchmarks.probes.verify_cost

A verify pass feeds the target k new tokens (the last verified one and k - 1 drafted ones) and keeps a
logits row for each. On a CPU, ``F.linear`` (``x @ W.T``) for a few rows against a large weight (the
LM head) runs far slower than for one row; ``W @ x.T`` does not. ``agentspec.linears.PassLinears``
computes passes of 2 to ``linears.FEW_ROWS`` rows the second way. Two measurements, each interleaving the
two ways round by round with a rotating order, so drift on a shared machine hits both alike:

1. The LM head alone (the target's weights, random rows): median ms per k rows.
2. A whole target pass over k new tokens after a 300-token cache (``ModelState.forward``, as the
   decode loop calls it), with ``linears.FEW_ROWS`` set to 1 (off: every pass uses ``F.linear``) and to
   its default (on): median ms per k and the verify-cost curve V(k) = T(k) / T(1).
3. The same for a model with Qwen2.5-7B's shapes but 2 of its 28 layers (random weights, about 6 GB):
   what a 7B target's passes gain, since no 7B model is on this machine; in float32, and in
   bfloat16 with weight-first forced on (``linears.WEIGHT_FIRST_DTYPES``), which shows why it is off there.
4. Single float32 linears of 0.25 to 16.6 MiB (projections of 135M to 7B models), both ways and
   prepacked for oneDNN (``linears.PackedWeight``, as the library's float32 passes now run large ones):
   where weight-first starts to pay, which set ``linears.MIN_WEIGHT_BYTES``, and where the packed copy
   does, which sets ``linears.MIN_PACKED_FLOAT32_BYTES``. Each call takes the next of enough copies of
   the weight to fill ``COLD_BYTES``, so it reads its weight from memory as a pass does (one weight
   called again and again stays in the caches below about 32 MiB, and times another kernel's
   limit). The LM head alone (1.) is timed packed too.

Parts 2 and 3 load their models with no prepacked copies (``linears.PACKED_MEMORY_SHARE`` 0): they
compare the two plain ways; ``benchmarks/bench_pass.py`` times the passes as the library runs them.

Writes JSON (--out) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import torch  # noqa: E402

import agentspec  # noqa: E402
from agentspec import linears  # noqa: E402
from agentspec.bench.workloads import CODE, SEARCH, WEATHER  # noqa: E402
from agentspec.kv import ModelState  # noqa: E402
from agentspec.models import ModelPair  # noqa: E402
from benchmarks.bench_core import environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZES = [1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64]
LARGE_SIZES = [1, 2, 4, 8, 16]
WAYS = {"F.linear": 1, "weight-first": linears.FEW_ROWS}  # the linears.FEW_ROWS each way runs with


def interleaved(ways: list[str], sizes: list[int], repeats: int, once: Callable[[str, int], float]):
    """Median ms of ``once(way, k)`` (seconds) per way and k: the ways alternate within each k and
    the k rotate from round to round, so drift hits all alike; round 0 warms up and is dropped."""
    times: dict[str, dict[int, list[float]]] = {w: {k: [] for k in sizes} for w in ways}
    for r in range(repeats + 1):
        names = ways if r % 2 else ways[::-1]
        for k in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
            for w in names:
                dt = once(w, k)
                if r:
                    times[w][k].append(dt)
    return {w: {k: statistics.median(v) * 1e3 for k, v in per.items()} for w, per in times.items()}


def head_alone(heads: list[torch.nn.Linear], sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of a linear over k random rows, per way: each call takes the next of ``heads`` (copies
    of one shape), so a weight smaller than the caches is read from memory, as in a pass."""
    head = heads[0]
    gen = torch.Generator().manual_seed(0)
    rows = {k: torch.randn(k, head.in_features, generator=gen, dtype=head.weight.dtype) for k in sizes}
    packed = [linears.PackedWeight(h.weight) for h in heads]
    ways = {
        "F.linear": lambda x, i: torch.nn.functional.linear(x, heads[i].weight, heads[i].bias),
        "weight-first": lambda x, i: linears._weight_first(heads[i], x),
        "packed": lambda x, i: packed[i](x, heads[i].bias),
    }
    calls = itertools.count()

    def once(way: str, k: int) -> float:
        i = next(calls) % len(heads)
        t0 = time.perf_counter()
        ways[way](rows[k], i)
        return time.perf_counter() - t0

    with torch.inference_mode():
        return interleaved(list(ways), sizes, repeats, once)


def whole_pass(forward, ids: list[int], sizes: list[int], cache_len: int, repeats: int) -> dict[str, dict]:
    """Median ms of a pass over k new tokens after ``cache_len`` cached ones, per way."""
    assert len(ids) >= cache_len + max(sizes), f"{len(ids)=} too short"
    prefix, new = ids[:cache_len], ids[cache_len : cache_len + max(sizes)]
    state = ModelState(forward)  # a pair's lean forward: its linears weight-first at 2..FEW_ROWS rows
    state.forward(prefix, keep=1)

    def once(way: str, k: int) -> float:
        linears.FEW_ROWS = WAYS[way]
        t0 = time.perf_counter()
        state.forward(new[:k], keep=k)  # a verify pass keeps a logits row per new token
        dt = time.perf_counter() - t0
        state.truncate(cache_len)
        return dt

    try:
        return interleaved(list(WAYS), sizes, repeats, once)
    finally:
        linears.FEW_ROWS = WAYS["weight-first"]


LINEAR_SHAPES = [(256, 256), (128, 896), (320, 960), (576, 576), (1536, 576), (896, 896), (512, 3584),
                 (2048, 2048), (4864, 896)]  # fmt: skip
COLD_BYTES = 128 << 20  # copies of a weight filling this (4 times a 32 MiB L3) are each read from memory


def linears_by_size(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Median ms of single float32 linears (out, in) over k rows, per way, by weight size; each call
    on the next of enough copies to fill COLD_BYTES."""
    rows = []
    for shape in LINEAR_SHAPES:
        copies = -(-COLD_BYTES // (shape[0] * shape[1] * 4))
        lins = [torch.nn.Linear(shape[1], shape[0], bias=False) for _ in range(copies)]
        ms = head_alone(lins, sizes, repeats)
        rows.append({"shape": list(shape), "mib": lins[0].weight.numel() * 4 / 2**20, "copies": copies, **ms})
    return rows


def qwen7b_shaped(dtype: torch.dtype, layers: int = 2):
    """Qwen2.5-7B-Instruct's shapes (hidden 3584, MLP 18944, 28 query and 4 KV heads, 152,064
    tokens, untied head) with ``layers`` layers and random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=layers, num_attention_heads=28, num_key_value_heads=4,
                         tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("head_ms", "LM head alone"), ("pass_ms", f"target pass after {result['cache_tokens']} cached")]
    parts += [(f"large_{d}_ms", f"Qwen2.5-7B shapes, 2 layers, {d}") for d in result.get("large_dtypes", [])]
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4))
    for ax, (part, title) in zip(axes, parts, strict=True):
        for way, per in result[part].items():
            ks = [int(k) for k in per]
            ax.plot(ks, list(per.values()), marker="o", label=way)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens (logits rows)")
        ax.set_ylabel("median ms")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{result['environment'].get('model', '')}: verify cost on this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cache-len", type=int, default=300)
    ap.add_argument("--no-large", action="store_true", help="skip the 7B-shaped model (part 3)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "verify_cost.json")
    args = ap.parse_args(argv)
    linears.PACKED_MEMORY_SHARE = 0.0  # parts 2 and 3 compare the plain ways (see the module doc)
    pair = agentspec.load_pair()
    head = pair.target.get_output_embeddings()
    result: dict[str, Any] = {"environment": environment(pair), "cache_tokens": args.cache_len,
                              "few_rows": linears.FEW_ROWS, "repeats": args.repeats}  # fmt: skip
    print("LM head alone ...", flush=True)
    result["head_ms"] = head_alone([head], SIZES, args.repeats)
    print("whole target passes ...", flush=True)
    ids = pair.tokenizer((WEATHER + CODE + SEARCH) * 4)["input_ids"]
    result["pass_ms"] = whole_pass(pair.target_forward, ids, SIZES, args.cache_len, args.repeats)
    print("single linears by size ...", flush=True)
    result["linears_by_size"] = linears_by_size([1, 2, 4, 8, 16], 3 * args.repeats)
    parts = ["head_ms", "pass_ms"]
    if not args.no_large:
        result["large_dtypes"] = ["float32", "bfloat16"]
        for name in result["large_dtypes"]:
            print(f"7B-shaped passes, {name} ...", flush=True)
            dtype = getattr(torch, name)
            model = qwen7b_shaped(dtype)
            default, linears.WEIGHT_FIRST_DTYPES = linears.WEIGHT_FIRST_DTYPES, {dtype}
            try:
                forward = ModelPair(target=model, tokenizer=None).target_forward  # what building a pair does
                result[f"large_{name}_ms"] = whole_pass(forward, ids, LARGE_SIZES, args.cache_len, 5)
            finally:
                linears.WEIGHT_FIRST_DTYPES = default
            parts.append(f"large_{name}_ms")
            del model
    for part in parts:
        on, off = result[part]["weight-first"], result[part]["F.linear"]
        result[part.replace("_ms", "_speedup")] = {k: off[k] / on[k] for k in on}
        if part != "head_ms":
            result[part.replace("_ms", "_verify_cost_curve")] = {
                w: {k: per[k] / per[1] for k in per} for w, per in result[part].items()
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    for row in result["linears_by_size"]:
        off, on, packed = row["F.linear"], row["weight-first"], row["packed"]
        cells = "  ".join(f"k={k}: {off[k]:.3f} -> {on[k]:.3f} / {packed[k]:.3f}" for k in on)
        print(f"{row['shape']} {row['mib']:.2f} MiB  {cells} ms (F.linear -> weight-first / packed)")
    for part in parts:
        off, on = result[part]["F.linear"], result[part]["weight-first"]
        print(part, "  ".join(f"k={k}: {off[k]:.1f} -> {on[k]:.1f} ms" for k in on))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
