"""One pass against the machine's limit and against vLLM, per dtype (issue 29, items 1 and 6).

Run from the repository root, with the machine to itself (about 10 minutes on 2 cores; vLLM's
start-up is a minute or two per dtype):

    python -m benchmarks.bench_pass [--dtypes float32,bfloat16] [--rows 1,5,17] [--cache-len 400]
        [--repeats N] [--no-vllm] [--quick] [--out benchmarks/results/pass.json]

In one run, side by side:

1. Memory bandwidth, STREAM-like, with torch's threads: a copy between two 1 GiB float32 tensors
   (read and written bytes counted) and a read (``sum``) of one (``roofline.read_bandwidth``): far
   larger than the CPU's caches, as a decode step's weights are.
2. Per dtype, the embedded target as the library loads it (``load_pair(dtype=..., draft_model=
   False)``) with ``--cache-len`` random tokens cached: a pass over 1, 5 and 17 new rows
   (``agentspec.bench.passes.pass_times``: rows interleaved round by round, median of --repeats);
   and the default draft's one-token step (the EAGLE head: ``roofline.eagle_step_ms``).
3. Where each pass's time goes: a few passes under ``torch.profiler``, the ops grouped by category
   (linear, attention, norm, elementwise, kv_cache, other) and "outside_ops", the pass's wall time
   that no op accounts for (Python); the top ops too (``passes.profile_passes``).
   The target's passes as the library runs them (``agentspec.lean``'s forward; the weights
   prepacked for oneDNN: bfloat16 ones, and float32 ones of at least
   ``linears.MIN_PACKED_FLOAT32_BYTES``) against transformers' forward, against plain ``F.linear``,
   where its passes attend blocked, against attending row by row, and where its norms are layer
   norms, against ``torch.rms_norm``, and each linear through its forward instead of its packed
   kernel called directly (``variants``, ``linear_paths``), in blocks whose order turns each round.
4. Against the limit: each one-row pass as weight bytes read (``roofline.bytes_per_step``) per
   second over the read bandwidth (issue 29's goal: float32 at least 0.7): the fastest of the reads
   measured at the start and just before and after each dtype's passes (``reads_gb_s``).
   Beside it, the pass's linears alone, back to back (``passes.linears_alone``): the fraction a
   pass could reach on these kernels if nothing else took time; and vLLM's step over the same bound.
5. Baselines after the same 400-token prompt (real text), greedy, never stopping early: a decode
   step of transformers ``generate()`` on the same model, of agentspec's plain decoding
   (``speculative=False``, no prefix cache) and of vLLM (``benchmarks/vllm_step.py --paced`` in
   ``.venv-vllm``: the offline engine, no speculation, no prefix caching, its worker bound to as
   many CPUs as torch has threads here). Each step is (time of 101 new tokens - time of 1) / 100.
   agentspec's and vLLM's rounds are interleaved, which goes first turning each round, and each
   round gives a ratio of the two steps (``steps_side_by_side``): the goal's figure is their median,
   as the machine's drift over minutes (10-20% here) moves both sides of a round alike.

Writes JSON (--out; ``goals`` holds the issue's figures) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

# OpenMP's own waiting, as a user runs it: passive waiting (bench_core.py's default, for a shared
# machine) made a bfloat16 one-row step 1.7x slower here (76.6 against 45.3 ms, issue 29)
import torch

import agentspec
from agentspec import linears
from agentspec.bench import passes, roofline
from agentspec.bench.run import environment
from agentspec.bench.workloads import CODE, SEARCH, WEATHER
from agentspec.drafters.eagle import is_eagle
from agentspec.fleet.vllm import MAX_MODEL_LEN, MEMORY_UTILIZATION, VLLM_PYTHON, cpu_bind
from agentspec.lean import LeanForward
from agentspec.models import ensure_default_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 400
GOAL_FRACTION = 0.7  # float32 one-row pass over the read-bandwidth bound
VLLM_TIMEOUT_S = 900
# linear_paths: passes timed per block, and passes before them dropped; short blocks, many rounds, so
# that the machine's drift (minutes long here) hits every way alike
BLOCK, BLOCK_WARM = 3, 1
BANDWIDTH_MIB = 1024  # the bandwidth tensors: far larger than the CPU's caches


def copy_bandwidth(mib: int, repeats: int) -> dict[str, Any]:
    """Bytes per second of ``b.copy_(a)`` between two ``mib`` MiB float32 tensors, read plus written."""
    a = torch.ones(mib << 18, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)  # touch every page first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    moved = 2 * a.numel() * a.element_size()
    median, best = moved / statistics.median(times) / 1e9, moved / min(times) / 1e9
    return {"bytes": moved, "threads": torch.get_num_threads(), "median_gb_s": median, "best_gb_s": best}


def bandwidth(mib: int, repeats: int) -> dict[str, Any]:
    cpu = torch.device("cpu")
    return {"copy": copy_bandwidth(mib, repeats), "read": roofline.read_bandwidth(cpu, mib, repeats)}


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer((WEATHER + CODE + SEARCH) * 4)["input_ids"]
    assert len(ids) >= PROMPT_TOKENS, f"{len(ids)=}"
    return ids[:PROMPT_TOKENS]


def step_summary(long: list[float], short: list[float], n: int) -> dict[str, Any]:
    """A decode step's ms from calls of n and of 1 new tokens (seconds each): (median n - median 1)
    / (n - 1), and the same from the best of each."""
    return {
        "step_ms": (statistics.median(long) - statistics.median(short)) / (n - 1) * 1e3,
        "step_ms_best": (min(long) - min(short)) / (n - 1) * 1e3,
        "new_tokens": n,
        "repeats": len(long),
    }


def round_of_calls(call, n: int, r: int) -> tuple[float, float]:
    """(seconds of ``call(n)``, of ``call(1)``), in an order that turns with the round ``r``: drift
    hits both alike."""
    times = {m: call(m) for m in ((n, 1) if r % 2 else (1, n))}
    return times[n], times[1]


def step_from_calls(call, n: int, repeats: int) -> dict[str, Any]:
    """A decode step's ms from ``call(m)`` (seconds of a call making m new tokens): ``repeats`` rounds
    of ``round_of_calls`` after a warm-up, as ``step_summary``."""
    call(2)
    long, short = zip(*(round_of_calls(call, n, r) for r in range(repeats)), strict=True)
    return step_summary(list(long), list(short), n)


def hf_step(model, ids: list[int], n: int, repeats: int) -> dict[str, Any]:
    """transformers ``generate()``'s greedy step after ``ids`` (min_new_tokens: it never stops early)."""
    x = torch.tensor([ids], device=model.device)

    def call(m: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=m, min_new_tokens=m)  # fmt: skip
        assert out.shape[1] == len(ids) + m, f"{out.shape=}"
        return time.perf_counter() - t0

    return step_from_calls(call, n, repeats)


