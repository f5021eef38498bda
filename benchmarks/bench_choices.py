"""What logprobs and n cost a request to ``agentspec serve``, beside vLLM and an earlier agentspec.

Run from the repository root (about 15 minutes on 2 CPU cores with vLLM, whose start is most of it):

    python -m benchmarks.bench_choices [--rounds 4] [--max-tokens 48] [--base DIR] [--vllm]

Servers on 127.0.0.1, each started once, every one idle while another decodes: ``agentspec serve``
from this checkout; with ``--base DIR``, the same from another checkout (``git worktree add DIR
<commit>``: a request without logprobs before and after); with ``--vllm``, vLLM's OpenAI server on the
same weights and dtype with n-gram speculation (``agentspec.fleet.vllm``). Each round sends every
case to every server that takes it, in an order that turns every round so drift hits all alike, over
agent-trace histories (``agent_traces.py``) with a fresh ``cache_salt`` per request, so every request
prefills its whole prompt (n choices share that one prefill):

- ``plain``: greedy, no logprobs; ``logprobs``: greedy, ``logprobs`` with 5 alternatives;
- ``n1`` and ``n4``: sampled (temperature 0.8, seeded), one choice and four.

Writes JSON (--out): every request's seconds and tokens, and the ratios the issue sets goals on
(logprobs against plain, plain against the base, n = 4 against n = 1, each per server).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai

import agentspec
from agentspec.bench.run import environment
from agentspec.fleet.process import ServerProcess, agentspec_serve_command, checkout_env, free_port
from agentspec.fleet.vllm import vllm_worker
from benchmarks.agent_traces import TRACES, calls
from benchmarks.bench_serve import openai_messages

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 600.0
CASES = {
    "plain": {"temperature": 0},
    "logprobs": {"temperature": 0, "logprobs": True, "top_logprobs": 5},
    "n1": {"temperature": 0.8, "n": 1},
    "n4": {"temperature": 0.8, "n": 4},
}
BASE_CASES = ("plain",)
N = 4  # the choices of "n4"  # an earlier agentspec answers neither logprobs nor n


def histories(count: int) -> list[list[dict]]:
    """``count`` agent-trace histories, from every trace in turn (a late turn of each: long prompts)."""
    turns = [calls(trace)[-1 - i][0] for i in range(count) for trace in TRACES]
    return [openai_messages(h) for h in turns[:count]]


def servers(args: argparse.Namespace, stack: ExitStack, logs: Path) -> dict[str, str]:
    """Each server's base URL, started (and stopped when ``stack`` closes)."""
    envs = {"agentspec": checkout_env()}
    if args.base:
        base = str(Path(args.base).resolve())
        envs["base"] = {**os.environ, "PYTHONPATH": base, "OMP_WAIT_POLICY": "PASSIVE"}
    options = ["--threads", str(args.threads), "--log-level", "warning", "--max-num-seqs", "8"]
    processes = {}
    for name, env in envs.items():
        port = free_port()
        command = agentspec_serve_command(port, *options)
        log = logs / f"{name}.log"
        processes[name] = ServerProcess(command, port, env=env, log=log, startup_timeout_s=STARTUP_TIMEOUT_S)
    if args.vllm:
        log, wait = logs / "vllm.log", STARTUP_TIMEOUT_S
        processes["vllm"] = vllm_worker(free_port(), threads=args.threads, log=log, startup_timeout_s=wait)
    return {name: stack.enter_context(process).url for name, process in processes.items()}


def request(url: str, messages: list[dict], case: str, seed: int, max_tokens: int) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    options = {
        **CASES[case],
        "seed": seed,
        "max_tokens": max_tokens,
        "extra_body": {"cache_salt": uuid.uuid4().hex},
    }
    start = time.perf_counter()
    reply = client.chat.completions.create(model=MODEL, messages=messages, **options)
    seconds = time.perf_counter() - start
    tokens = [len(c.logprobs.content) if c.logprobs else None for c in reply.choices]
    return {
        "seconds": seconds,
        "prompt_tokens": reply.usage.prompt_tokens,
        "completion_tokens": reply.usage.completion_tokens,
        "choices": len(reply.choices),
        "logprob_entries": tokens,
        "texts": [c.message.content for c in reply.choices],
    }


