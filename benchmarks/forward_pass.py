"""One target pass and one decode step against the machine's read-bandwidth bound and vLLM's step, per
dtype; and the host syncs per verify pass.

    python -m benchmarks pass [--dtypes float32,bfloat16] [--rows 1,5,17] [--cache-len 400]
        [--repeats 15] [--rounds 5] [--no-vllm] [--vllm-eager] [--quick]
    python -m benchmarks pass --part syncs [--max-new-tokens 48] [--before CHECKOUT]

Each part writes its key of ``results/pass.json``. With the machine to itself: ~10 minutes on 2 cores.

**pass**, per dtype, the embedded target as the library loads it, ``--cache-len`` random tokens cached:
a pass over each of ``--rows`` new rows (``passes.pass_times``: rows interleaved, median of
``--repeats``), a few under ``torch.profiler`` by op category, and the default draft's (EAGLE) step.
The bound: a 1 GiB read (``roofline.read_bandwidth``; larger than the caches, as a step's weights) at
the start and just before and after each dtype's passes, the fastest taken (noise only slows a read).
``fraction_of_bound``: the one-row pass's weight bytes per second over it (float32 goal >= 0.7), beside
the pass's linears alone, back to back (what these kernels could reach if nothing else took time).
``linears``: the library's passes beside other loads of the model (``variants``), in blocks whose order
turns each round, with each one's largest logit difference from the library's.
Decode steps after a 400-token prompt, greedy, never stopping early: agentspec's plain decoding,
transformers ``generate()`` and vLLM's offline engine (no speculation, no prefix caching, bound to as
many CPUs as torch has threads; ``harness.vllm_step --paced`` run by ``.venv-vllm``'s python). A step
is (seconds of 101 new tokens - of 1) / 100. The sides' calls run in interleaved rounds, which goes
first turning each round; the goal's figure is the median of the rounds' ratios of agentspec's step over
vLLM's (``ratio_median``; goal <= 1.0): the machine's drift over minutes (10-20% here) moves both sides
of a round alike. ``--vllm-eager``: also vLLM without its start-up compile.

**syncs**: host syncs (reads of tensor values, each a wait for the device on a GPU: ``HostSyncs``) per
target pass, each drafter on one chat prompt, greedy and sampled, without and with the prefix cache.
``--before CHECKOUT``: that checkout too, in a process importing its own agentspec, on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
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
from unittest.mock import patch

import torch

import agentspec
from agentspec import linears
from agentspec.bench import passes, roofline
from agentspec.bench.workloads import CODE, SEARCH, WEATHER
from agentspec.drafters.eagle import is_eagle
from agentspec.fleet.vllm import MAX_MODEL_LEN, MEMORY_UTILIZATION, VLLM_PYTHON, cpu_bind
from agentspec.lean import LeanForward
from agentspec.models import ensure_default_model
from benchmarks import harness

PROMPT_TOKENS = 400
GOAL_FRACTION = 0.7  # float32 one-row pass over the read-bandwidth bound
VLLM_TIMEOUT_S = 900
BANDWIDTH_MIB = 1024  # far larger than the CPU's caches
# variants: passes timed per block after BLOCK_WARM dropped; short blocks, many rounds: drift hits all alike
BLOCK, BLOCK_WARM = 3, 1


def read_gb_s(args) -> float:
    return roofline.read_bandwidth(torch.device("cpu"), BANDWIDTH_MIB, args.bandwidth_repeats)["median_gb_s"]


def target_passes(pair, args, reads: list[float]) -> dict[str, Any]:
    """The target's pass times per row count, their profiles, and the one-row pass against the bound
    (the fastest of ``reads``, GB/s, with one read just before the passes and one just after)."""
    forward = pair.target_forward
    reads.append(read_gb_s(args))
    times = passes.pass_times(forward, args.cache_len, args.rows, args.repeats)
    reads.append(read_gb_s(args))
    bound, n_bytes = max(reads), roofline.bytes_per_step(pair.target)
    one = statistics.median(times[min(args.rows)])
    lean = isinstance(forward, LeanForward)
    alone = statistics.median(passes.linears_alone(forward, args.repeats)) if lean else None
    return {
        "reads_gb_s": list(reads),
        "bound_read_gb_s": bound,
        "bytes_per_step": n_bytes,
        "passes": {str(k): passes.summary(v) for k, v in times.items()},
        "ratio_to_1": {str(k): statistics.median(v) / one for k, v in times.items()},
        "bound_ms": n_bytes / bound / 1e6,
        "achieved_gb_s": n_bytes / one / 1e6,
        "fraction_of_bound": n_bytes / one / 1e6 / bound,  # 1.0 = at the read-bandwidth floor
        "linears_alone_ms": alone,
        "linears_alone_fraction_of_bound": n_bytes / alone / 1e6 / bound if alone else None,
        "profile": {
            str(k): passes.profile_passes(forward, args.cache_len, k, args.profile_passes) for k in args.rows
        },
    }


def draft_step(dtype: str, args, bound: float) -> dict[str, Any]:
    """The default draft's one-token step: an EAGLE head, its layer and its LM-head rows."""
    pair = agentspec.load_pair(dtype=dtype)
    if pair.draft is None or not is_eagle(pair.draft):
        return {"status": f"the default draft is no EAGLE head: {pair.draft_name}"}
    n_bytes = roofline.eagle_bytes_per_step(pair.draft)
    times = roofline.eagle_step_ms(pair.draft, args.cache_len, args.repeats)
    return {"name": pair.draft_name, "eagle": True, "bytes_per_step": n_bytes, **passes.summary(times),
            "fraction_of_bound": n_bytes / statistics.median(times) / 1e6 / bound}  # fmt: skip