def target_passes(pair, args, reads: list[float]) -> dict[str, Any]:
    """The target's pass times per row count, their profiles, and the one-row pass against the bound.

    The bound reads the weights at the fastest read bandwidth the run measured (``reads``, GB/s; this
    phase adds one just before its passes and one just after): a shared machine's noise only slows a
    read, and a single measure here swung 2x within an hour (16.2 against 31.4 GB/s)."""
    model, forward = pair.target, pair.target_forward
    cpu = torch.device("cpu")
    reads.append(roofline.read_bandwidth(cpu, BANDWIDTH_MIB, args.bandwidth_repeats)["median_gb_s"])
    times = passes.pass_times(forward, args.cache_len, args.rows, args.repeats)
    reads.append(roofline.read_bandwidth(cpu, BANDWIDTH_MIB, args.bandwidth_repeats)["median_gb_s"])
    read_gb_s = max(reads)
    n_bytes = roofline.bytes_per_step(model)
    one = statistics.median(times[min(args.rows)])
    lean = isinstance(forward, LeanForward)
    alone = statistics.median(passes.linears_alone(forward, args.repeats)) if lean else None
    return {
        "reads_gb_s": list(reads),
        "bound_read_gb_s": read_gb_s,
        "bytes_per_step": n_bytes,
        "passes": {str(k): passes.summary(v) for k, v in times.items()},
        "ratio_to_1": {str(k): statistics.median(v) / one for k, v in times.items()},
        "bound_ms": n_bytes / read_gb_s / 1e6,
        "achieved_gb_s": n_bytes / one / 1e6,
        "fraction_of_bound": n_bytes / one / 1e6 / read_gb_s,  # 1.0 = at the read-bandwidth floor
        # the pass's linears alone, back to back: the fraction a pass on these kernels could reach
        "linears_alone_ms": alone,
        "linears_alone_fraction_of_bound": n_bytes / alone / 1e6 / read_gb_s if alone else None,
        "profile": {
            str(k): passes.profile_passes(forward, args.cache_len, k, args.profile_passes) for k in args.rows
        },
    }


