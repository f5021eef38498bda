"""The target's one-row step under torch.compile's CPU backend beside the library's eager pass (issue
29, item 2: "compiled buckets"), measured before building it.

Run from the repository root, with the machine to itself (about 5 minutes on 2 cores):

    python -m benchmarks.probes.compiled_step [--configs bfloat16:default,bfloat16:freezing,float32:default]
        [--rounds 12] [--warm-cache] [--out benchmarks/results/compiled_step.json]

Each config runs in a fresh process with an empty inductor cache (a user's first load); with
``--warm-cache``, then again in another fresh process over the cache the first one filled (a later load
on the same machine: what a compile paid once per machine would cost each load). The embedded
target (``load_pair(dtype=..., warm_up=False)``) holds 400 random tokens. ``step`` is the lean forward's
one-row math as a plain function over explicit KV buffers (``agentspec.lean``'s weights and rotary),
the keys and values written in place at ``held``, attention over the first ``held + 1`` rows with
SDPA's grouped heads: the shape a compiled bucket would take over issue 24's layout. Three ways, in
blocks whose order turns each round (ms of a pass, best of 3 a block, median over rounds):

- ``library``: the library's pass (``ModelState.forward``: the lean forward, prepacked bfloat16 linears);
- ``step_eager``: ``step`` uncompiled (``F.linear``, no prepacking);
- ``step_compiled``: ``torch.compile(step, dynamic=True)`` with inductor's
  ``emulate_precision_casts`` (each op rounds as eager does); ``freezing`` also folds the weights in
  as constants, which lets inductor prepack them for oneDNN.

Also: seconds of the first compiled call (the compile) and of a call at a new KV length (a
recompile, where dynamic shapes did not hold), and the largest logit difference from the library's
pass (0: the same bits). Writes JSON and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE_LEN = 400
CAPACITY = 1024  # the KV buffers' rows


def child(dtype: str, mode: str, rounds: int) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor
    import torch.nn.functional as F

    import agentspec
    from agentspec.bench import passes
    from agentspec.bench.run import environment
    from agentspec.lean import _rotate, rms_norm

    inductor.emulate_precision_casts = True
    inductor.freezing = mode == "freezing"
    pair = agentspec.load_pair(dtype=dtype, warm_up=False)
    lean = pair.target_forward
    heads, kv_heads, dim = lean.heads, lean.kv_heads, lean.head_dim

    def step(ids, positions, keys: list, values: list, held: int):
        x = lean.embed(ids)
        rope = lean.rope(x, positions)
        b, t, _ = x.shape
        for layer, k_buf, v_buf in zip(lean.layers, keys, values):
            h = rms_norm(x, layer.norm1, layer.eps1, layer.doubled1)
            qkv = F.linear(h, layer.qkv.weight, layer.qkv.bias)
            qk = _rotate(qkv[..., : (heads + kv_heads) * dim].view(b, t, heads + kv_heads, dim), *rope)
            v = qkv[..., (heads + kv_heads) * dim :].view(b, t, kv_heads, dim).transpose(1, 2)
            k_buf[:, :, held : held + t] = qk[:, :, heads:].transpose(1, 2)
            v_buf[:, :, held : held + t] = v
            q = qk[:, :, :heads].transpose(1, 2)
            a = F.scaled_dot_product_attention(
                q, k_buf[:, :, : held + t], v_buf[:, :, : held + t], enable_gqa=True, scale=lean.scaling
            )
            x = x + F.linear(a.transpose(1, 2).reshape(b, t, heads * dim), layer.o_proj.weight)
            h = rms_norm(x, layer.norm2, layer.eps2, layer.doubled2)
            gate, up = F.linear(h, layer.gate_up.weight).split(layer.intermediate, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_proj.weight)
        return F.linear(lean.final_norm(x)[:, -1:], lean.lm_head.weight)

    model = pair.target
    state, new = passes.random_state(pair.target_forward, CACHE_LEN, 1)
    shape = (1, kv_heads, CAPACITY, dim)
    keys = [torch.zeros(shape, dtype=model.dtype) for _ in lean.layers]
    values = [torch.zeros(shape, dtype=model.dtype) for _ in lean.layers]
    for layer, k, v in zip(state.cache.layers, keys, values):
        k[:, :, :CACHE_LEN], v[:, :, :CACHE_LEN] = layer.keys, layer.values
    ids, at = torch.tensor([new[:1]]), torch.tensor([[CACHE_LEN]])
    out: dict[str, Any] = {"dtype": dtype, "mode": mode, "environment": environment(pair)}
    with torch.inference_mode():
        reference = state.forward(new[:1], keep=1).reshape(-1).float()
        state.truncate(CACHE_LEN)
        compiled = torch.compile(step, dynamic=True)
        t0 = time.perf_counter()
        got = compiled(ids, at, keys, values, CACHE_LEN).reshape(-1).float()
        out["compile_s"] = time.perf_counter() - t0
        out["max_abs_logit_diff"] = (got - reference).abs().max().item()
        out["argmax_equal"] = bool(got.argmax() == reference.argmax())
        eager = step(ids, at, keys, values, CACHE_LEN).reshape(-1).float()
        out["eager_max_abs_logit_diff"] = (eager - reference).abs().max().item()
        t0 = time.perf_counter()
        compiled(ids, at + 1, keys, values, CACHE_LEN + 1)
        out["new_length_s"] = time.perf_counter() - t0

        def library():
            state.forward(new[:1], keep=1)
            state.truncate(CACHE_LEN)

        ways = {
            "library": library,
            "step_eager": lambda: step(ids, at, keys, values, CACHE_LEN),
            "step_compiled": lambda: compiled(ids, at, keys, values, CACHE_LEN),
        }
        times: dict[str, list[float]] = {w: [] for w in ways}
        names = list(ways)
        for r in range(rounds):
            for w in names[r % 3 :] + names[: r % 3]:
                ways[w]()
                times[w].append(min(passes.timed_ms(ways[w], model.device) for _ in range(3)))
    out["ms"] = {w: passes.summary(t) for w, t in times.items()}
    out["compiled_over_library"] = out["ms"]["step_compiled"]["median_ms"] / out["ms"]["library"]["median_ms"]
    return out


def run_config(config: str, rounds: int, cache: str) -> dict[str, Any]:
    """One config in a fresh process over the inductor cache directory ``cache``."""
    dtype, mode = config.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "out.json"
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        command = [sys.executable, "-m", "benchmarks.probes.compiled_step", "--child", config,
                   "--rounds", str(rounds), "--out", str(result)]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return {
                "dtype": dtype,
                "mode": mode,
                "status": "error",
                "log_tail": (done.stdout + done.stderr)[-3000:],
            }
        return {"status": "ok", **json.loads(result.read_text())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="bfloat16:default,bfloat16:freezing,float32:default")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument(
        "--warm-cache", action="store_true", help="run each config again over the cache its first run filled"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compiled_step.json")
    args = ap.parse_args(argv)
    if args.child:
        dtype, mode = args.child.split(":")
        args.out.write_text(json.dumps(child(dtype, mode, args.rounds), default=str))
        return 0
    runs = []
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory() as cache:
            for inductor_cache in ("empty", "warm") if args.warm_cache else ("empty",):
                print(f"{config}, inductor cache {inductor_cache} ...", flush=True)
                runs.append({"inductor_cache": inductor_cache, **run_config(config, args.rounds, cache)})
                shown = {k: v for k, v in runs[-1].items() if k != "environment"}
                print(json.dumps(shown, indent=1), flush=True)
    settings = {
        "rounds": args.rounds,
        "cache_len": CACHE_LEN,
        "capacity": CAPACITY,
        "warm_cache": args.warm_cache,
    }
    result = {"settings": settings, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
