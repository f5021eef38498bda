"""``agentspec serve`` over HTTP against in process, and what logprobs and n cost a request.

    python -m benchmarks serve [--part http] [--max-tokens 48] [--threads 1] [--traces a,b]
    python -m benchmarks serve --part choices [--rounds 4] [--prompts 2] [--threads 2] [--vllm]

``http`` (10 minutes on 2 CPU cores): at every assistant turn of the recorded agent traces
(``workloads.TRACES``, 22 turns over 300-1,100-token prompts) the same history goes to ``ChatSpecDecode``
on a pair in this process and, through the ``openai`` client, to an ``agentspec serve`` subprocess with
its own pair of the same weights (both greedy, each with its own prefix cache and drafting memory,
filled alike by the same turns). The two calls of a turn run one after the other, which first turning
every turn, so drift hits both alike; each process idles while the other decodes. Every HTTP reply must
equal the in-process reply (text, tool calls, output tokens). The goal: HTTP within 10% of in process
over all turns.

``choices`` (15 minutes with vLLM, whose start is most of it): ``agentspec serve`` and, with ``--vllm``,
vLLM's OpenAI server on the same weights with n-gram speculation, each started once and idle while the
other decodes. Each round sends every case to every server, in an order that turns every round, over
late turns of the traces (long prompts), each request under a fresh ``cache_salt`` so it prefills its
whole prompt (n choices share that one prefill): ``plain`` (greedy), ``logprobs`` (greedy, 5
alternatives), ``n1`` and ``n4`` (temperature 0.8, seeded). ``n1`` runs with the seed of each of
``n4``'s choices (agentspec's choice i is seed + i's), so n = 4 is set beside the single requests of
its choices' lengths: its time over the longest of them (one request as long) and over their sum (the
four one after another), and whether each choice equals its single request. Ratios are medians of
pairs of the same round, prompt and seed.

Writes one key per part in ``results/serve.json``; ``serve_http.png``: each turn's latency both ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks import harness, workloads
from benchmarks.workloads import TRACES, calls, openai_messages

THREADS = {"http": 1, "choices": 2}  # torch threads of each process, where --threads names none
STARTUP_TIMEOUT_S = 600.0
CASES = {
    "plain": {"temperature": 0},
    "logprobs": {"temperature": 0, "logprobs": True, "top_logprobs": 5},
    "n1": {"temperature": 0.8, "n": 1},
    "n4": {"temperature": 0.8, "n": 4},
}
N = 4  # the choices of "n4"


# --- http: the traces in process and through the server -------------------------------------------


def over_http(c, model: str, messages: list[dict], n_new: int) -> dict[str, Any]:
    """One greedy turn through the server, its tool calls' arguments parsed as in process."""
    r = harness.chat_turn(c, model, messages, session="serve", salt=None, n_new=n_new)
    return r | {"tool_calls": [(name, json.loads(arguments)) for name, arguments in r["tool_calls"]]}


