"""Two commits side by side: the agent-trace replay and the agent-loop row, in two checkouts, interleaved.

Run from the repository root, with a checkout of the earlier commit beside it (``git worktree add``):

    OMP_NUM_THREADS=1 python -m benchmarks.before_after --before ../base --after . \
        [--traces inventory_dock,...] [--configs none,suffix,auto] [--dtype auto|float32|bfloat16] \
        [--out FILE]

Every job runs once in each checkout, the two one after the other, the order flipping from job to job so that
the machine's drift hits both alike: one job per recorded agent trace (``bench_agent_traces`` on that trace)
and one for the agent loop of LangChain chat models (ChatSpecDecode full and baseline, ChatHuggingFace). Each
run is a fresh process whose working directory is its checkout, so it imports that checkout's code (the
engine and the LangChain integration both). Writes the per-job seconds and tokens of both checkouts and their
ratios (before / after: above 1 means faster after). ``--dtype`` loads both checkouts' pairs in that dtype
(``auto``: each checkout's own default, which may differ between them); each job records the dtype each side
ran, and an explicit dtype that a checkout cannot load (its benchmark has no ``--dtype``) stops the run.

With ``--pass-rounds N`` it also times the pair's passes in both checkouts, N rounds of a fresh process each,
the order flipping each round: the target's pass over each of ``--pass-rows`` new rows after 400 cached
random tokens, and the default draft's step (an EAGLE head: its layer and its scores, as a drafting
call runs them), each the median of ``--pass-repeats``; the summary's ``passes`` holds each one's median of
the per-round ratios (before / after: above 1 means faster after).

It also compares every reply between the two checkouts, job by job: a trace's replies are each turn's plain
reply (its token ids where both runs wrote them, else its text; within a checkout every configuration must
equal it, ``identical``), the loop's are each chat model's text at each call. Each job records
``replies_identical`` (true / false, with the first differing reply where false; null, with
``replies_reason``, where a checkout's output carries no replies: an older commit's), and the summary
``all_replies_identical`` (false if any job differs, else null if any could not be compared, else true).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.agent_traces import TRACES

# The agent loop's run at a commit, by where it lives there: ``benchmarks/bench_langchain_loop.py`` (now),
# ``langchain_agentspec/bench.py`` (before the integration stopped carrying benchmark code), or
# ``agentspec.bench.run`` (before the core stopped importing LangChain; ``LOOP_IN_CORE``). Each leaves the
# loop's ``rows`` and ``summary``; ``LOOP_PRINT`` prints both's figures as JSON on the last line.
LOOP_MODULES = {
    "benchmarks/bench_langchain_loop.py": "benchmarks.bench_langchain_loop",
    "integrations/langchain/langchain_agentspec/bench.py": "langchain_agentspec.bench",
}
LOOP_RUN = """
import json, sys
from agentspec import load_pair
from {module} import run_agent_loop
pair = load_pair(dtype=sys.argv[2])
ran = run_agent_loop(pair, loop_max_new_tokens=int(sys.argv[1]))
rows, summary = ran["loop_rows"], ran["loop"]
"""
LOOP_IN_CORE = """
import json, sys
from tqdm.auto import tqdm
from agentspec import load_pair
from agentspec.bench import report, run, systems
from agentspec.bench.conversation import prompt_ids
pair = load_pair(dtype=sys.argv[2])
warm = prompt_ids(pair.tokenizer, [{"role": "user", "content": "Hi"}])
for s in ["transformers generate", "agentspec none", "agentspec auto"]:  # the warm-up the loop gets now
    systems.run_single(pair, s, warm, 4, systems.own_drafter(pair, s) if s.startswith("agentspec") else None)