def variants(dtype: str) -> dict[str, Any]:
    """Loads of the target: as the library runs its passes ("library"), with transformers' forward, with
    no prepacked copies ("F.linear"), attending row by row where the library attends blocked, in float32
    packing only linears of twice ``linears.MIN_PACKED_FLOAT32_BYTES``, and with ``torch.rms_norm`` where
    the library's norms run as layer norms. (A blocked one-row call sums otherwise than a row alone.)"""
    load = partial(agentspec.load_pair, dtype=dtype, draft_model=False, warm_up=False)
    out = {"library": load(), "transformers forward": load(lean_forward=False)}
    with patch.object(linears, "PACKED_MEMORY_SHARE", 0.0):
        out["F.linear"] = load()
    if out["library"].target_forward.blocked_rows is not None:
        out["row by row"] = load()
        out["row by row"].target_forward.blocked_rows = None
    if dtype == "float32":
        twice = 2 * linears.MIN_PACKED_FLOAT32_BYTES
        with patch.object(linears, "MIN_PACKED_FLOAT32_BYTES", twice):
            out[f"packed from {twice / 2**20:g} MiB"] = load()
    if out["library"].target_forward.layers[0].doubled1 is not None:
        out["rms_norm"] = load()
        for layer in out["rms_norm"].target_forward.layers:
            layer.doubled1 = layer.doubled2 = None
    return out


def linear_paths(dtype: str, args) -> dict[str, Any]:
    """The passes of each of ``variants`` in blocks, each block's first passes (the cache filling)
    dropped: a bfloat16 model nearly fits the last-level cache, so passes interleaved one by one would
    each read the other model's evictions from memory."""
    pairs = variants(dtype)
    states = {
        n: passes.random_state(p.target_forward, args.cache_len, max(args.rows)) for n, p in pairs.items()
    }
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in args.rows} for name in pairs}
    logits: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for r in range(args.repeats):
            for name in harness.rotated(list(pairs), r):
                state, new = states[name]
                for k in args.rows:
                    for i in range(BLOCK + BLOCK_WARM):
                        t0 = time.perf_counter()
                        logits[name] = state.forward(new[:k], keep=k).float()
                        if i >= BLOCK_WARM:
                            times[name][k].append((time.perf_counter() - t0) * 1e3)
                        state.truncate(args.cache_len)
    library = logits.pop("library")  # each way's last pass: the same ids
    diffs = {name: float((library - x).abs().max()) for name, x in logits.items()}
    out = {name: {str(k): passes.summary(v) for k, v in t.items()} for name, t in times.items()}
    packed = pairs["library"].pass_linears.packed_bytes
    return {"packed_bytes": packed, "max_abs_logit_diff": diffs, **out}


class VllmFailed(RuntimeError):
    """vLLM's step child ended or went silent before answering (args: the engine's name, its log's tail)."""


