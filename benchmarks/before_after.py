"""Two checkouts side by side, interleaved: the agent traces, the LangChain agent loop, the pair's passes.

    python -m benchmarks before-after --before ../base [--after .] [--dtype auto|float32|bfloat16]
        [--traces a,b] [--configs none,auto] [--max-new-tokens N] [--loop-rounds 1] [--threads 1]
    python -m benchmarks before-after --before ../base --part passes [--pass-rounds 6] [--dtype bfloat16]

The earlier commit is a checkout beside this one (``git worktree add ../base <commit>``). Each side runs
its own code: every job is a fresh process whose working directory is its checkout, that checkout (and
its LangChain integration) first on the import path. A side has either the suites
(``python -m benchmarks traces``, ``benchmarks.loop``) or the scripts they replaced
(``benchmarks/bench_agent_traces.py``, ``benchmarks/bench_langchain_loop.py``). Every job runs once in
each checkout, the two one after the other, the order flipping from job to job so that the machine's
drift hits both alike. ``--dtype`` loads both sides' pairs in that dtype (``auto``: each side's own
default, recorded per side); ``--threads`` is each process's OMP_NUM_THREADS.

- agents (default): one job per agent trace (the traces suite on that trace alone, ``--configs``) and
  ``--loop-rounds`` jobs of the agent loop (ChatSpecDecode full and baseline beside ChatHuggingFace;
  with ``--loop-apart`` each chat model in a process of its own, after the loop's warm-up: beside
  ``ChatHuggingFace``'s generate() on one model, a side's own chat model can run slower or faster
  than alone).
  The summary holds per configuration the decode seconds summed over the traces, and per chat model the
  seconds summed over the rounds, before / after (above 1: faster after); ``identical``: every
  configuration's replies equal plain decoding's on both sides. Each job also compares the replies of
  the two sides (``replies_identical``, with the first difference where false): a trace's plain reply
  at each turn by token ids, the loop's chat models' texts at each call; ``all_replies_identical``.
- passes: ``--pass-rounds`` rounds of one process per side: the target's pass over each of
  ``--pass-rows`` new rows after 400 cached random tokens, and the default draft's step (an EAGLE head:
  its layer and its scores, as a drafting call runs them), each the median of ``--pass-repeats``; the
  summary holds each pass's median over the rounds of before / after. Stored as ``passes_<dtype>``
  (``auto``: float32), so both dtypes' rounds sit side by side.

Writes results/before_after.json, one key per part.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.workloads import TRACES

# The agent loop's module in a checkout of each layout; the script prints the loop's summary, each chat
# model's reply at each call (in a fixed order: a row's systems are in the call's rotated order) and the
# dtype, as JSON on its last line
LOOP_MODULES = {
    "benchmarks/loop.py": "benchmarks.loop",
    "benchmarks/bench_langchain_loop.py": "benchmarks.bench_langchain_loop",
}
LOOP_RUN = """
import importlib, json, sys
from agentspec import load_pair
pair = load_pair(dtype=sys.argv[2])
ran = importlib.import_module(sys.argv[3]).run_agent_loop(pair, loop_max_new_tokens=int(sys.argv[1]))
calls = [(j, row["systems"]) for j, row in enumerate(ran["loop_rows"])]
texts = [[f"{s} call {j}", systems[s]["text"]] for j, systems in calls for s in sorted(systems)]
print(json.dumps({"loop": ran["loop"], "replies": texts, "dtype": str(pair.dtype)}))
"""
# One chat model of the agent loop alone in its process (``--loop-apart``), in a checkout of either
# layout: the loop's warm-up, then that model over the loop's calls; prints its seconds and replies
LOOP_APART_RUN = """
import importlib, json, sys
from agentspec import load_pair
from agentspec.bench.run import warm_up
n, dtype, module, system = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
pair = load_pair(dtype=dtype)
warm_up(pair, ["transformers generate", "agentspec none", "agentspec auto"])
loop = importlib.import_module(module)
if hasattr(loop, "chat_models"):
    models = loop.chat_models(pair, n)
    run = lambda m: loop.agent_loop(m)
else:
    models = loop.loop_systems(pair, n, cache_bytes=1 << 30)
    run = lambda m: loop.agent_loop(pair, m)