def jobs(urls: dict[str, str], cases: list[str]) -> list[tuple[str, str, int]]:
    """(server, case, seed offset): ``n1`` with the seeds of the four choices of ``n4``, so that n = 4
    is set beside the single requests of its choices' lengths (agentspec's choice i is seed + i's)."""
    out = []
    for server in urls:
        for case in [c for c in cases if server != "base" or c in BASE_CASES]:
            out += [(server, case, k) for k in range(N if case == "n1" else 1)]
    return out


def rounds(urls: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    todo, out = jobs(urls, args.cases.split(",")), []
    for r in range(args.rounds):
        turn = todo[r * 5 % len(todo) :] + todo[: r * 5 % len(todo)]
        for i, messages in enumerate(histories(args.prompts)):
            for server, case, k in turn:
                row = request(urls[server], messages, case, seed=r + k, max_tokens=args.max_tokens)
                out.append({"round": r, "prompt": i, "server": server, "case": case, "seed": r + k, **row})
                print(f"round {r} prompt {i} {server:9s} {case:8s} seed {r + k} {row['seconds']:.2f} s "
                      f"{row['completion_tokens']} tokens", flush=True)  # fmt: skip
    return out


def _paired(rows: list[dict], server: str, case: str, against: str, of: str | None = None) -> list[float]:
    """Per (round, prompt): ``server``'s ``case`` seconds over ``of``'s (default: the same server's)
    ``against`` seconds, the same seed."""

    def key(r: dict) -> tuple:
        return r["round"], r["prompt"], r["seed"]

    base = {key(r): r["seconds"] for r in rows if r["server"] == (of or server) and r["case"] == against}
    return [
        r["seconds"] / base[key(r)]
        for r in rows
        if r["server"] == server and r["case"] == case and key(r) in base
    ]


def choices(rows: list[dict], server: str) -> list[dict[str, Any]]:
    """Each n = 4 request beside the single requests of its choices' seeds: its time over the longest
    of them (one request of the same length) and over their sum (the four one after another)."""
    out = []
    for r in (r for r in rows if r["server"] == server and r["case"] == "n4"):
        singles = [s for s in rows if s["server"] == server and s["case"] == "n1"
                   and (s["round"], s["prompt"]) == (r["round"], r["prompt"])]  # fmt: skip
        singles.sort(key=lambda s: s["seed"])
        times = [s["seconds"] for s in singles]
        t = r["seconds"]
        out.append({
            "round": r["round"], "prompt": r["prompt"],
            "over_longest_single": t / max(times), "over_sum_of_singles": t / sum(times),
            "choice_tokens": r["completion_tokens"],
            "single_tokens": [s["completion_tokens"] for s in singles],
            "choices_equal_their_seeds": r["texts"] == [s["texts"][0] for s in singles],
        })  # fmt: skip
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds per (server, case), and the ratios the goals are on, per server (medians of
    ratios taken side by side: same round, prompt and seed)."""
    median = {}
    for server in sorted({r["server"] for r in rows}):
        for case in CASES:
            times = [r["seconds"] for r in rows if r["server"] == server and r["case"] == case]
            if times:
                median[f"{server}/{case}"] = statistics.median(times)
    ratios, n4 = {}, {}
    for server in ("agentspec", "vllm"):
        if f"{server}/logprobs" in median and f"{server}/plain" in median:
            ratios[f"{server}: logprobs / plain"] = statistics.median(
                _paired(rows, server, "logprobs", "plain")
            )
        if f"{server}/n4" in median and f"{server}/n1" in median:
            n4[server] = choices(rows, server)
            for what in ("over_longest_single", "over_sum_of_singles"):
                ratios[f"{server}: n4 {what}"] = statistics.median(c[what] for c in n4[server])
    if "base/plain" in median:
        ratios["agentspec plain / base plain"] = statistics.median(
            _paired(rows, "agentspec", "plain", "plain", "base")
        )
    return {"median_s": median, "ratios": ratios, "n4": n4}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--base", help="another checkout's root, served as 'base'")
    parser.add_argument("--vllm", action="store_true", help="vLLM beside it (.venv-vllm)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"a comma list of {', '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/choices.json")
    args = parser.parse_args()
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = environment(agentspec.load_pair(warm_up=False))  # at the start: the commit, the machine, the load
    with ExitStack() as stack:
        urls = servers(args, stack, logs)
        rows = rounds(urls, args)
    result = {
        "environment": env,
        "args": {k: str(v) for k, v in vars(args).items()},
        **summary(rows),
    }
    result["rows"] = rows
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ratios"], indent=1))


if __name__ == "__main__":
    main()