def draft_step(dtype: str, args, read_gb_s: float) -> dict[str, Any]:
    """The default draft's one-token step (an EAGLE head: its layer and its LM-head rows)."""
    pair = agentspec.load_pair(dtype=dtype)
    draft = pair.draft
    if draft is None:
        return {"status": "no default draft"}
    if is_eagle(draft):
        n_bytes = roofline.eagle_bytes_per_step(draft)
        times = roofline.eagle_step_ms(draft, args.cache_len, args.repeats)
    else:
        n_bytes = roofline.bytes_per_step(draft, pair.target)
        times = passes.pass_times(pair.draft_forward, args.cache_len, [1], args.repeats)[1]
    ms = statistics.median(times)
    return {"name": pair.draft_name, "eagle": is_eagle(draft), "bytes_per_step": n_bytes,
            **passes.summary(times), "fraction_of_bound": n_bytes / ms / 1e6 / read_gb_s}  # fmt: skip


class VllmFailed(RuntimeError):
    """``vllm_step.py --paced`` ended or went silent before answering (``engine``: which one)."""

    def __init__(self, engine: PacedVllm, message: str):
        super().__init__(message)
        self.engine = engine


class PacedVllm:
    """vLLM's decode-step rounds on request: ``benchmarks/vllm_step.py --paced`` in vLLM's environment,
    its worker bound to as many CPUs as torch's threads here. Its output is read on a thread of its
    own (vLLM logs there too, and a full pipe would stall it); idle between rounds, it waits on its
    input."""

    def __init__(self, dtype: str, ids: list[int], args, eager: bool = False):
        self.threads = torch.get_num_threads()
        self.bind = cpu_bind(self.threads)
        self.tmp = tempfile.TemporaryDirectory()
        ids_path, self.out = Path(self.tmp.name) / "ids.json", Path(self.tmp.name) / "step.json"
        ids_path.write_text(json.dumps(ids))
        command = [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_step.py"), "--paced", "--model",
                   str(ensure_default_model()), "--dtype", dtype, "--prompt-ids", str(ids_path),
                   "--new-tokens", str(args.new_tokens), "--max-model-len", str(MAX_MODEL_LEN),
                   "--memory-utilization", str(MEMORY_UTILIZATION), "--out", str(self.out)]  # fmt: skip
        if eager:
            command.append("--enforce-eager")
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": self.bind}
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)  # fmt: skip
        self.log: deque[str] = deque(maxlen=200)
        self.answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith(("READY", "ROUND ")):
                self.answers.put(line)
        self.answers.put(None)  # the process ended

    def _answer(self, timeout: float) -> str:
        try:
            line = self.answers.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            raise VllmFailed(self, "vllm_step.py gave no answer:\n" + "".join(self.log)[-3000:])
        return line

    def ready(self) -> None:
        self._answer(VLLM_TIMEOUT_S)

    def round(self) -> tuple[float, float]:
        """(seconds of its call of the new tokens, of its call of one)."""
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        times = json.loads(self._answer(VLLM_TIMEOUT_S).split(" ", 1)[1])
        return times["long"], times["short"]

    def close(self) -> dict[str, Any]:
        """vLLM's own summary (vllm_step.py's --out), after telling it to quit; {} if it wrote none."""
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        result = json.loads(self.out.read_text()) if self.out.exists() else {}
        self.tmp.cleanup()
        bound = [ln.split("core ids=", 1)[1].strip() for ln in self.log if "core ids=" in ln]
        return {"bind": self.bind, "threads": self.threads, "worker_core_ids": bound[:1], **result}