class PacedVllm:
    """vLLM's decode-step rounds on request: ``benchmarks/harness.py --paced`` run by vLLM's python, its
    worker bound to as many CPUs as torch's threads here. Its output is read on a thread of its own (vLLM
    logs there too, and a full pipe would stall it); idle between rounds, it waits on its input."""

    def __init__(self, name: str, dtype: str, ids: list[int], args):
        self.name = name  # "vllm_eager": without vLLM's start-up compile
        self.bind = cpu_bind(torch.get_num_threads())
        self.tmp = tempfile.TemporaryDirectory()
        ids_path, self.out = Path(self.tmp.name) / "ids.json", Path(self.tmp.name) / "step.json"
        ids_path.write_text(json.dumps(ids))
        command = [str(VLLM_PYTHON), str(harness.ROOT / "benchmarks" / "harness.py"), "--paced", "--model",
                   str(ensure_default_model()), "--dtype", dtype, "--prompt-ids", str(ids_path),
                   "--new-tokens", str(args.new_tokens), "--max-model-len", str(MAX_MODEL_LEN),
                   "--memory-utilization", str(MEMORY_UTILIZATION), "--out", str(self.out),
                   *(["--enforce-eager"] if name == "vllm_eager" else [])]  # fmt: skip
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

    def answer(self) -> str:
        """Its next READY or ROUND line (READY: started, its model compiled)."""
        with contextlib.suppress(queue.Empty):
            if line := self.answers.get(timeout=VLLM_TIMEOUT_S):
                return line
        raise VllmFailed(self.name, "".join(self.log)[-3000:])

    def round(self, r: int) -> tuple[float, float]:
        """(seconds of its call of the new tokens, of its call of one)."""
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        times = json.loads(self.answer().split(" ", 1)[1])
        return times["long"], times["short"]

    def close(self) -> dict[str, Any]:
        """vLLM's own summary (its --out), after telling it to quit; the binding its log reports."""
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
        return {
            "bind": self.bind,
            "threads": len(self.bind.split(",")),
            "worker_core_ids": bound[:1],
            **result,
        }


def round_of_calls(call: Callable[[int], float], n: int, r: int) -> tuple[float, float]:
    """(seconds of ``call(n)``, of ``call(1)``), in an order that turns with the round ``r``."""
    times = {m: call(m) for m in ((n, 1) if r % 2 else (1, n))}
    return times[n], times[1]


def step_summary(rounds: list[dict[str, tuple[float, float]]], side: str, n: int) -> dict[str, Any]:
    """A side's decode step in ms: (median of its n-token calls - median of its 1-token calls) / (n - 1),
    and the same from the best of each."""
    long, short = [x[side][0] for x in rounds], [x[side][1] for x in rounds]
    return {
        "step_ms": (statistics.median(long) - statistics.median(short)) / (n - 1) * 1e3,
        "step_ms_best": (min(long) - min(short)) / (n - 1) * 1e3,
        "new_tokens": n,
        "repeats": len(long),
    }


def vllm_sides(args) -> list[str]:
    """vLLM as it starts by default (its model compiled); with ``--vllm-eager``, also ``--enforce-eager``."""
    return ["vllm", "vllm_eager"] if args.vllm_eager else ["vllm"]


def _round(sides: dict[str, Callable[[int], tuple[float, float]]], r: int) -> dict[str, tuple[float, float]]:
    """One round of every side, each going first in turn (the last one in round 0)."""
    names = list(sides)
    at = (len(names) - 1 - r) % len(names)
    return {name: sides[name](r) for name in names[at:] + names[:at]}


def _ratio_key(engine: str) -> str:  # "ratio": agentspec's step over vLLM's; "ratio_eager": over eager's
    return "ratio" + engine.removeprefix("vllm")


def _ratios(step_ms: dict[str, float]) -> dict[str, float]:
    """A round's step of each side, and agentspec's over each vLLM engine's."""
    out = {f"{k}_step_ms": v for k, v in step_ms.items()}
    engines = [k for k in step_ms if k.startswith("vllm")]
    return {**out, **{_ratio_key(k): step_ms["agentspec"] / step_ms[k] for k in engines}}