models = systems.loop_systems(pair, int(sys.argv[1]), cache_bytes=1 << 30)
rows = run.agent_loop(pair, models, tqdm(disable=True))
summary = report.summarise_loop(rows, list(models))
"""
# The pair's passes at a commit: the target's (through the forward its pairs call: ``target_forward``, or
# earlier the model, whose passes ran inside ``kv.pass_rows``) and the EAGLE head's step with its scores
# (through the pair's ``draft_head``, or earlier the head's modules inside ``kv.pass_rows``), each over
# the cache its drafting state keeps
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
run = getattr(pair, "draft_head", None)  # what the head's passes call; earlier, the head's own modules
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

# each chat model's reply at each call, in a fixed order (a row's systems are in the call's rotated order)
LOOP_PRINT = """
texts = [
    [f"{s} call {j}", row["systems"][s].get("text")]
    for j, row in enumerate(rows)
    for s in sorted(row["systems"])
]
replies = {"text": texts} if all(t is not None for _, t in texts) else None
print(json.dumps({"loop": summary, "replies": replies, "dtype": str(pair.dtype)}))
"""


def loop_code(tree: Path) -> str:
    """The agent loop's script for the checkout, by where its loop lives."""
    for path, module in LOOP_MODULES.items():
        if (tree / path).exists():
            return LOOP_RUN.format(module=module) + LOOP_PRINT
    return LOOP_IN_CORE + LOOP_PRINT


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


def traces_script(tree: Path) -> list[str]:
    """The command that runs the checkout's agent-trace benchmark."""
    script = (
        ["-m", "benchmarks.bench_agent_traces"] if is_after(tree) else ["benchmarks/bench_agent_traces.py"]
    )
    return [sys.executable, *script]


def takes_dtype(tree: Path) -> bool:
    """Whether the checkout's agent-trace benchmark has ``--dtype`` (one from before it loads its default)."""
    return "--dtype" in run_in(tree, [*traces_script(tree), "--help"])[1]


def traces_job(tree: Path, trace: str, configs: str, dtype: str | None, out: Path) -> list[str]:
    """One trace's run in the checkout; ``dtype`` None: the checkout's benchmark takes none."""
    argv = [*traces_script(tree), "--traces", trace, "--configs", configs, "--out", str(out)]
    return argv if dtype is None else [*argv, "--dtype", dtype]


def check_dtype(asked: str, side: str, ran: str | None) -> None:
    """Stop a run that asked for a dtype (not ``auto``) that a checkout did not run in."""
    if asked != "auto" and ran != f"torch.{asked}":
        raise RuntimeError(
            f"--dtype {asked}: the {side} checkout ran in {ran} (its benchmark takes no --dtype: it loads "
            "its own default)"
        )


def run_in(tree: Path, argv: list[str]) -> tuple[float, str]:
    # the checkout's engine and its LangChain integration, ahead of any installed (editable) copy
    paths = [tree, tree / "integrations" / "langchain"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths if p.is_dir()))
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{argv} in {tree} failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def trace_figures(path: Path) -> dict[str, Any]:
    """A trace run's figures, and its ``replies`` (``trace_replies``) for the comparison."""
    data = json.loads(path.read_text())
    return {
        "all_identical": data["all_identical"],
        "dtype": data.get("environment", {}).get("dtype"),
        "configs": {
            c: {k: agg[k] for k in ("tokens", "seconds", "tokens_per_s", "speed_ratio")}
            for c, agg in data["aggregate"].items()
        },
        "replies": trace_replies(data["turns"]),
    }


def trace_replies(turns: list[dict[str, Any]]) -> dict[str, list] | None:
    """Each turn's plain reply, labelled ``trace#turn``, in every form the run wrote (``token_ids``,
    ``text``); None where it wrote none."""
    forms = {"token_ids": "output_token_ids", "text": "output_text"}
    replies = {
        form: [[f"{t['trace']}#{t['turn']}", t[key]] for t in turns]
        for form, key in forms.items()
        if turns and all(key in t for t in turns)
    }
    return replies or None


