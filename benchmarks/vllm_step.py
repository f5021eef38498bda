"""vLLM's one-row decode step, timed in vLLM's own environment (``bench_pass`` runs it there).

Run with the interpreter of ``.venv-vllm`` (it imports only vLLM, which cannot share agentspec's
environment), as ``bench_pass`` does:

    .venv-vllm/bin/python benchmarks/vllm_step.py --model DIR --dtype float32 --prompt-ids IDS.json \
        --out STEP.json

The offline engine (``vllm.LLM``), no speculation, no prefix caching (every call prefills its whole
prompt), greedy with EOS ignored: one call of ``--new-tokens`` tokens and one of a single token on
the same prompt, alternating for ``--repeats`` rounds after a warm-up; the step is the difference of
their times over the extra tokens (median of each, and best of each). Its threads are vLLM's own:
on a CPU, ``VLLM_CPU_OMP_THREADS_BIND`` in the environment (the caller sets it).

With ``--paced``, the rounds are the caller's: after the warm-up it prints ``READY``, then runs one
round for each ``round`` line on its standard input, printing ``ROUND {"long": s, "short": s}``, until
``quit`` (or the input's end); so ``bench_pass`` times vLLM's rounds between agentspec's, and the
machine's drift over minutes hits both alike. ``--enforce-eager`` skips vLLM's start-up compile
(``torch.compile`` of the model): its eager model, what the compile buys measured beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def timed_call(llm, ids: list[int], n: int) -> float:
    """Seconds of one greedy call of exactly ``n`` new tokens after ``ids``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    got = len(out[0].outputs[0].token_ids)
    assert got == n, f"{got=} {n=}"
    return seconds


def one_round(llm, ids: list[int], n: int, r: int) -> tuple[float, float]:
    """(seconds of the call of ``n`` tokens, of the call of 1), in an order that alternates with ``r``."""
    times = {m: timed_call(llm, ids, m) for m in ((n, 1) if r % 2 else (1, n))}  # drift hits both
    return times[n], times[1]


def rounds_on_stdin(llm, ids: list[int], n: int) -> tuple[list[float], list[float]]:
    """``--paced``: one round per ``round`` line on standard input, each answered on standard output."""
    long, short = [], []
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        a, b = one_round(llm, ids, n, len(long))
        long.append(a)
        short.append(b)
        print("ROUND " + json.dumps({"long": a, "short": b}), flush=True)
    return long, short


def measure(llm, ids: list[int], n: int, repeats: int, paced: bool) -> dict:
    timed_call(llm, ids, 2)  # warm-up
    if paced:
        long, short = rounds_on_stdin(llm, ids, n)
    else:
        long, short = [], []
        for r in range(repeats):
            a, b = one_round(llm, ids, n, r)
            long.append(a)
            short.append(b)
    return {
        "step_ms": (statistics.median(long) - statistics.median(short)) / (n - 1) * 1e3,
        "step_ms_best": (min(long) - min(short)) / (n - 1) * 1e3,
        "call_s": {str(n): long, "1": short},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-ids", type=Path, required=True, help="a JSON list of token ids")
    ap.add_argument("--new-tokens", type=int, default=101)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--memory-utilization", type=float, default=0.25)
    ap.add_argument("--paced", action="store_true", help="rounds on request, on standard input")
    ap.add_argument("--enforce-eager", action="store_true", help="no start-up compile: vLLM's eager model")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch
    import vllm
    from vllm import LLM

    ids = json.loads(args.prompt_ids.read_text())
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.memory_utilization, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, seed=0)  # fmt: skip
    result = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "paced": args.paced,
        "enforce_eager": args.enforce_eager,
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "frontend_torch_threads": torch.get_num_threads(),
        **measure(llm, ids, args.new_tokens, args.repeats, args.paced),
    }
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":  # vllm.LLM starts an engine process: the guard is required
    main()