rows = run({system: models[system]}) if system in models else []
texts = [[f"{system} call {j}", row["systems"][system]["text"]] for j, row in enumerate(rows)]
seconds = sum(row["systems"][system]["seconds"] for row in rows)
print(json.dumps({"seconds": seconds, "ran": bool(rows), "replies": texts, "dtype": str(pair.dtype)}))
"""
LOOP_SYSTEMS = ("agentspec full", "agentspec baseline", "ChatHuggingFace")
# The pair's passes in a checkout: the target's through the forward its pairs call (``target_forward``;
# a pair without one runs the model, inside ``kv.pass_rows``) and the EAGLE head's step with its scores
# (through the pair's ``draft_head``; without one, the head's own modules inside ``kv.pass_rows``), each
# over the cache its drafting state keeps
PASS_RUN = """
import contextlib, json, statistics, sys, time
import torch
from agentspec import kv, load_pair
from agentspec.bench import passes
dtype, rows, cache_len, repeats = sys.argv[1], [int(k) for k in sys.argv[2].split(",")], 400, int(sys.argv[3])
pair = load_pair(dtype=dtype)
forward = getattr(pair, "target_forward", pair.target)
timed = passes.pass_times(forward, cache_len, rows, repeats)
target = {str(k): statistics.median(v) for k, v in timed.items()}
head = pair.draft
run = getattr(pair, "draft_head", None)
hidden, scores = (run.hidden, run.scores) if run is not None else (head.hidden, head.head)
in_pass = (lambda: kv.pass_rows(1)) if hasattr(kv, "pass_rows") else contextlib.nullcontext
feats = torch.zeros((1, cache_len + 1, head.config.hidden_size), dtype=head.dtype)
ids = torch.arange(cache_len + 1)[None] % 1000
from transformers import DynamicCache
cache = kv.growing_cache(head.decoder.config) if run is not None else DynamicCache(config=head.decoder.config)
times = []
with torch.inference_mode():
    hidden(feats[:, :cache_len], ids[:, :cache_len], cache)
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        with in_pass():
            scores(hidden(feats[:, -1:], ids[:, -1:], cache)[0])
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
        cache.crop(-1)
print(json.dumps({"target_ms": target, "draft_step_ms": statistics.median(times), "dtype": str(pair.dtype)}))
"""


def environment_of(tree: Path) -> dict[str, Any]:
    """The checkout's commit and the paths it had changed (a run of committed code has none)."""

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True).stdout.strip()

    return {
        "path": str(tree),
        "commit": git("rev-parse", "HEAD"),
        "dirty": git("status", "--porcelain").splitlines(),
    }


def traces_job(tree: Path, trace: str, configs: str, dtype: str, out: Path, max_new_tokens=None) -> list[str]:
    """The command that runs one trace in the checkout: its traces suite, or the script it replaced."""
    suites = (tree / "benchmarks" / "__main__.py").exists()
    suite = ["-m", "benchmarks", "traces"] if suites else ["-m", "benchmarks.bench_agent_traces"]
    argv = [sys.executable, *suite, "--traces", trace, "--configs", configs, "--dtype", dtype]
    argv += ["--out", str(out)] + (["--max-new-tokens", str(max_new_tokens)] if max_new_tokens else [])
    return argv


def loop_job(tree: Path, max_new_tokens: int, dtype: str) -> list[str]:
    module = next((m for path, m in LOOP_MODULES.items() if (tree / path).exists()), None)
    if module is None:
        raise RuntimeError(f"{tree} has none of {list(LOOP_MODULES)}: a layout this benchmark cannot run")
    return [sys.executable, "-c", LOOP_RUN, str(max_new_tokens), dtype, module]


