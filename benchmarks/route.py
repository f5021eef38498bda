"""The route of one call, counted: the repository's named functions and files that run in one greedy
``ChatSpecDecode.invoke`` after a warm-up, in the engine's share, and in one drafted pass.

    python -m benchmarks route [--checkout DIR ...] [--drafters auto,model,suffix] [--runs 3]

Counted with a profiler (``sys.setprofile`` and ``threading.setprofile``: the caller's thread and the
pair's pass thread), not by reading: a function counts when it is called at least once, named by its
file and qualified name, nested functions included; lambdas, comprehensions and module bodies are
not (their names start with "<"). The engine is ``agentspec/`` less ``chat/``, ``telemetry/``,
``serve/``, ``bench/``, ``distill/``, ``fleet/`` and ``cli.py``. A drafted pass is a pass of the call
after its first (the prefill) that fed more than one row, delimited by the scheduler's per-pass
observer; the largest such pass is reported. Each (checkout, drafter) runs in a fresh process of
its own, with that checkout's packages first on ``sys.path``, ``--runs`` times; the largest count of
the runs is kept (a count moves with which drafts ``auto`` picks). ``--checkout`` measures other
checkouts (``git worktree add``) with this file's code, so a baseline and today are counted alike.
Each engine function's statements (its body's, nested definitions apart) are counted from the source:
the longest ones are listed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ENGINE_OUTSIDE = ("agentspec/chat/", "agentspec/telemetry/", "agentspec/serve/", "agentspec/bench/",
                  "agentspec/distill/", "agentspec/fleet/", "agentspec/cli.py")  # fmt: skip
SOURCES = ("agentspec/", "integrations/", "toolcalls/")
PROMPT = "List three things a weather tool could return for a city, one short line each."
WARM_UP = "Say hello to the user in one short sentence."


def in_engine(path: str) -> bool:
    return path.startswith("agentspec/") and not path.startswith(ENGINE_OUTSIDE)


class Recorder:
    """The profile hook: the repository's named functions called while ``on``, in all, and per pass
    of the pair's pass thread (``passes``: one set per pass, ``rows``: the rows each fed)."""

    def __init__(self, root: Path):
        self.root = str(root) + os.sep
        self.on = False
        self.called: set[tuple[str, str, int]] = set()
        self.passes: list[set[tuple[str, str, int]]] = []
        self.rows: list[int] = []
        self._in_pass = threading.local()

    def hook(self, frame, event, arg):
        if event != "call" or not self.on:
            return
        code = frame.f_code
        name = code.co_qualname
        # "<module>", "<lambda>", and comprehensions' own frames ("<listcomp>", "<genexpr>": functions
        # of their own before Python 3.12 inlined them) are not named functions
        if not code.co_filename.startswith(self.root) or name.rpartition(".")[2].startswith("<"):
            return
        path = code.co_filename[len(self.root) :]
        if not path.startswith(SOURCES):  # the repository's packages, not a virtual environment inside it
            return
        key = (path, name, code.co_firstlineno)
        self.called.add(key)
        current = getattr(self._in_pass, "functions", None)
        if current is not None:
            current.add(key)

    def observer(self, scheduler):
        """The scheduler's per-pass observer: one set of functions per pass, and the rows it fed."""
        recorder = self

        class Pass:
            def __enter__(self):
                self.rows = scheduler.stats.rows
                recorder._in_pass.functions = set()

            def __exit__(self, *exc):
                recorder.passes.append(recorder._in_pass.functions)
                recorder.rows.append(scheduler.stats.rows - self.rows)
                recorder._in_pass.functions = None

        return Pass