def timed_rounds(sides: dict[str, Callable], args) -> dict[str, Any]:
    """``args.rounds`` interleaved rounds of every side: each side's step, each round's ratios, and
    the ratios' medians (drift over the run's minutes cancels in them)."""
    rounds = [_round(sides, r) for r in range(args.rounds)]
    n = args.new_tokens
    per_round = [{"first": next(iter(x)), **_ratios({k: step_summary([x], k, n)["step_ms"] for k in x})}
                 for x in rounds]  # fmt: skip
    out: dict[str, Any] = {name: step_summary(rounds, name, n) for name in sides}
    out["agentspec_plain"] = out.pop("agentspec")
    for key in {_ratio_key(k) for k in sides if k.startswith("vllm")}:
        out[key + "_median"] = statistics.median(x[key] for x in per_round)
    return {**out, "rounds": per_round}


def steps_side_by_side(pair, ids: list[int], dtype: str, args) -> dict[str, Any]:
    """agentspec's plain step (no drafts, no prefix cache, no EOS), ``generate()``'s and vLLM's, their
    rounds interleaved; if a vLLM engine fails, its log and the local sides' rounds alone."""

    def plain(m: int) -> float:
        t0 = time.perf_counter()
        out = agentspec.generate(pair, ids, None, False, max_new_tokens=m, speculative=False,
                                 eos_token_ids=frozenset())  # fmt: skip
        assert len(out.token_ids) == m, f"{len(out.token_ids)=} {m=}"
        return time.perf_counter() - t0

    x = torch.tensor([ids])

    def generate(m: int) -> float:  # min_new_tokens: it never stops early
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = pair.target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=m, min_new_tokens=m)  # fmt: skip
        assert out.shape[1] == len(ids) + m, f"{out.shape=}"
        return time.perf_counter() - t0

    local = {name: partial(round_of_calls, call, args.new_tokens) for name, call in
             (("agentspec", plain), ("hf_generate", generate))}  # fmt: skip
    for warm_up in (plain, generate):
        warm_up(2)
    if args.no_vllm:
        return timed_rounds(local, args)
    engines = {name: PacedVllm(name, dtype, ids, args) for name in vllm_sides(args)}
    status = dict.fromkeys(engines, {"status": "ok"})
    try:
        for engine in engines.values():
            engine.answer()  # READY: no round starts while an engine compiles
        result = timed_rounds({**local, **{k: e.round for k, e in engines.items()}}, args)
    except VllmFailed as exc:  # its log, and the local sides' steps alone
        result = timed_rounds(local, args)
        failed = {exc.args[0]: {"status": "error", "log_tail": exc.args[1]}}
        status = dict.fromkeys(engines, {"status": "untimed"}) | failed
    for name, engine in engines.items():
        result[name] = {**status[name], **engine.close(), **result.get(name, {})}
    return result


def run_dtype(dtype: str, args, reads: list[float]) -> dict[str, Any]:
    print(f"{dtype}: target passes and profiles ...", flush=True)
    pair = agentspec.load_pair(dtype=dtype, draft_model=False)
    ids = pair.tokenizer((WEATHER + CODE + SEARCH) * 4)["input_ids"][:PROMPT_TOKENS]
    out = {"environment": harness.environment(pair), "target": target_passes(pair, args, reads)}
    print(f"{dtype}: the passes of other loads (variants), decode steps, the draft's step ...", flush=True)
    out["linears"] = linear_paths(dtype, args)
    out.update(steps_side_by_side(pair, ids, dtype, args))
    del pair
    out["draft"] = draft_step(dtype, args, out["target"]["bound_read_gb_s"])
    return out


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """Each one-row step over vLLM's (goal: at most 1.0) and the float32 one-row pass's fraction of the
    read-bandwidth bound (goal: at least 0.7)."""
    out: dict[str, Any] = {}
    for dtype, r in result["dtypes"].items():
        vllm, plain = r.get("vllm", {}).get("step_ms"), r["agentspec_plain"]["step_ms"]
        one = r["target"]["passes"][str(min(result["rows"]))]["median_ms"]
        out[dtype] = {
            "vllm_step_ms": vllm,
            "pass_1_ms": one,
            "agentspec_plain_step_ms": plain,
            "hf_generate_step_ms": r["hf_generate"]["step_ms"],
            "agentspec_plain_over_vllm": plain / vllm if vllm else None,
            "pass_1_over_vllm": one / vllm if vllm else None,
            "agentspec_plain_over_vllm_rounds_median": r.get("ratio_median"),
            "agentspec_plain_over_vllm_eager_rounds_median": r.get("ratio_eager_median"),
            "fraction_of_bound": r["target"]["fraction_of_bound"],
            "linears_alone_fraction_of_bound": r["target"]["linears_alone_fraction_of_bound"],
            "vllm_fraction_of_bound": r["target"]["bound_ms"] / vllm if vllm else None,
        }  # fmt: skip
    if "float32" in out:
        f = out["float32"]["fraction_of_bound"]
        out["float32_fraction_of_bound"] = {"measured": f, "goal": GOAL_FRACTION, "met": f >= GOAL_FRACTION}
    return out