def steps_side_by_side(pair, ids: list[int], dtype: str, args) -> dict[str, Any]:
    """agentspec's plain decoding step (no drafts, no prefix cache, no EOS: it never stops early) and
    vLLM's (and, with ``--vllm-eager``, vLLM's without its start-up compile), their rounds interleaved:
    each round one call of ``new_tokens`` and one of 1 on each side, which side goes first turning
    each round; a round's step ratio is agentspec's over each vLLM's in that round, so drift over the
    run's minutes cancels in the ratios' median."""

    def call(m: int) -> float:
        t0 = time.perf_counter()
        out = agentspec.generate(pair, ids, None, False, max_new_tokens=m, speculative=False,
                                 eos_token_ids=frozenset())  # fmt: skip
        assert len(out.token_ids) == m, f"{len(out.token_ids)=} {m=}"
        return time.perf_counter() - t0

    n = args.new_tokens
    if args.no_vllm:
        return {"agentspec_plain": step_from_calls(call, n, args.repeats_calls)}
    engines = {name: PacedVllm(dtype, ids, args, eager=name == "vllm_eager") for name in vllm_sides(args)}
    sides = {"agentspec": partial(round_of_calls, call, n)}
    sides.update({name: _engine_round(engine) for name, engine in engines.items()})
    call(2)  # warm-up
    try:
        for engine in engines.values():
            engine.ready()
        rounds = [_round(sides, r) for r in range(args.repeats_calls)]
    except VllmFailed as exc:  # the failed engine's log, and agentspec's steps alone
        failed = {}
        for k, e in engines.items():
            failed[k] = (
                {"status": "error", "log_tail": str(exc)[-3000:]}
                if e is exc.engine
                else {"status": "not timed: another engine failed"}
            )
            failed[k].update(e.close())
        return {"agentspec_plain": step_from_calls(call, n, args.repeats_calls), **failed}
    out = {name: steps_of(rounds, name, n) for name in sides}
    per_round = [{"first": next(iter(x)), **_ratios({k: steps_of([x], k, n)["step_ms"] for k in x})}
                 for x in rounds]  # fmt: skip
    result = {"agentspec_plain": out["agentspec"], "rounds": per_round}
    for name, engine in engines.items():
        result[name] = {"status": "ok", **engine.close(), **out[name]}
        result[_ratio_key(name) + "_median"] = statistics.median(x[_ratio_key(name)] for x in per_round)
    return result


def vllm_sides(args) -> list[str]:
    """The vLLM engines a run times beside agentspec: vLLM as it starts by default (its model
    compiled), and with ``--vllm-eager`` also ``--enforce-eager``."""
    return ["vllm", "vllm_eager"] if args.vllm_eager else ["vllm"]


def _engine_round(engine: PacedVllm) -> Callable[[int], tuple[float, float]]:
    return lambda r: engine.round()


