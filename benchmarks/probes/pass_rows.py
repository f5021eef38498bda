"""What a row costs in the passes eight agent sessions run, against the row the compute floor prices.

    python -m benchmarks.probes.pass_rows [--members 8] [--rows 5] [--cached 700] [--out ...]

The concurrency suite's compute floor (``benchmarks.concurrency.compute_floor``) prices every row at
its cost in a 256-row forward from empty. Under K = 8 the scheduler's passes are mostly a few rows of
each of several calls, each after hundreds of cached tokens. On the embedded pair this times, side
by side, the median of 7 of: the floor's 256-row forward; one packed pass of ``--members`` calls,
``--rows`` new rows each (the logits of every row kept, as a verify pass keeps them) after about
``--cached`` cached tokens; the same rows as one sequence after ``--cached``; and the packed pass under
``torch.profiler``, its ops by category (``agentspec.bench.passes``). Writes pass_rows.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from agentspec import load_pair
from agentspec.bench.passes import RANGE, breakdown, random_state
from agentspec.kv import ModelState, PassIds
from agentspec.packed import forward_packed
from benchmarks import harness


def median_s(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(members: int, rows: int, cached: int) -> dict[str, Any]:
    pair = load_pair(dtype=torch.float32)
    forward = pair.target_forward
    lengths = [cached + 13 * i for i in range(members)]  # unequal, as sessions' contexts are
    made = [random_state(forward, n, rows, seed=i) for i, n in enumerate(lengths)]
    states, news = [s for s, _ in made], [n for _, n in made]

    @torch.inference_mode()
    def packed() -> None:
        forward_packed(states, [PassIds(n) for n in news], [rows] * members)
        for state, n in zip(states, lengths):
            state.truncate(n)

    @torch.inference_mode()
    def one_sequence() -> None:
        states[0].forward((news[0] * members)[: rows * members], keep=rows * members)
        states[0].truncate(lengths[0])

    @torch.inference_mode()
    def floor() -> None:
        ModelState(forward).forward([(7 * i) % 1000 + 100 for i in range(256)], keep=1)

    timed = {"floor_256_rows": (floor, 256), "packed": (packed, members * rows)}
    timed["one_sequence"] = (one_sequence, members * rows)
    result: dict[str, Any] = {}
    for name, (fn, n) in timed.items():
        s = median_s(fn)
        result[name] = {"rows": n, "ms": round(s * 1e3, 2), "ms_per_row": round(s * 1e3 / n, 3)}
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            with record_function(RANGE):
                start = time.perf_counter()
                packed()
                walls.append((time.perf_counter() - start) * 1e3)
    result["packed_profile"] = breakdown(prof.events(), walls, torch.device("cpu"))
    floor_row = result["floor_256_rows"]["ms_per_row"]
    result["packed_row_over_floor_row"] = round(result["packed"]["ms_per_row"] / floor_row, 3)
    setup = {"members": members, "rows": rows, "cached": cached}
    return {"environment": harness.environment(pair), **setup, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--cached", type=int, default=700)
    ap.add_argument("--out", type=Path, default=harness.RESULTS / "pass_rows.json")
    args = ap.parse_args()
    harness.set_threads(2)
    harness.write(args.out, probe(args.members, args.rows, args.cached))


if __name__ == "__main__":
    main()