def compare_replies(before: dict[str, list] | None, after: dict[str, list] | None) -> dict[str, Any]:
    """``replies_identical`` of one job, in the strictest form both checkouts wrote (token ids, else
    text); where they differ, the first differing reply; null with a reason where one wrote none."""
    missing = [side for side, replies in (("before", before), ("after", after)) if replies is None]
    if missing:
        reason = f"the {' and '.join(missing)} checkout's output carries no replies"
        return {"replies_identical": None, "replies_reason": reason}
    assert before is not None and after is not None
    form = next((f for f in ("token_ids", "text") if f in before and f in after), None)
    if form is None:
        reason = f"no common form: before wrote {sorted(before)}, after {sorted(after)}"
        return {"replies_identical": None, "replies_reason": reason}
    b, a = before[form], after[form]
    out: dict[str, Any] = {"replies_identical": b == a, "replies_compared": form, "replies": len(a)}
    if b != a:
        i = next((i for i, (x, y) in enumerate(zip(b, a)) if x != y), min(len(b), len(a)))
        out["first_difference"] = {
            "index": i,
            "reply": (a[i] if i < len(a) else b[i])[0],
            "before": b[i][1] if i < len(b) else None,
            "after": a[i][1] if i < len(a) else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--traces", default=",".join(t.name for t in TRACES))
    ap.add_argument("--configs", default="none,prompt_lookup,suffix,model_scheduled,auto")
    ap.add_argument("--loop-max-new-tokens", type=int, default=16)
    ap.add_argument("--loop-rounds", type=int, default=1, help="agent-loop jobs, the order flipping each")
    ap.add_argument("--pass-rounds", type=int, default=0, help="pass-timing jobs, the order flipping each")
    ap.add_argument("--pass-rows", default="1,5,17")
    ap.add_argument("--pass-repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/before_after.json"))
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),  # agentspec.bench.run.DTYPES, without importing torch here
        default="auto",
        help="both checkouts' pairs in this dtype (default auto: each checkout's own default)",
    )
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    result: dict[str, Any] = {
        "commits": {side: environment_of(tree) for side, tree in trees.items()},
        "configs": args.configs,
        "dtype": args.dtype,  # as asked; each job's sides record the dtype they ran in
        "traces": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="before_after_"))
    dtypes = {side: args.dtype if takes_dtype(tree) else None for side, tree in trees.items()}
    jobs = [("trace", t) for t in args.traces.split(",") if t]
    jobs += [("loop", f"agent_loop_{r}" if r else "agent_loop") for r in range(args.loop_rounds)]
    jobs += [("pass", f"passes_{r}") for r in range(args.pass_rounds)]
    for j, (kind, name) in enumerate(jobs):
        order = ["before", "after"] if j % 2 == 0 else ["after", "before"]
        row: dict[str, Any] = {}
        replies: dict[str, dict[str, list] | None] = {}
        for side in order:
            tree = trees[side]
            if kind == "trace":
                out = tmp / f"{side}_{name}.json"
                seconds, _ = run_in(tree, traces_job(tree, name, args.configs, dtypes[side], out))
                figures = trace_figures(out)
            elif kind == "pass":
                dtype = "float32" if args.dtype == "auto" else args.dtype
                argv = [sys.executable, "-c", PASS_RUN, dtype, args.pass_rows, str(args.pass_repeats)]
                seconds, stdout = run_in(tree, argv)
                figures = {**json.loads(stdout.strip().splitlines()[-1]), "replies": None}
            else:
                code = loop_code(tree)
                argv = [sys.executable, "-c", code, str(args.loop_max_new_tokens), args.dtype]
                seconds, stdout = run_in(tree, argv)
                printed = json.loads(stdout.strip().splitlines()[-1])
                figures = {**printed["loop"], "replies": printed["replies"], "dtype": printed["dtype"]}
            check_dtype(args.dtype, side, figures["dtype"])
            replies[side] = figures.pop("replies")  # compared below, not kept whole
            row[side] = {"process_s": seconds, **figures}
            print(f"{name} {side}: {seconds:.0f} s", flush=True)
        if kind != "pass":
            row.update(compare_replies(replies["before"], replies["after"]))
            print(f"{name}: replies identical {row['replies_identical']}", flush=True)
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
    rounds = [row for name, row in result.items() if name.startswith("passes_")]
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
    out["all_replies_identical"] = all_replies_identical([*traces, *loops]) if traces or loops else None
    if rounds:
        out["passes"] = pass_ratios(rounds)
    return out


def pass_ratios(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each pass's median over the rounds of before / after (ms): above 1 is faster after."""
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


def all_replies_identical(rows: list[dict[str, Any]]) -> bool | None:
    """False if any job's replies differ between the checkouts; else None if any job's could not be
    compared; else True."""
    seen = [r["replies_identical"] for r in rows]
    if False in seen:
        return False
    return None if None in seen else True


if __name__ == "__main__":
    raise SystemExit(main())