def replay(llm, c, traces: list[Any], n_new: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for trace in traces:
        for n, (history, _) in enumerate(calls(trace)):
            messages = openai_messages(history)
            paths = {
                "in_process": lambda m=messages: harness.in_process(llm, m),
                "http": lambda m=messages: over_http(c, llm.model_name, m, n_new),
            }
            order = harness.rotated(list(paths), len(turns))
            rows = {name: paths[name]() for name in order}
            a, b = rows["in_process"], rows["http"]
            same = all(a[k] == b[k] for k in ("text", "tool_calls", "output_tokens"))
            turns.append({"trace": trace.name, "turn": n, "first": order[0], "same_reply": same, **rows})
            print(f"{trace.name:>12} turn {n}: in process {a['seconds']:6.2f} s, http {b['seconds']:6.2f} s "
                  f"(prompt {a['prompt_tokens']}, cache {a['cached_tokens']}/{b['cached_tokens']}, "
                  f"out {a['output_tokens']}){'' if same else '  REPLIES DIFFER'}", flush=True)  # fmt: skip
    return turns


def http(args: argparse.Namespace, traces: list[Any]) -> dict[str, Any]:
    import agentspec
    from agentspec.fleet.process import ServerProcess, agentspec_serve_command, checkout_env, free_port
    from langchain_agentspec import ChatSpecDecode

    pair = agentspec.load_pair()
    env = harness.environment(pair)  # at the start: the git commit and dirty paths the run used
    llm = ChatSpecDecode(pair=pair, max_tokens=args.max_tokens)
    port = free_port()
    command = agentspec_serve_command(port, "--threads", str(args.threads))
    with ServerProcess(command, port, env=checkout_env()) as server:
        c = harness.client(server.url)
        warm = [{"role": "user", "content": "Hi"}]  # first-call costs on both sides, outside the timing
        harness.in_process(llm, warm), over_http(c, llm.model_name, warm, 4)
        turns = replay(llm, c, traces, args.max_tokens)
    local, remote = (sum(t[path]["seconds"] for t in turns) for path in ("in_process", "http"))
    summary = {
        "turns": len(turns),
        "same_replies": sum(t["same_reply"] for t in turns),
        "in_process_s": round(local, 3),
        "http_s": round(remote, 3),
        "http_over_in_process": round(remote / local, 4),
        "median_overhead_ms": round(
            1000 * statistics.median(t["http"]["seconds"] - t["in_process"]["seconds"] for t in turns), 1
        ),
        "goal": "the HTTP path within 10% of in process",
        "goal_met": remote / local <= 1.10,
    }
    return {"environment": env, "max_new_tokens": args.max_tokens, "threads": args.threads,
            "summary": summary, "turns": turns}  # fmt: skip


def plot_http(result: dict[str, Any], out: Path) -> None:
    turns = result["turns"]
    with harness.figure(out, part="http", size=(9, 4)) as ax:
        ax.plot([t["in_process"]["seconds"] for t in turns], "o-", label="ChatSpecDecode in process")
        ax.plot([t["http"]["seconds"] for t in turns], "s--", label="openai client -> agentspec serve")
        ratio = result["summary"]["http_over_in_process"]
        ax.set(title=f"Agent-trace turns: HTTP / in process = {ratio:.3f} (total)", ylabel="latency (s)",
               xlabel=f"turn ({len({t['trace'] for t in turns})} recorded conversations)")  # fmt: skip
        ax.legend()


# --- choices: logprobs and n ----------------------------------------------------------------------


def servers(args: argparse.Namespace, stack: ExitStack, logs: Path) -> dict[str, str]:
    """Each server's base URL, started (and stopped when ``stack`` closes)."""
    from agentspec.fleet.process import ServerProcess, agentspec_serve_command, checkout_env, free_port
    from agentspec.fleet.vllm import vllm_worker

    port = free_port()
    options = ["--threads", str(args.threads), "--log-level", "warning", "--max-num-seqs", "8"]
    command, wait = agentspec_serve_command(port, *options), STARTUP_TIMEOUT_S
    log = logs / "agentspec.log"
    processes = {
        "agentspec": ServerProcess(command, port, env=checkout_env(), log=log, startup_timeout_s=wait)
    }
    if args.vllm:
        log = logs / "vllm.log"
        processes["vllm"] = vllm_worker(free_port(), threads=args.threads, log=log, startup_timeout_s=wait)
    return {name: stack.enter_context(process).url for name, process in processes.items()}


def request(c, model: str, messages: list[dict], case: str, seed: int, max_tokens: int) -> dict[str, Any]:
    options = {**CASES[case], "seed": seed, "max_tokens": max_tokens}
    start = time.perf_counter()
    reply = c.chat.completions.create(model=model, messages=messages, **options,
                                      extra_body={"cache_salt": uuid.uuid4().hex})  # fmt: skip
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "prompt_tokens": reply.usage.prompt_tokens,
        "completion_tokens": reply.usage.completion_tokens,
        "choices": len(reply.choices),
        "logprob_entries": [len(ch.logprobs.content) if ch.logprobs else None for ch in reply.choices],
        "texts": [ch.message.content for ch in reply.choices],
    }