def _round(sides: dict[str, Callable[[int], tuple[float, float]]], r: int) -> dict[str, tuple[float, float]]:
    """One round of every side, in an order turned by ``r``: each side goes first in turn (the last
    one in round 0: with agentspec and vLLM alone, vLLM first in even rounds, as before)."""
    names = list(sides)
    at = (len(names) - 1 - r) % len(names)
    return {name: sides[name](r) for name in names[at:] + names[:at]}


def steps_of(rounds: list[dict[str, tuple[float, float]]], side: str, n: int) -> dict[str, Any]:
    return step_summary([x[side][0] for x in rounds], [x[side][1] for x in rounds], n)


def _ratio_key(engine: str) -> str:
    """The per-round key: "ratio" for agentspec's step over vLLM's, "ratio_eager" over the eager vLLM's."""
    return "ratio" + engine.removeprefix("vllm")


def _ratios(step_ms: dict[str, float]) -> dict[str, float]:
    """A round's step of each side, and agentspec's over each vLLM's."""
    a = step_ms["agentspec"]
    out = {f"{k}_step_ms": v for k, v in step_ms.items()}
    return {**out, **{_ratio_key(k): a / v for k, v in step_ms.items() if k != "agentspec"}}


def variants(dtype: str) -> dict[str, Any]:
    """Loads of the target: as the library runs its passes ("library": ``agentspec.lean``'s forward,
    ``linears.PassLinears``' linears, prepacked for oneDNN), with transformers' forward instead
    ("transformers forward": ``lean_forward=False``, its linears ``F.linear``), with no prepacked copies
    ("F.linear": in float32 the LM head weight-first at 2..``linears.FEW_ROWS`` rows), and where the
    library's passes attend blocked (``attention.blocked_attention``), attending row by row instead ("row
    by row": the path where this CPU's kernel does not keep a row's bits in a blocked call). Each keeps
    its verify rows a one-row step's bits, but its own step's: a blocked one-row call is another sum than
    a row's call alone, so the logits of the two differ by bfloat16's rounding. Where the library's norms
    run as layer norms (``lean.rms_norm``), "rms_norm" runs them through ``torch.rms_norm`` instead. In
    float32, "packed from N MiB" packs only linears of twice ``linears.MIN_PACKED_FLOAT32_BYTES`` and
    more."""
    load = partial(agentspec.load_pair, dtype=dtype, draft_model=False, warm_up=False)
    out = {"library": load(), "transformers forward": load(lean_forward=False)}
    share, linears.PACKED_MEMORY_SHARE = linears.PACKED_MEMORY_SHARE, 0.0
    try:
        out["F.linear"] = load()
    finally:
        linears.PACKED_MEMORY_SHARE = share
    if out["library"].target_forward.blocked_rows is not None:
        out["row by row"] = load()
        out["row by row"].target_forward.blocked_rows = None
    if dtype == "float32":  # where the float32 packing starts: its threshold doubled
        least = linears.MIN_PACKED_FLOAT32_BYTES
        linears.MIN_PACKED_FLOAT32_BYTES = 2 * least
        try:
            out[f"packed from {linears.MIN_PACKED_FLOAT32_BYTES / 2**20:g} MiB"] = load()
        finally:
            linears.MIN_PACKED_FLOAT32_BYTES = least
    if out["library"].target_forward.layers[0].doubled1 is not None:
        out["rms_norm"] = load()
        for layer in out["rms_norm"].target_forward.layers:
            layer.doubled1 = layer.doubled2 = None
    return out


