"""A pass in the pass thread beside another thread's idle OpenMP pool, and with that pool let go
(``agentspec.threads``), per dtype, side by side in one run.

Run from the repository root, with the machine to itself (about 2 minutes on 2 cores):

    python -m benchmarks.probes.thread_pools [--dtypes bfloat16,float32] [--rounds 8]
        [--out benchmarks/results/thread_pools.json]

The embedded target (``load_pair(dtype=..., warm_up=False)``) holds 400 random tokens; a one-row
pass over them (rolled back after each) runs in a thread of its own, as the scheduler's passes do,
while the main thread waits. Two ways, in blocks of passes whose order turns each round:

- ``pool_kept``: the main thread ran a parallel op (a 1024x1024 matmul) before the block, so its
  OpenMP workers are alive and idle, as a caller's are after it restored a prefix;
- ``pool_released``: the same, then ``agentspec.threads.release_pool()`` in the main thread.

Then agentspec's plain decoding step (``generate(speculative=False)``: passes in the scheduler's
thread, the caller waiting) against the bare pass in the main thread, as ``bench_pass`` measures them:
(time of 21 new tokens - time of 1) / 20. Writes JSON (per way: median, min, max ms) and prints it.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

import agentspec
from agentspec.bench import passes
from agentspec.bench.run import environment
from agentspec.threads import release_pool
from benchmarks.bench_pass import prompt_ids

ROOT = Path(__file__).resolve().parents[2]
CACHE_LEN = 400
BLOCK = 5  # passes per block; a block's first is dropped (the pool it may have to build)


class PassThread:
    """A thread that runs what it is given while the caller waits, as the scheduler's does."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="bench-pass").start()

    def _run(self) -> None:
        while True:
            self.results.put(self.jobs.get()())

    def __call__(self, fn):
        self.jobs.put(fn)
        return self.results.get()


def block_ms(state, new: list[int]) -> list[float]:
    """ms of each one-row pass of a block (the first dropped), the cache rolled back after each."""
    times = []
    with torch.inference_mode():
        for _ in range(BLOCK):
            times.append(passes.timed_ms(lambda: state.forward(new[:1], keep=1), state.model.device))
            state.truncate(CACHE_LEN)
    return times[1:]


def pools(state, new: list[int], rounds: int) -> dict[str, list[float]]:
    worker = PassThread()
    spare = torch.randn(1024, 1024)
    times: dict[str, list[float]] = {"pool_kept": [], "pool_released": []}
    for r in range(rounds):
        for way in list(times)[r % 2 :] + list(times)[: r % 2]:
            spare @ spare  # the main thread's pool, alive
            if way == "pool_released":
                release_pool()
            times[way] += worker(lambda: block_ms(state, new))
    worker(release_pool)  # its pool would slow the passes measured after these
    return times


def plain_step(pair, rounds: int) -> dict[str, Any]:
    """agentspec's plain decoding step against a bare one-row pass in this thread, ms, round by round."""
    ids = prompt_ids(pair.tokenizer)
    state, new = passes.random_state(pair.target_forward, len(ids), 1)

    def call(m: int) -> float:
        t0 = time.perf_counter()
        agentspec.generate(pair, ids, None, False, max_new_tokens=m, speculative=False,
                           eos_token_ids=frozenset())  # fmt: skip
        return time.perf_counter() - t0

    call(2)
    steps, bare = [], []
    for _ in range(rounds):
        steps.append((call(21) - call(1)) / 20 * 1e3)
        with torch.inference_mode():
            for _ in range(3):
                bare.append(passes.timed_ms(lambda: state.forward(new[:1], keep=1), pair.device))
                state.truncate(len(ids))
    return {"plain_step": steps, "bare_pass_main_thread": bare}


def run_dtype(dtype: str, rounds: int) -> dict[str, Any]:
    pair = agentspec.load_pair(dtype=dtype, warm_up=False)
    state, new = passes.random_state(pair.target_forward, CACHE_LEN, 1)
    result: dict[str, Any] = {"environment": environment(pair)}
    times = {**pools(state, new, rounds), **plain_step(pair, max(3, rounds // 2))}
    result["ways"] = {way: passes.summary(t) for way, t in times.items()}
    w = result["ways"]
    result["kept_over_released"] = w["pool_kept"]["median_ms"] / w["pool_released"]["median_ms"]
    result["plain_step_over_bare_pass"] = (
        w["plain_step"]["median_ms"] / w["bare_pass_main_thread"]["median_ms"]
    )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "thread_pools.json")
    args = ap.parse_args(argv)
    result = {"settings": {"rounds": args.rounds, "block": BLOCK, "cache_len": CACHE_LEN}, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        print(f"{dtype} ...", flush=True)
        result["dtypes"][dtype] = run_dtype(dtype, args.rounds)
        print(json.dumps({k: v for k, v in result["dtypes"][dtype].items() if k != "environment"}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