def run_in(tree: Path, argv: list[str], threads: int | None = None) -> tuple[float, str]:
    """Seconds and standard output of ``argv`` run in the checkout, its engine and LangChain integration
    ahead of any installed (editable) copy; OMP_WAIT_POLICY passes on from ``python -m benchmarks``."""
    paths = [p for p in (tree, tree / "integrations" / "langchain") if p.is_dir()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        command = " ".join(a for a in argv if "\n" not in a)  # without a -c script's text
        raise RuntimeError(f"{command} in {tree} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0, done.stdout


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def trace_figures(path: Path) -> dict[str, Any]:
    """A trace run's figures, and its ``replies``: each turn's plain reply, labelled ``trace#turn``."""
    data = json.loads(path.read_text())
    return {
        "all_identical": data["all_identical"],
        "dtype": data["environment"].get("dtype"),
        "configs": {
            c: {k: agg[k] for k in ("tokens", "seconds", "tokens_per_s", "speed_ratio")}
            for c, agg in data["aggregate"].items()
        },
        "replies": [[f"{t['trace']}#{t['turn']}", t["output_token_ids"]] for t in data["turns"]],
    }


def compare_replies(before: list, after: list, form: str) -> dict[str, Any]:
    """``replies_identical`` of one job's ``[label, reply]`` lists; where they differ, the first
    differing reply."""
    out: dict[str, Any] = {
        "replies_identical": before == after,
        "replies_compared": form,
        "replies": len(after),
    }
    if before != after:
        i = next((i for i, (x, y) in enumerate(zip(before, after)) if x != y), min(len(before), len(after)))
        out["first_difference"] = {
            "index": i,
            "reply": (after[i] if i < len(after) else before[i])[0],
            "before": before[i][1] if i < len(before) else None,
            "after": after[i][1] if i < len(after) else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("before_after", __doc__, dtype=True)
    ap.add_argument("--before", type=Path, required=True, help="the earlier commit's checkout")
    ap.add_argument("--after", type=Path, default=harness.ROOT)
    ap.add_argument("--part", choices=("agents", "passes"), default="agents")
    ap.add_argument("--traces", default=",".join(t.name for t in TRACES))
    ap.add_argument("--configs", default="none,prompt_lookup,suffix,model_scheduled,auto")
    ap.add_argument("--max-new-tokens", type=int, help="per trace reply (default: each side's own)")
    ap.add_argument("--loop-max-new-tokens", type=int, default=16)
    ap.add_argument("--loop-rounds", type=int, default=1, help="agent-loop jobs, the order flipping each")
    ap.add_argument(
        "--loop-apart", action="store_true", help="each chat model of the loop in its own process"
    )
    ap.add_argument("--pass-rounds", type=int, default=6, help="pass-timing jobs, the order flipping each")
    ap.add_argument("--pass-rows", default="1,5,17")
    ap.add_argument("--pass-repeats", type=int, default=15)
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    result: dict[str, Any] = {
        "environment": harness.environment(),
        "commits": {side: environment_of(tree) for side, tree in trees.items()},
        "dtype": args.dtype,  # as asked; each job's sides record the dtype they ran in
    }
    if args.part == "agents":
        result |= {"configs": args.configs, "traces": {}}
        jobs = [("trace", t) for t in args.traces.split(",") if t]
        jobs += [("loop", f"agent_loop_{r}" if r else "agent_loop") for r in range(args.loop_rounds)]
    else:
        jobs = [("pass", f"passes_{r}") for r in range(args.pass_rounds)]
    tmp = Path(tempfile.mkdtemp(prefix="before_after_"))
    for j, (kind, name) in enumerate(jobs):
        row: dict[str, Any] = {}
        for side in ("before", "after") if j % 2 == 0 else ("after", "before"):
            row[side] = run_job(kind, name, trees[side], args, tmp / f"{side}_{name}.json")
            print(f"{name} {side}: {row[side]['process_s']:.0f} s", flush=True)
        if kind != "pass":
            form = "token_ids" if kind == "trace" else "text"
            row |= compare_replies(row["before"].pop("replies"), row["after"].pop("replies"), form)
            print(f"{name}: replies identical {row['replies_identical']}", flush=True)
        (result["traces"] if kind == "trace" else result)[name] = row
    result["summary"] = agents_summary(result) if args.part == "agents" else {"passes": pass_ratios(result)}
    dtype = "float32" if args.dtype == "auto" else args.dtype
    harness.write(args.out, result, part=args.part if args.part == "agents" else f"passes_{dtype}")
    print(json.dumps(result["summary"], indent=1))
    return 0


def run_job(kind: str, name: str, tree: Path, args, out: Path) -> dict[str, Any]:
    """One job in one checkout: the process's seconds and its figures (with ``replies`` to compare)."""
    if kind == "trace":
        argv = traces_job(tree, name, args.configs, args.dtype, out, args.max_new_tokens)
        seconds, _ = run_in(tree, argv, args.threads)
        return {"process_s": seconds, **trace_figures(out)}
    if kind == "loop" and args.loop_apart:
        return loop_apart(tree, args)
    if kind == "loop":
        seconds, stdout = run_in(tree, loop_job(tree, args.loop_max_new_tokens, args.dtype), args.threads)
        printed = last_json(stdout)
        return {"process_s": seconds, **printed.pop("loop"), **printed}
    dtype = "float32" if args.dtype == "auto" else args.dtype
    argv = [sys.executable, "-c", PASS_RUN, dtype, args.pass_rows, str(args.pass_repeats)]
    seconds, stdout = run_in(tree, argv, args.threads)
    return {"process_s": seconds, **last_json(stdout)}


def loop_apart(tree: Path, args) -> dict[str, Any]:
    """The agent loop's job with each chat model in a process of its own (a model that the checkout
    lacks, such as ``ChatHuggingFace`` without langchain-huggingface, left out): no model's calls
    run beside another's on one pair in one process."""
    module = loop_job(tree, args.loop_max_new_tokens, args.dtype)[-1]
    out: dict[str, Any] = {"process_s": 0.0, "total_seconds": {}, "replies": []}
    for system in LOOP_SYSTEMS:
        argv = [
            sys.executable,
            "-c",
            LOOP_APART_RUN,
            str(args.loop_max_new_tokens),
            args.dtype,
            module,
            system,
        ]
        seconds, stdout = run_in(tree, argv, args.threads)
        printed = last_json(stdout)
        out["process_s"] += seconds
        if printed["ran"]:
            out["total_seconds"][system] = printed["seconds"]
            out["replies"] += printed["replies"]
            out["dtype"] = printed["dtype"]
    texts = {
        system: [t for name, t in out["replies"] if name.startswith(system)] for system in LOOP_SYSTEMS[:2]
    }
    out["full_equals_baseline"] = texts["agentspec full"] == texts["agentspec baseline"]
    return out


def ratio(before: float, after: float) -> dict[str, float]:
    return {"before_s": before, "after_s": after, "before_over_after": before / after}


def agents_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: decode seconds summed over the traces, before / after; per chat model of the
    agent loop: seconds summed over its rounds."""
    traces = list(result["traces"].values())
    loops = [row for name, row in result.items() if name.startswith("agent_loop")]
    out: dict[str, Any] = {"agent_traces": {}, "agent_loop": {}, "loop_rounds": len(loops)}
    sides = ("before", "after")
    for c in result["configs"].split(",") if traces else []:
        out["agent_traces"][c] = ratio(*(sum(r[s]["configs"][c]["seconds"] for r in traces) for s in sides))
    for system in loops[0]["after"]["total_seconds"] if loops else []:
        out["agent_loop"][system] = ratio(*(sum(r[s]["total_seconds"][system] for r in loops) for s in sides))
    out["identical"] = all(r[s]["all_identical"] for r in traces for s in sides) and all(
        r[s]["full_equals_baseline"] for r in loops for s in sides
    )
    out["all_replies_identical"] = all(r["replies_identical"] for r in [*traces, *loops])
    return out


def pass_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Each pass's median over the rounds of before / after (ms): above 1 is faster after."""
    rounds = [row for name, row in result.items() if name.startswith("passes_")]
    if not rounds:
        return {}
    names = [f"target_{k}" for k in rounds[0]["after"]["target_ms"]] + ["draft_step"]

    def ms(row: dict[str, Any], name: str) -> float:
        return (
            row["draft_step_ms"] if name == "draft_step" else row["target_ms"][name.removeprefix("target_")]
        )

    out = {}
    for name in names:
        ratios = [ms(r["before"], name) / ms(r["after"], name) for r in rounds]
        out[name] = {
            "before_ms": statistics.median(ms(r["before"], name) for r in rounds),
            "after_ms": statistics.median(ms(r["after"], name) for r in rounds),
            "before_over_after_rounds": ratios,
            "median_before_over_after": statistics.median(ratios),
        }
    return out


if __name__ == "__main__":
    raise SystemExit(main())
