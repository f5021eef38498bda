"""One model pass over a few new rows after a cached prefix: timed, and profiled into where its time goes.

A verify pass feeds the target k new tokens after the cached ones and keeps a logits row for each
(``ModelState.forward(ids, keep=k)``), then the loop rolls the cache back to what was verified. Here
the cache holds random tokens (speed does not depend on which), every pass is rolled back to it,
and the row counts take turns round by round, so drift on a shared machine hits them all alike.

The profile groups the ops the pass calls from Python (the top level under the pass; each op's time
includes the ops it calls itself) into categories by name. What the ops do not account for is the
pass's own Python ("outside ops") on a CPU; on a GPU it is the time the device waits for launches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from agentspec.bench import runs
from agentspec.kv import ModelState

# fmt: off
# categories of a top-level op by substrings of its lower-cased name, first match wins; "kv_cache"
# holds the cache's appends (``GrowingLayer`` writes with copy_, transformers' own layers cat) and
# also the rotary embedding's small cat
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("linear", ("linear", "addmm", "aten::mm", "matmul", "mkldnn", "onednn", "_weight_int")),
    ("attention", ("attention", "sdpa", "softmax", "bmm")),
    ("norm", ("rms_norm", "layer_norm", "pow", "mean", "rsqrt", "var")),
    ("kv_cache", ("cat", "copy_", "index_copy", "slice_scatter", "index_put")),
    ("elementwise", ("add", "mul", "sub", "div", "silu", "neg", "cos", "sin", "exp", "gelu", "to",
                     "where", "masked_fill", "clamp", "tanh", "sigmoid")),
]
# fmt: on
OUTSIDE = "outside_ops"
RANGE = "agentspec.bench.pass"  # the profiler range around each profiled pass


def category(op: str) -> str:
    name = op.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of ``fn()``: CUDA events around it on a GPU (its queue drained first), the wall
    clock on a CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def random_state(forward, cache_len: int, new_rows: int, seed: int = 0) -> tuple[ModelState, list[int]]:
    """A ``ModelState`` over ``forward`` (a pair's ``target_forward``; a bare model runs transformers'
    forward) holding ``cache_len`` random tokens, and ``new_rows`` random ids to feed after them."""
    gen = torch.Generator().manual_seed(seed)
    state = ModelState(forward)
    ids = torch.randint(0, state.model.config.vocab_size, (cache_len + new_rows,), generator=gen).tolist()
    if cache_len:
        with torch.inference_mode():
            state.forward(ids[:cache_len], keep=1)
    return state, ids[cache_len:]


def pass_times(forward, cache_len: int, rows: list[int], repeats: int) -> dict[int, list[float]]:
    """ms of each pass over k new rows after ``cache_len`` cached, per k: ``repeats`` rounds after one
    warm-up round (dropped), the k rotating from round to round, the cache rolled back after each."""
    state, new = random_state(forward, cache_len, max(rows))
    times: dict[int, list[float]] = {k: [] for k in rows}
    with torch.inference_mode():
        for r in range(repeats + 1):
            for k in rows[r % len(rows) :] + rows[: r % len(rows)]:
                ms = timed_ms(lambda k=k: state.forward(new[:k], keep=k), state.model.device)
                state.truncate(cache_len)
                if r:
                    times[k].append(ms)
    return times


def linears_alone(lean, repeats: int) -> list[float]:
    """ms of one row through every linear of a pass (``lean.LeanForward.linears``: the computations
    a pass runs them by), back to back with nothing between: what a pass on these kernels would take
    if all else were free, the ceiling of its fraction of the bandwidth bound. Between a pass's
    linears, its other ops find the CPU's caches emptied by the weights' reads. ``repeats`` runs after
    one dropped."""
    chain = lean.linears()
    weight = chain[-1][1].weight
    inputs = {
        width: torch.randn(1, 1, width, dtype=weight.dtype, device=weight.device)
        for width in {linear.in_features for _, linear in chain}
    }

    def run() -> None:
        for product, linear in chain:
            product(inputs[linear.in_features])

    with torch.inference_mode():
        return [timed_ms(run, weight.device) for _ in range(repeats + 1)][1:]


def summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def _top_level(event) -> Iterator[Any]:
    """The ops called directly under ``event`` (a ``record_function`` range), through any ranges
    nested in it."""
    for child in event.cpu_children:
        if child.name.startswith(("aten::", "mkldnn::", "onednn::", "torch_ipex::", "agentspec::")):
            yield child
        else:
            yield from _top_level(child)


def profile_passes(forward, cache_len: int, k: int, count: int) -> dict[str, Any]:
    """Where the time of a pass over k new rows goes: ``count`` passes under ``torch.profiler``,
    the top-level ops' times (device time on a GPU) summed by ``category`` and by op, per pass; and
    what they ran (``ran``: kernels, the attention kernel SDPA took; ``agentspec.bench.runs``).
    ``cache_len`` 0: a prefill of k rows."""
    from torch.profiler import ProfilerActivity, profile, record_function

    state, new = random_state(forward, cache_len, k)
    device = state.model.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls = []
    with torch.inference_mode():
        state.forward(new, keep=k)  # warm-up
        state.truncate(cache_len)
        with profile(activities=activities) as prof:
            for _ in range(count):
                with record_function(RANGE):
                    walls.append(timed_ms(lambda: state.forward(new, keep=k), device))
                state.truncate(cache_len)
    ran = runs.read(prof.events(), device.type == "cuda").per(count)
    ran.pop("syncs_per_pass"), ran.pop("syncs")  # each timed pass waits for the device on purpose
    return breakdown(prof.events(), walls, device) | {"ran": ran}


def breakdown(events, walls: list[float], device: torch.device) -> dict[str, Any]:
    """Per-pass ms by category and by op from a profile's events, and the share of the wall time
    (``walls``, one per pass) that no op accounts for."""
    by_op: dict[str, float] = {}
    for ev in events:
        if ev.name != RANGE:
            continue
        for op in _top_level(ev):
            us = op.device_time_total if device.type == "cuda" else op.cpu_time_total
            by_op[op.name] = by_op.get(op.name, 0.0) + us / 1e3 / len(walls)
    wall = statistics.mean(walls)
    by_cat: dict[str, float] = {}
    for op, ms in by_op.items():
        by_cat[category(op)] = by_cat.get(category(op), 0.0) + ms
    by_cat[OUTSIDE] = wall - sum(by_op.values())
    by_cat = dict(sorted(by_cat.items(), key=lambda kv: -kv[1]))
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return {
        "passes": len(walls),
        "wall_ms_per_pass": wall,  # profiled: the profiler's own overhead included
        "time": "device" if device.type == "cuda" else "cpu",
        "categories_ms": {c: round(ms, 4) for c, ms in by_cat.items()},
        "categories_share": {c: round(ms / wall, 4) for c, ms in by_cat.items()},
        "top_ops": [
            {"op": op, "category": category(op), "ms": round(ms, 4), "share": round(ms / wall, 4)}
            for op, ms in top
        ],
    }