def linear_paths(dtype: str, args) -> dict[str, Any]:
    """The target's passes each way (``variants``) in blocks whose order turns from round to round:
    a bfloat16 model nearly fits this CPU's last-level cache (300 MiB), so two models' passes
    interleaved one by one would each read the other's evictions from memory; each block's first
    passes (the cache filling) are dropped. And the largest logit difference from the library's."""
    pairs = variants(dtype)
    states = {
        n: passes.random_state(p.target_forward, args.cache_len, max(args.rows)) for n, p in pairs.items()
    }
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in args.rows} for name in pairs}
    logits: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for r in range(args.repeats):
            names = list(pairs)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                state, new = states[name]
                for k in args.rows:
                    for i in range(BLOCK + BLOCK_WARM):
                        t0 = time.perf_counter()
                        logits[name] = state.forward(new[:k], keep=k).float()
                        if i >= BLOCK_WARM:
                            times[name][k].append((time.perf_counter() - t0) * 1e3)
                        state.truncate(args.cache_len)
    diffs = {  # the last pass of each: same ids
        name: float((logits["library"] - x).abs().max()) for name, x in logits.items() if name != "library"
    }
    out = {name: {str(k): passes.summary(v) for k, v in t.items()} for name, t in times.items()}
    return {"packed_bytes": pairs["library"].pass_linears.packed_bytes, "max_abs_logit_diff": diffs, **out}


def run_dtype(dtype: str, args, reads: list[float]) -> dict[str, Any]:
    print(f"{dtype}: target passes and profiles ...", flush=True)
    pair = agentspec.load_pair(dtype=dtype, draft_model=False)
    ids = prompt_ids(pair.tokenizer)
    out: dict[str, Any] = {"environment": environment(pair), "target": target_passes(pair, args, reads)}
    read_gb_s = out["target"]["bound_read_gb_s"]
    print(f"{dtype}: the library's passes beside the other ways (variants) ...", flush=True)
    out["linears"] = linear_paths(dtype, args)
    print(f"{dtype}: generate() steps ...", flush=True)
    out["hf_generate"] = hf_step(pair.target, ids, args.new_tokens, args.repeats_calls)
    print(
        f"{dtype}: agentspec's plain steps and vLLM's, interleaved (its start-up a minute or two) ...",
        flush=True,
    )
    out.update(steps_side_by_side(pair, ids, dtype, args))
    del pair
    print(f"{dtype}: draft step ...", flush=True)
    out["draft"] = draft_step(dtype, args, read_gb_s)
    return out


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 29's figures from this run: each one-row step over vLLM's (goal: at most 1.0), and the
    float32 one-row pass's fraction of the bandwidth bound (goal: at least 0.7)."""
    out: dict[str, Any] = {}
    for dtype, r in result["dtypes"].items():
        vllm = r.get("vllm", {}).get("step_ms")
        one = r["target"]["passes"][str(min(result["rows"]))]["median_ms"]
        out[dtype] = {
            "vllm_step_ms": vllm,
            "pass_1_ms": one,
            "agentspec_plain_step_ms": r["agentspec_plain"]["step_ms"],
            "hf_generate_step_ms": r["hf_generate"]["step_ms"],
            "agentspec_plain_over_vllm": r["agentspec_plain"]["step_ms"] / vllm if vllm else None,
            "pass_1_over_vllm": one / vllm if vllm else None,
            "agentspec_plain_over_vllm_rounds_median": r.get("ratio_median"),
            # over vLLM without its start-up compile (--vllm-eager): what the compile buys vLLM
            "agentspec_plain_over_vllm_eager_rounds_median": r.get("ratio_eager_median"),
            "fraction_of_bound": r["target"]["fraction_of_bound"],
            "linears_alone_fraction_of_bound": r["target"]["linears_alone_fraction_of_bound"],
            # vLLM's step read the same weights: its fraction of the same bound
            "vllm_fraction_of_bound": r["target"]["bound_ms"] / vllm if vllm else None,
            "threads": {
                "agentspec": torch.get_num_threads(),
                "vllm_worker_cpus": r.get("vllm", {}).get("bind"),
            },
        }
    if "float32" in out:
        f = out["float32"]["fraction_of_bound"]
        out["float32_fraction_of_bound"] = {"measured": f, "goal": GOAL_FRACTION, "met": f >= GOAL_FRACTION}
    return out


