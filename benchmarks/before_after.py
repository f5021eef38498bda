"""Two commits side by side: the agent-trace replay and the agent-loop row, in two checkouts, interleaved.

Run from the repository root, with a checkout of the earlier commit beside it (``git worktree add``):

    OMP_NUM_THREADS=1 python -m benchmarks.before_after --before ../base --after . \
        [--traces inventory_dock,...] [--configs none,suffix,auto] [--out FILE]

Every job runs once in each checkout, the two one after the other, the order flipping from job to job so that
the machine's drift hits both alike: one job per recorded agent trace (``bench_agent_traces`` on that trace)
and one for the agent loop of LangChain chat models (ChatSpecDecode full and baseline, ChatHuggingFace). Each
run is a fresh process whose working directory is its checkout, so it imports that checkout's code. Writes the
per-job seconds and tokens of both checkouts and their ratios (before / after: above 1 means faster after).
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

from benchmarks.agent_traces import TRACES

# The agent loop at a commit where it still lived in ``agentspec.bench.run`` (before the core stopped
# importing LangChain), and where it lives now. Each prints the loop's summary as JSON on its last line.
LOOP_BEFORE = """
import json, sys
from tqdm.auto import tqdm
from agentspec import load_pair
from agentspec.bench import report, run, systems
from agentspec.bench.conversation import prompt_ids
pair = load_pair()
warm = prompt_ids(pair.tokenizer, [{"role": "user", "content": "Hi"}])
for s in ["transformers generate", "agentspec none", "agentspec auto"]:  # the warm-up the loop gets now
    systems.run_single(pair, s, warm, 4, systems.own_drafter(pair, s) if s.startswith("agentspec") else None)
models = systems.loop_systems(pair, int(sys.argv[1]), cache_bytes=1 << 30)
rows = run.agent_loop(pair, models, tqdm(disable=True))
print(json.dumps(report.summarise_loop(rows, list(models))))
"""
LOOP_AFTER = """
import json, sys
from benchmarks.bench_langchain_loop import run_agent_loop
print(json.dumps(run_agent_loop(loop_max_new_tokens=int(sys.argv[1]))["loop"]))
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


def is_after(tree: Path) -> bool:
    return (tree / "benchmarks" / "__init__.py").exists()


def traces_job(tree: Path, trace: str, configs: str, out: Path) -> list[str]:
    script = (
        ["-m", "benchmarks.bench_agent_traces"] if is_after(tree) else ["benchmarks/bench_agent_traces.py"]
    )
    return [sys.executable, *script, "--traces", trace, "--configs", configs, "--out", str(out)]


def run_in(tree: Path, argv: list[str]) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{argv} in {tree} failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def trace_figures(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return {
        "all_identical": data["all_identical"],
        "configs": {
            c: {k: agg[k] for k in ("tokens", "seconds", "tokens_per_s", "speed_ratio")}
            for c, agg in data["aggregate"].items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--traces", default=",".join(t.name for t in TRACES))
    ap.add_argument("--configs", default="none,prompt_lookup,suffix,model_scheduled,auto")
    ap.add_argument("--loop-max-new-tokens", type=int, default=16)
    ap.add_argument("--loop-rounds", type=int, default=1, help="agent-loop jobs, the order flipping each")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/before_after.json"))
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    result: dict[str, Any] = {
        "commits": {side: environment_of(tree) for side, tree in trees.items()},
        "configs": args.configs,
        "traces": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="before_after_"))
    jobs = [("trace", t) for t in args.traces.split(",") if t]
    jobs += [("loop", f"agent_loop_{r}" if r else "agent_loop") for r in range(args.loop_rounds)]
    for j, (kind, name) in enumerate(jobs):
        order = ["before", "after"] if j % 2 == 0 else ["after", "before"]
        row: dict[str, Any] = {}
        for side in order:
            tree = trees[side]
            if kind == "trace":
                out = tmp / f"{side}_{name}.json"
                seconds, _ = run_in(tree, traces_job(tree, name, args.configs, out))
                row[side] = {"process_s": seconds, **trace_figures(out)}
            else:
                code = LOOP_AFTER if is_after(tree) else LOOP_BEFORE
                seconds, stdout = run_in(tree, [sys.executable, "-c", code, str(args.loop_max_new_tokens)])
                row[side] = {"process_s": seconds, **json.loads(stdout.strip().splitlines()[-1])}
            print(f"{name} {side}: {seconds:.0f} s", flush=True)
        (result["traces"] if kind == "trace" else result).__setitem__(name, row)
    result["summary"] = summary(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


def ratio(before: float, after: float) -> dict[str, float]:
    return {"before_s": before, "after_s": after, "before_over_after": before / after}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: decode seconds summed over the traces, before / after; per chat model of the
    agent loop: seconds summed over its rounds."""
    traces = list(result["traces"].values())
    loops = [row for name, row in result.items() if name.startswith("agent_loop")]
    out: dict[str, Any] = {"agent_traces": {}, "agent_loop": {}, "loop_rounds": len(loops)}
    for c in result["configs"].split(",") if traces else []:
        before = sum(r["before"]["configs"][c]["seconds"] for r in traces)
        after = sum(r["after"]["configs"][c]["seconds"] for r in traces)
        out["agent_traces"][c] = ratio(before, after)
    for system in loops[0]["after"]["total_seconds"] if loops else []:
        before = sum(r["before"]["total_seconds"][system] for r in loops)
        after = sum(r["after"]["total_seconds"][system] for r in loops)
        out["agent_loop"][system] = ratio(before, after)
    out["identical"] = all(r[s]["all_identical"] for r in traces for s in ("before", "after")) and all(
        r[s]["full_equals_baseline"] for r in loops for s in ("before", "after")
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