def child(drafter: str, max_tokens: int) -> dict[str, Any]:
    """One count, in this process: the checkout whose packages come first on ``sys.path``."""
    import agentspec
    from langchain_agentspec import ChatSpecDecode

    root = Path(agentspec.__file__).resolve().parent.parent
    llm = ChatSpecDecode(drafter=drafter, max_tokens=max_tokens)
    llm.invoke(WARM_UP)
    llm.invoke(PROMPT + " ")  # warm: every kind of pass and drafter path has run once
    recorder = Recorder(root)
    sys.setprofile(recorder.hook)
    threading.setprofile(recorder.hook)
    with llm.load().scheduler.observing(recorder.observer(llm.load().scheduler)):
        recorder.on = True
        reply = llm.invoke(PROMPT)
        recorder.on = False
    sys.setprofile(None)
    threading.setprofile(None)
    drafted = [p for p, rows in zip(recorder.passes[1:], recorder.rows[1:]) if rows > 1]
    largest = max(drafted, key=len, default=set())
    return {
        "root": str(root),
        "reply": reply.content,
        "speculative": reply.response_metadata.get("speculative"),
        "call": sorted(recorder.called),
        "passes": len(recorder.passes),
        "drafted_passes": len(drafted),
        "drafted_pass": sorted(largest),
    }


def counts(functions: list[list]) -> dict[str, Any]:
    found = {(f, q, line) for f, q, line in functions}
    return {"functions": len(found), "files": len({f for f, _, _ in found})}


def statements(root: Path, functions: set[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """Each function's statements (nested definitions count one each and are counted on their own),
    longest first; a profiled function is found by its file and first line (a decorator's, if any)."""
    wanted = {(f, line) for f, _, line in functions}
    out = []
    for path in sorted({f for f, _ in wanted}):
        for node in ast.walk(ast.parse((root / path).read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and (path, _first_line(node)) in wanted
            ):
                out.append(
                    {"file": path, "function": node.name, "line": node.lineno, "statements": _count(node)}
                )
    return sorted(out, key=lambda r: -r["statements"])


def _first_line(node) -> int:
    return node.decorator_list[0].lineno if node.decorator_list else node.lineno


def _count(fn) -> int:
    n, todo = 0, list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        n += isinstance(node, ast.stmt)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return n


def measure(checkout: Path, drafter: str, runs: int, max_tokens: int) -> dict[str, Any]:
    """``runs`` counts in fresh processes with ``checkout``'s packages first; the largest kept."""
    paths = [checkout, checkout / "integrations" / "langchain", checkout / "toolcalls"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)), OMP_NUM_THREADS="1")
    best: dict[str, Any] = {}
    tallies = []
    for _ in range(runs):
        cmd = [sys.executable, str(HERE), "--child", drafter, "--max-tokens", str(max_tokens)]
        done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{checkout} {drafter}: {done.stderr[-3000:]}")
        run = json.loads(done.stdout.strip().splitlines()[-1])
        call = [tuple(x) for x in run["call"]]
        engine = [x for x in call if in_engine(x[0])]
        tally = {"call": counts(call), "engine": counts(engine), "drafted_pass": counts(run["drafted_pass"]),
                 "passes": run["passes"], "drafted_passes": run["drafted_passes"],
                 "speculative": run["speculative"]}  # fmt: skip
        tallies.append(tally)
        if not best or tally["call"]["functions"] > best["tally"]["call"]["functions"]:
            best = {"tally": tally, "engine_functions": engine, "root": run["root"]}
    engine = {tuple(x) for x in best["engine_functions"]}
    out = {k: max(t[k]["functions"] for t in tallies) for k in ("call", "engine", "drafted_pass")}
    return {
        "max_functions": out,
        "max_files": {k: max(t[k]["files"] for t in tallies) for k in ("call", "engine", "drafted_pass")},
        "runs": tallies,
        "longest_engine_functions": statements(Path(best["root"]), engine)[:10],
        "engine_functions": sorted(f"{f}:{q}" for f, q, _ in engine),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks route", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--checkout", type=Path, action="append", help="another checkout to count (repeatable)")
    ap.add_argument("--drafters", default="auto,model,suffix")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "route.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.max_tokens)))
        return 0
    checkouts = [HERE.parent.parent, *(args.checkout or [])]
    result: dict[str, Any] = {"settings": {"drafters": args.drafters, "runs": args.runs,
                                           "max_tokens": args.max_tokens, "prompt": PROMPT}}  # fmt: skip
    for checkout in checkouts:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                                text=True).stdout.strip()  # fmt: skip
        for drafter in args.drafters.split(","):
            row = measure(checkout.resolve(), drafter, args.runs, args.max_tokens)
            result[f"{commit} {drafter}"] = row
            print(f"route: {commit} {drafter}: {json.dumps(row['max_functions'])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
