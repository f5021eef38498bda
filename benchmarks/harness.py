"""What every suite shares, written once: its arguments, the machine it ran on, its JSON and plot, the
servers it runs beside (``agentspec serve``, a fleet behind vllm-router, vLLM) and the calls it makes.

A suite imports this module and ``benchmarks.workloads``, never another suite. Nothing here imports
torch or agentspec at module level: vLLM's own environment (``.venv-vllm``, which has no agentspec)
runs this file as a script for the offline decode step (``vllm_step``, at the end), and
``python -m benchmarks --help`` lists the suites without loading an engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CALL_TIMEOUT_S = 900.0  # one turn queued behind 7 others on a slow system


# --- arguments, the machine, the output ---------------------------------------------------------


def parser(
    suite: str, doc: str, *, threads: int | None = None, dtype: bool = False
) -> argparse.ArgumentParser:
    """The suite's argument parser: its docstring as help, ``--out`` (``results/<suite>.json``) and
    ``--threads``; ``--dtype`` where the suite loads the pair in a chosen dtype."""
    ap = argparse.ArgumentParser(
        prog=f"python -m benchmarks {suite.replace('_', '-')}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--out", type=Path, default=RESULTS / f"{suite}.json", help="the JSON; its plot beside it"
    )
    ap.add_argument("--threads", type=int, default=threads, help="torch threads (default: %(default)s)")
    if dtype:
        from agentspec.bench.run import add_dtype_argument

        add_dtype_argument(ap)
    return ap


def settings(args: argparse.Namespace, *, leave: tuple[str, ...] = ("out",)) -> dict[str, Any]:
    """The run's arguments as the JSON records them (paths as text), but those in ``leave``."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in leave}


def set_threads(n: int | None) -> None:
    """torch's thread count, where the run names one; None keeps torch's own."""
    if n:
        import torch

        torch.set_num_threads(n)


def in_own_process(fn: Callable[..., Any], *args: Any, threads: int | None = None) -> Any:
    """``fn(*args)`` in a fresh Python process (spawned: nothing inherited but the environment), its
    result pickled back. A system run this way starts as a user's process would and leaves nothing
    behind: no OpenMP pool whose idle threads take the CPUs of the systems run after it, no pair's
    pass thread, no allocator's cache. ``fn`` must be importable (a module-level function)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=set_threads, initargs=(threads,)) as pool:
        return pool.submit(fn, *args).result()


def environment(pair=None) -> dict[str, Any]:
    """CPU, threads, versions and the git commit; the pair's models, device and dtype where given."""
    from agentspec.bench.run import environment as engine_environment

    return engine_environment(pair)


def write(out: Path, result: dict[str, Any], *, part: str | None = None) -> Path:
    """Write ``result`` as ``out``; with ``part``, as that key of ``out``, the other parts kept (a suite
    of several measurements keeps them in one file)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if part is not None:
        whole = json.loads(out.read_text()) if out.exists() else {}
        whole[part] = result
        result = whole
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}" + (f" ({part})" if part else ""), flush=True)
    return out


def run_part(args: argparse.Namespace, parts: dict[str, tuple[Callable, Callable | None]], *inputs) -> dict:
    """``args.part``'s measurement of ``parts`` (``{part: (run, plot or None)}``) on ``inputs``: run, with
    the run's arguments recorded in it, written as that part of ``args.out``, and plotted."""
    run, plot = parts[args.part]
    result = run(args, *inputs)
    result["args"] = settings(args, leave=())
    write(args.out, result, part=args.part)
    if plot is not None:
        plot(result, args.out)
    return result