def run_pass(args) -> dict[str, Any]:
    reads = [read_gb_s(args)]  # and more beside each dtype's passes (target_passes)
    settings = harness.settings(args, leave=("out", "before", "max_new_tokens"))
    dtypes = {dtype: run_dtype(dtype, args, reads) for dtype in args.dtypes}
    result = {"settings": settings, "rows": args.rows, "prompt_tokens": PROMPT_TOKENS, "dtypes": dtypes}
    result["environment"] = result["dtypes"][args.dtypes[0]]["environment"]
    result["goals"] = goals(result)
    print(json.dumps(result["goals"], indent=1))
    return result


# --- the syncs part -----------------------------------------------------------------------------

DRAFTERS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto")
QUESTION = "List the squares of 1 to 12 as a Python list, then say which of them are even."
# run in each checkout's own process, against its own agentspec (HostSyncs is in both)
SYNCS = """
import agentspec, json, sys
from agentspec.bench.run import environment
from agentspec.bench.syncs import HostSyncs
from agentspec.cache import PrefixCache
n, drafters, question = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
pair = agentspec.load_pair()
ids = pair.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         return_dict=False)
rows = {}
for d in drafters:
    for mode, options in {"greedy": {}, "sampled": {"temperature": 0.7, "seed": 0}}.items():
        for cached in (False, True):
            cache = PrefixCache(1 << 30) if cached else False
            run = dict(drafter=d, prefix_cache=cache, max_new_tokens=n, **options)
            agentspec.generate(pair, ids, **run)
            with HostSyncs(pair) as syncs:
                steps = list(agentspec.stream(pair, ids, **run))
            passes = sum(s.target_pass for s in steps)
            rows[f"{d} {mode} {'cached' if cached else 'uncached'}"] = {
                "syncs": syncs.count, "passes": passes, "per_pass": syncs.count / passes,
                "tokens": sum(len(s.tokens) for s in steps), "sites": dict(syncs.where.most_common(4))}
print(json.dumps({"environment": environment(pair), "rows": rows}))
"""


def host_syncs(tree: Path, n: int) -> dict[str, Any]:
    argv = [sys.executable, "-c", SYNCS, str(n), ",".join(DRAFTERS), QUESTION]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_syncs(args) -> dict[str, Any]:
    after = host_syncs(harness.ROOT, args.max_new_tokens)
    result = {"environment": after["environment"], "max_new_tokens": args.max_new_tokens}
    result["after"] = after["rows"]
    if args.before is not None:
        before = host_syncs(args.before.resolve(), args.max_new_tokens)
        result["before_environment"], result["before"] = before["environment"], before["rows"]
    for key, row in result["after"].items():
        was = result.get("before", {}).get(key, {}).get("per_pass")
        print(f"{key:36s} {'' if was is None else f'{was:.2f} -> '}{row['per_pass']:.2f} syncs/pass")
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser("pass", __doc__)
    ap.add_argument("--part", choices=("pass", "syncs"), default="pass")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,5,17", help="new rows per pass, comma-separated")
    ap.add_argument("--cache-len", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=15, help="rounds of timed passes")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of whole calls (steps)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-eager", action="store_true", help="also vLLM without its start-up compile")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few repeats, 21 new tokens")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="syncs: new tokens a call")
    ap.add_argument("--before", type=Path, help="syncs: another checkout measured beside this one")
    args = ap.parse_args(argv)
    args.dtypes, args.rows = args.dtypes.split(","), [int(k) for k in args.rows.split(",")]
    if args.quick:
        args.repeats, args.rounds = min(args.repeats, 2), 1
    args.new_tokens = 21 if args.quick else 101
    args.profile_passes = 2 if args.quick else 5
    args.bandwidth_repeats = 2 if args.quick else 7
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    harness.set_threads(args.threads)
    result = run_pass(args) if args.part == "pass" else run_syncs(args)
    harness.write(args.out, result, part=args.part)
    return 0
