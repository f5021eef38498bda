"""The recorded agent traces in process and through ``agentspec serve``, interleaved turn by turn.

Run from the repository root (about 10 minutes on 2 shared CPU cores):

    python -m benchmarks.bench_serve [--max-new-tokens 48] [--threads 1] [--traces a,b]

Replays the conversations of ``agent_traces.py`` (22 assistant turns over 300-1,100-token prompts):
at every assistant turn the same history goes to ``ChatSpecDecode`` on a pair in this process and,
over HTTP with the ``openai`` client, to an ``agentspec serve`` subprocess with its own pair of the
same weights (both greedy, both with their own prefix cache and drafting memory, filled the same
way by the same turns). The two calls of a turn run one after the other, in an order that flips
every turn so machine drift hits both alike; the server process idles while this one decodes and
the other way round. Every HTTP reply must equal the in-process reply. Writes JSON (--out) and a PNG
next to it: per-turn latency of both paths, and the HTTP path's overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import openai  # noqa: E402
import torch  # noqa: E402
from langchain_core.messages import convert_to_messages  # noqa: E402

import agentspec  # noqa: E402
from agentspec.bench.run import environment  # noqa: E402
from agentspec.chat import parse_reply  # noqa: E402
from agentspec.fleet.process import (  # noqa: E402
    ServerProcess,
    agentspec_serve_command,
    checkout_env,
    free_port,
)
from benchmarks.agent_traces import TRACES, calls  # noqa: E402
from langchain_agentspec import ChatSpecDecode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def openai_messages(history: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The trace's messages as the chat API takes them: tool calls as ``tool_calls`` with ids, and each
    tool result naming the call it answers (the recorded turns keep their calls as Hermes text)."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the calls not answered yet, in order
    for m in history:
        if m["role"] == "assistant":
            reply = parse_reply(m["content"])
            m = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:  # ids fixed by position: every turn renders its history alike
                m["tool_calls"] = [
                    {**c, "id": f"call_{len(out)}_{i}"} for i, c in enumerate(reply.tool_calls)
                ]
                pending = [c["id"] for c in m["tool_calls"]]
        elif m["role"] == "tool":
            m = {**m, "tool_call_id": pending.pop(0)}
        out.append(m)
    return out


def in_process(llm: ChatSpecDecode, messages: list[dict]) -> dict[str, Any]:
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


def over_http(client: openai.OpenAI, model: str, messages: list[dict], n_new: int) -> dict[str, Any]:
    start = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=n_new)
    seconds = time.perf_counter() - start
    message = r.choices[0].message
    details = r.usage.prompt_tokens_details
    return {
        "seconds": seconds,
        "text": message.content or "",
        "tool_calls": [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []],
        "prompt_tokens": r.usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details is not None else 0,
        "output_tokens": r.usage.completion_tokens,
    }


def replay(llm: ChatSpecDecode, client: openai.OpenAI, traces, n_new: int) -> list[dict[str, Any]]:
    turns = []
    for trace in traces:
        for n, (history, _) in enumerate(calls(trace)):
            messages = openai_messages(history)
            paths = {
                "in_process": lambda m=messages: in_process(llm, m),
                "http": lambda m=messages: over_http(client, llm.model_name, m, n_new),
            }
            order = list(paths) if len(turns) % 2 == 0 else list(paths)[::-1]
            rows = {name: paths[name]() for name in order}
            same = all(
                rows["http"][k] == rows["in_process"][k] for k in ("text", "tool_calls", "output_tokens")
            )
            turns.append({"trace": trace.name, "turn": n, "first": order[0], "same_reply": same, **rows})
            a, b = rows["in_process"], rows["http"]
            print(
                f"{trace.name:>12} turn {n}: in process {a['seconds']:6.2f} s, http {b['seconds']:6.2f} s "
                f"(prompt {a['prompt_tokens']}, cache {a['cached_tokens']}/{b['cached_tokens']}, "
                f"out {a['output_tokens']}){'' if same else '  REPLIES DIFFER'}",
                flush=True,
            )
    return turns


def summarise(turns: list[dict[str, Any]]) -> dict[str, Any]:
    local = sum(t["in_process"]["seconds"] for t in turns)
    http = sum(t["http"]["seconds"] for t in turns)
    overhead = [t["http"]["seconds"] - t["in_process"]["seconds"] for t in turns]
    return {
        "turns": len(turns),
        "same_replies": sum(t["same_reply"] for t in turns),
        "in_process_s": round(local, 3),
        "http_s": round(http, 3),
        "http_over_in_process": round(http / local, 4),
        "median_overhead_ms": round(1000 * statistics.median(overhead), 1),
        "goal": "the HTTP path within 10% of in process",
        "goal_met": http / local <= 1.10,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = result["turns"]
    x = range(len(turns))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(x, [t["in_process"]["seconds"] for t in turns], "o-", label="ChatSpecDecode in process")
    ax.plot(x, [t["http"]["seconds"] for t in turns], "s--", label="openai client -> agentspec serve")
    s = result["summary"]
    ax.set_title(f"Agent-trace turns: HTTP / in process = {s['http_over_in_process']:.3f} (total)")
    ax.set_xlabel("turn (5 recorded conversations)")
    ax.set_ylabel("latency (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    ap.add_argument("--traces", default=None, help="comma-separated trace names (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve.json")
    args = ap.parse_args(argv)
    traces = [t for t in TRACES if args.traces is None or t.name in args.traces.split(",")]
    torch.set_num_threads(args.threads)
    pair = agentspec.load_pair()
    env = environment(pair)  # at the start: the git commit and dirty paths the run used
    llm = ChatSpecDecode(pair=pair, max_tokens=args.max_new_tokens)
    port = free_port()
    command = agentspec_serve_command(port, "--threads", str(args.threads))
    with ServerProcess(command, port, env=checkout_env()) as server:
        url = server.url
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        warm = [{"role": "user", "content": "Hi"}]  # first-call costs on both sides, outside the timing
        in_process(llm, warm), over_http(client, llm.model_name, warm, 4)
        turns = replay(llm, client, traces, args.max_new_tokens)
    result = {
        "benchmark": "agent traces in process vs through agentspec serve (interleaved)",
        "environment": env,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "summary": summarise(turns),
        "turns": turns,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))
    return 0 if result["summary"]["same_replies"] == len(turns) else 1


if __name__ == "__main__":
    sys.exit(main())