def rounds(urls: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (server, case, seed offset) each round, over ``args.prompts`` late turns of the traces."""
    turns = [calls(trace)[-1 - i][0] for i in range(args.prompts) for trace in TRACES]
    histories = [openai_messages(h) for h in turns[: args.prompts]]
    clients = {server: harness.client(url) for server, url in urls.items()}
    models = {server: harness.served_model(url) for server, url in urls.items()}
    todo = [(s, case, k) for s in urls for case in CASES for k in range(N if case == "n1" else 1)]
    out = []
    for r in range(args.rounds):
        for i, messages in enumerate(histories):
            for server, case, k in harness.rotated(todo, r * 5):
                c, model = clients[server], models[server]
                row = request(c, model, messages, case, seed=r + k, max_tokens=args.max_tokens)
                out.append({"round": r, "prompt": i, "server": server, "case": case, "seed": r + k, **row})
                print(f"round {r} prompt {i} {server:9s} {case:8s} seed {r + k} {row['seconds']:.2f} s "
                      f"{row['completion_tokens']} tokens", flush=True)  # fmt: skip
    return out


def n4_beside_singles(rows: list[dict], server: str) -> list[dict[str, Any]]:
    """Each n = 4 request beside the single requests of its choices' seeds: its time over the longest
    of them and over their sum, and whether each choice is its seed's single reply."""
    mine = [r for r in rows if r["server"] == server]
    out = []
    for r in (r for r in mine if r["case"] == "n4"):
        same = [
            s for s in mine if s["case"] == "n1" and (s["round"], s["prompt"]) == (r["round"], r["prompt"])
        ]
        singles = sorted(same, key=lambda s: s["seed"])
        times = [s["seconds"] for s in singles]
        out.append({
            "round": r["round"], "prompt": r["prompt"],
            "over_longest_single": r["seconds"] / max(times),
            "over_sum_of_singles": r["seconds"] / sum(times),
            "choice_tokens": r["completion_tokens"],
            "single_tokens": [s["completion_tokens"] for s in singles],
            "choices_equal_their_seeds": r["texts"] == [s["texts"][0] for s in singles],
        })  # fmt: skip
    return out


def choices_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds per (server, case); per server, the median of logprobs over plain taken side by
    side (same round, prompt and seed) and of n = 4 over its singles."""
    median, ratios, n4 = {}, {}, {}
    for server in sorted({r["server"] for r in rows}):
        mine = [r for r in rows if r["server"] == server]
        for case in CASES:
            median[f"{server}/{case}"] = statistics.median(r["seconds"] for r in mine if r["case"] == case)
        plain = {(r["round"], r["prompt"], r["seed"]): r["seconds"] for r in mine if r["case"] == "plain"}
        ratios[f"{server}: logprobs / plain"] = statistics.median(
            r["seconds"] / plain[r["round"], r["prompt"], r["seed"]] for r in mine if r["case"] == "logprobs"
        )
        n4[server] = n4_beside_singles(rows, server)
        for what in ("over_longest_single", "over_sum_of_singles"):
            ratios[f"{server}: n4 {what}"] = statistics.median(c[what] for c in n4[server])
    return {"median_s": median, "ratios": ratios, "n4": n4}


def choices(args: argparse.Namespace, traces: list[Any]) -> dict[str, Any]:
    import agentspec

    env = harness.environment(agentspec.load_pair(warm_up=False))  # at the start: commit, machine, load
    logs = Path(tempfile.mkdtemp(prefix="serve-choices-"))
    print(f"the servers' logs: {logs}", flush=True)
    with ExitStack() as stack:
        rows = rounds(servers(args, stack, logs), args)
    return {"environment": env, **choices_summary(rows), "rows": rows}


PARTS = {"http": (http, plot_http), "choices": (choices, None)}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("serve", __doc__)
    ap.add_argument("--part", choices=PARTS, default="http")
    ap.add_argument("--max-tokens", type=int, default=48, help="new tokens a request")
    ap.add_argument("--traces", help="http: comma-separated trace names (default: all)")
    ap.add_argument("--rounds", type=int, default=4, help="choices: rounds")
    ap.add_argument("--prompts", type=int, default=2, help="choices: trace histories a round")
    ap.add_argument("--vllm", action="store_true", help="choices: vLLM beside it (.venv-vllm)")
    args = ap.parse_args(argv)
    args.threads = args.threads or THREADS[args.part]
    harness.set_threads(args.threads)
    result = harness.run_part(args, PARTS, workloads.traces_named(args.traces))
    print(json.dumps(result.get("summary") or result["ratios"], indent=1))
    return 0 if all(t["same_reply"] for t in result.get("turns", [])) else 1