@contextlib.contextmanager
def figure(out: Path, panels: int = 1, *, part: str | None = None, size=(7.5, 4.5), dpi: int = 110):
    """Axes to draw on (one, or a list of ``panels``); saved as the PNG beside ``out`` (``<stem>_<part>``
    for a part) when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(size[0] * panels, size[1]))
    yield axes
    fig.tight_layout()
    path = Path(out).with_name(Path(out).stem + (f"_{part}" if part else "") + ".png")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


# --- figures --------------------------------------------------------------------------------------


def rotated(items: Sequence[Any], i: int) -> list[Any]:
    """``items`` starting at ``i`` (mod its length): run in this order, no system always goes first and
    the machine's drift hits every one alike."""
    s = i % len(items)
    return [*items[s:], *items[:s]]


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]  # nearest rank


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (0 for fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


# --- the systems a suite runs beside --------------------------------------------------------------


class System:
    """A running system: the URL its clients call, its workers' URLs, and where sessions ran."""

    def __init__(self, name: str, url: str, workers: list[str], fleet=None):
        self.name, self.url, self.workers, self.fleet = name, url, workers, fleet

    def served(self) -> list[int]:
        """Requests each agentspec worker answered with 200 so far (its /metrics); [] for vLLM."""
        import re

        import httpx

        if self.name.startswith("vllm"):
            return []
        pattern = r'agentspec_requests_total\{[^}]*status="200"[^}]*\} (\S+)'
        texts = [httpx.get(f"{w}/metrics", timeout=10).text for w in self.workers]
        return [sum(int(float(v)) for v in re.findall(pattern, t)) for t in texts]

    def placement(self, sessions: list[str]) -> dict[str, list[int]] | None:
        """The worker index of each request of each session: all on worker 0 without a router; from the
        router's log with consistent hashing; None where the router logs no choices (round robin)."""
        if self.fleet is None:
            return {s: [0] for s in sessions}
        if self.fleet.policy != "consistent_hash":
            return None
        placed: dict[str, list[int]] = {s: [] for s in sessions}
        for session, worker in self.fleet.session_choices():
            if session in placed:
                placed[session].append(self.workers.index(worker))
        return placed


SYSTEMS = {
    "single": "one agentspec serve, 2 threads on both CPUs",
    "fleet_hash": "2 agentspec workers (1 CPU each) behind vllm-router, consistent_hash",
    "fleet_rr": "2 agentspec workers (1 CPU each) behind vllm-router, round_robin",
    "vllm_spec": "one vLLM worker, n-gram speculation, prefix caching",
    "vllm_dynamic": "one vLLM worker, n-gram speculation of a draft length per batch size, prefix caching",
    "vllm_plain": "one vLLM worker, prefix caching, no speculation",
    "vllm_eagle3": "one vLLM worker, agentspec's EAGLE-3 head (4 tokens a pass), prefix caching",
}


def vllm_command(port: int, name: str, dtype: str = "float32") -> list[str] | str:
    """The command of the vLLM worker of system ``name``, or why there is none here."""
    from agentspec.fleet.vllm import NGRAM_DYNAMIC_SPECULATION, vllm_worker_command
    from agentspec.models import EAGLE3_HEAD

    if name == "vllm_eagle3" and not EAGLE3_HEAD.exists():
        return f"{EAGLE3_HEAD} is missing"
    head = EAGLE3_HEAD if name == "vllm_eagle3" else None
    speculative = {"vllm_spec": True, "vllm_dynamic": NGRAM_DYNAMIC_SPECULATION}.get(name, False)
    command = vllm_worker_command(port, speculative=speculative, head=head, dtype=dtype)
    if shutil.which(command[0]) is None:
        return f"{command[0]} is missing: make vllm creates .venv-vllm"
    return command


@contextlib.contextmanager
def running(name: str, log_dir: Path, dtype: str = "float32") -> Iterator[System | str]:
    """System ``name`` of ``SYSTEMS`` started (stopped after the block), or a string saying why it cannot
    run here; every engine in it computes in ``dtype``."""
    from agentspec.fleet import Fleet
    from agentspec.fleet.process import ServerProcess, free_port
    from agentspec.fleet.workers import agentspec_worker, cpu_shares

    options = ["--log-level", "warning", "--dtype", dtype]
    if name == "single":
        with agentspec_worker(cpu_shares(1)[0], options=options, log=log_dir / "single.log") as worker:
            yield System(name, worker.url, [worker.url])
    elif name in ("fleet_hash", "fleet_rr"):
        policy = "consistent_hash" if name == "fleet_hash" else "round_robin"
        opts = {"threads_per_worker": 1, "worker_options": options}
        with Fleet(2, policy=policy, log_dir=log_dir / name, **opts) as fleet:
            yield System(name, fleet.url, fleet.workers, fleet)
    else:
        port = free_port()
        command = vllm_command(port, name, dtype=dtype)
        if isinstance(command, str):
            yield command
            return
        with ServerProcess(command, port, log=log_dir / f"{name}.log") as worker:
            yield System(name, worker.url, [worker.url])


# --- one call, through each path ------------------------------------------------------------------


def client(url: str):
    """An ``openai`` client of a system's URL: no retries (a failure is a result), a long timeout."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)


def served_model(url: str) -> str:
    """The served model's name, after one short call under a salt no run uses (first-call costs)."""
    c = client(url)
    model = c.models.list().data[0].id
    hi = [{"role": "user", "content": "Hi"}]
    c.chat.completions.create(model=model, messages=hi, max_tokens=4, extra_body={"cache_salt": "warm"})
    return model


def _greedy(create, session: str, salt: str, n_new: int, **request) -> tuple[Any, dict[str, Any]]:
    """``create(**request)`` greedy, under a session id and a cache salt: the response and its figures."""
    start = time.perf_counter()
    r = create(temperature=0, max_tokens=n_new, extra_headers={"X-Session-ID": session},
               extra_body={"cache_salt": salt}, **request)  # fmt: skip
    details = r.usage.prompt_tokens_details
    return r, {
        "seconds": round(time.perf_counter() - start, 4),
        "prompt_tokens": r.usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details is not None else 0,
        "output_tokens": r.usage.completion_tokens,
    }


def chat_turn(c, model: str, messages: list[dict], session: str, salt: str, n_new: int) -> dict[str, Any]:
    """One greedy turn through ``/v1/chat/completions``, under a session id and a cache salt."""
    r, figures = _greedy(c.chat.completions.create, session, salt, n_new, model=model, messages=messages)
    message = r.choices[0].message
    calls = [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
    return {"text": message.content or "", "tool_calls": calls, **figures}


def completion_turn(c, model: str, ids: list[int], session: str, salt: str, n_new: int) -> dict[str, Any]:
    """One greedy turn as prompt token ids through ``/v1/completions`` (``chat_turn``'s fields; no tools
    are bound, so agentspec parses no calls either)."""
    r, figures = _greedy(c.completions.create, session, salt, n_new, model=model, prompt=ids)
    return {"text": r.choices[0].text, "tool_calls": [], **figures}


def in_process(llm, messages: list[dict]) -> dict[str, Any]:
    """One ``ChatSpecDecode.invoke`` of OpenAI-style messages (``chat_turn``'s fields, arguments as
    dicts)."""
    from langchain_core.messages import convert_to_messages

    start = time.perf_counter()
    reply = llm.invoke(convert_to_messages(messages))
    seconds = time.perf_counter() - start
    usage = reply.usage_metadata
    return {
        "seconds": seconds,
        "text": reply.content,
        "tool_calls": [(c["name"], c["args"]) for c in reply.tool_calls],
        "prompt_tokens": usage["input_tokens"],
        "cached_tokens": usage["input_token_details"].get("cache_read", 0),
        "output_tokens": usage["output_tokens"],
    }


# --- vLLM's offline decode step, run in vLLM's environment ----------------------------------------


def _step_round(llm, ids: list[int], n: int, r: int) -> tuple[float, float]:
    """(seconds of a call of ``n`` new tokens, of a call of one), which goes first turning with ``r``."""
    from vllm import SamplingParams

    def call(m: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=m, min_tokens=m, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == m
        return time.perf_counter() - t0

    times = {m: call(m) for m in ((n, 1) if r % 2 else (1, n))}
    return times[n], times[1]


def vllm_step(argv: list[str] | None = None) -> None:
    """vLLM's one-row decode step: the offline engine (no speculation, no prefix caching, EOS ignored),
    a call of ``--new-tokens`` and one of a single token alternating; the step is their difference over
    the extra tokens. Its threads are vLLM's own (``VLLM_CPU_OMP_THREADS_BIND``, set by the caller).
    ``--paced``: after a warm-up it prints ``READY``, then answers each ``round`` line on its standard
    input with ``ROUND {"long": s, "short": s}`` until ``quit``, so the caller interleaves its own rounds
    with vLLM's and drift hits both alike."""
    ap = argparse.ArgumentParser(description=vllm_step.__doc__)
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
    args = ap.parse_args(argv)
    import torch
    import vllm

    ids, n = json.loads(args.prompt_ids.read_text()), args.new_tokens
    llm = vllm.LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                   gpu_memory_utilization=args.memory_utilization, enable_prefix_caching=False,
                   enforce_eager=args.enforce_eager, seed=0)  # fmt: skip
    _step_round(llm, ids, 2, 0)  # warm-up
    rounds: list[tuple[float, float]] = []
    if args.paced:
        print("READY", flush=True)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            rounds.append(_step_round(llm, ids, n, len(rounds)))
            print("ROUND " + json.dumps(dict(zip(("long", "short"), rounds[-1]))), flush=True)
    else:
        rounds = [_step_round(llm, ids, n, r) for r in range(args.repeats)]
    longs, shorts = [r[0] for r in rounds], [r[1] for r in rounds]
    result = {
        "vllm": vllm.__version__, "torch": torch.__version__, "dtype": args.dtype,
        "prompt_tokens": len(ids), "new_tokens": n, "rounds": len(rounds), "paced": args.paced,
        "enforce_eager": args.enforce_eager, "frontend_torch_threads": torch.get_num_threads(),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }  # fmt: skip
    if rounds:
        step = (statistics.median(longs) - statistics.median(shorts)) / (n - 1)
        best = (min(longs) - min(shorts)) / (n - 1)
        result |= {
            "step_ms": 1000 * step,
            "step_ms_best": 1000 * best,
            "call_s": {str(n): longs, "1": shorts},
        }
    args.out.write_text(json.dumps(result, indent=1))


def vllm_heads(argv: list[str] | None = None) -> None:
    """vLLM decoding prompts greedily with a draft head (``--method`` eagle3 or dflash, a fixed
    ``--k`` tokens a pass, as ``num_speculative_tokens``): its outputs and spec-decode counters."""
    ap = argparse.ArgumentParser(description=vllm_heads.__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=Path, required=True, help="a JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import vllm
    from vllm import SamplingParams

    spec = {"method": args.method, "model": args.head, "num_speculative_tokens": args.k}
    llm = vllm.LLM(model=args.model, dtype=args.dtype, max_model_len=4096, gpu_memory_utilization=0.25,
                   enable_prefix_caching=False, enforce_eager=True, speculative_config=spec,
                   disable_log_stats=False, seed=0)  # fmt: skip
    prompts = json.loads(args.prompts.read_text())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    result = {"vllm": vllm.__version__, "speculative_config": spec, "seconds": seconds, "counters": counters,
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":  # vllm.LLM starts an engine process: the guard is required
    if len(sys.argv) > 1 and sys.argv[1] == "heads":
        vllm_heads(sys.argv[2:])
    else:
        vllm_step()