def table(result: dict[str, Any]) -> None:
    bw = result["bandwidth"]
    print(f"bandwidth: copy {bw['copy']['median_gb_s']:.1f} GB/s, read {bw['read']['median_gb_s']:.1f} GB/s")
    for dtype, r in result["dtypes"].items():
        t = r["target"]
        cells = "  ".join(f"{k} rows {p['median_ms']:.1f}" for k, p in t["passes"].items())
        bound = f"bound {t['bound_ms']:.1f} ms, fraction {t['fraction_of_bound']:.2f}"
        print(f"{dtype}: pass ms {cells}; {bound}")
        for k, prof in t["profile"].items():
            shares = ", ".join(f"{c} {s:.0%}" for c, s in prof["categories_share"].items() if s >= 0.01)
            print(f"  {k} rows: {shares}")
        lin = r["linears"]
        ways = [w for w in lin if w not in ("packed_bytes", "max_abs_logit_diff")]  # ``variants``' names
        cells = "  ".join(f"{k} rows " + "/".join(f"{lin[w][k]['median_ms']:.1f}" for w in ways)
                          for k in lin["library"])  # fmt: skip
        print(f"  pass ms, {' / '.join(ways)}: {cells}")
        steps = {"generate()": r["hf_generate"], "agentspec plain": r["agentspec_plain"],
                 "vLLM": r.get("vllm", {}), "vLLM eager": r.get("vllm_eager", {})}  # fmt: skip
        cells = "  ".join(f"{n} {s['step_ms']:.1f}" for n, s in steps.items() if "step_ms" in s)
        print(f"  decode step ms: {cells}; draft step {r['draft'].get('median_ms', float('nan')):.1f}")
        if "rounds" in r:
            ratios = ", ".join(f"{x['ratio']:.3f}" for x in r["rounds"])
            print(f"  agentspec plain step / vLLM's, by round: {ratios}; median {r['ratio_median']:.3f}")
        if "ratio_eager_median" in r:
            ratios = ", ".join(f"{x['ratio_eager']:.3f}" for x in r["rounds"])
            print(f"  ... / vLLM's eager (--enforce-eager): {ratios}; median {r['ratio_eager_median']:.3f}")
        if t["linears_alone_ms"] is not None:
            alone = t["linears_alone_ms"]
            print(f"  linears alone {alone:.1f} ms: fraction {t['linears_alone_fraction_of_bound']:.2f}")
    print(json.dumps(result["goals"], indent=1))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,5,17", help="new rows per pass, comma-separated")
    ap.add_argument("--cache-len", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=15, help="rounds of timed passes")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-eager", action="store_true", help="also vLLM without its start-up compile")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of whole calls (steps)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few repeats, 21 new tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pass.json")
    args = ap.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.rows = [int(k) for k in args.rows.split(",")]
    if args.quick:
        args.repeats = min(args.repeats, 2)
    args.repeats_calls = 1 if args.quick else args.rounds  # rounds of whole calls (decode-step baselines)
    args.new_tokens = 21 if args.quick else 101
    args.profile_passes = 2 if args.quick else 5
    args.bandwidth_repeats = 2 if args.quick else 7
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print("memory bandwidth ...", flush=True)
    bw = bandwidth(BANDWIDTH_MIB, args.bandwidth_repeats)
    reads = [bw["read"]["median_gb_s"]]  # and more, beside each dtype's passes (target_passes)
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": args.rows,
        "prompt_tokens": PROMPT_TOKENS,
        "bandwidth": bw,
        "dtypes": {},
    }
    for dtype in args.dtypes:
        result["dtypes"][dtype] = run_dtype(dtype, args, reads)
    result["environment"] = result["dtypes"][args.dtypes[0]]["environment"]  # each dtype's has its own
    result["goals"] = goals(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
