"""The agent loop through LangChain chat models: agentspec full and baseline against ChatHuggingFace.

Run from the repository root:

    python -m benchmarks.bench_langchain_loop [--out benchmarks/results/bench_agent_loop] \
        [--full | --loop-max-new-tokens 16] [--device cpu] [--dtype auto|float32|bfloat16]

The work is the core's ``agentspec.bench.workloads.agent_loop``: 8 tool-calling calls over a growing
~1,200-token prefix, OpenAI-format messages converted here to LangChain's. Each call's systems run
in a rotating order: agentspec full (``ChatSpecDecode()`` defaults: the auto drafter and the prefix
cache), agentspec baseline (``speculative=False, prefix_cache=False``: the same loop as a plain
local model), and ``ChatHuggingFace`` over a transformers pipeline on the same loaded target (when
``langchain-huggingface`` is installed: langchain-agentspec's ``test`` extra). The single-call rows,
the roofline and llama.cpp are ``agentspec bench``; ``make bench`` runs both. It lives here, beside
the other benchmarks, so that the installed integration carries no benchmark code.

Writes ``<out>.json`` (``loop``: the summary, ``loop_rows``: each call's figures, the goal, the
environment), ``<out>.md`` and ``<out>.png`` (per-call latency). ``run_agent_loop`` returns the
same figures without writing, for a caller that compares two builds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage, convert_to_messages
from tqdm.auto import tqdm

import agentspec
from agentspec.bench import report, workloads
from agentspec.bench.run import add_dtype_argument, warm_up
from agentspec.bench.run import environment as core_environment
from langchain_agentspec import ChatSpecDecode

DEFAULT_OUT = Path("benchmarks/results/bench_agent_loop")
LOOP_MAX_NEW_TOKENS = {"quick": 16, "full": 48}  # per call

# The agent-loop goal of issue 9, as (key, what, threshold), in the form of ``report.GOALS``.
GOALS = (("loop_vs_chat_huggingface", "agent loop: agentspec full vs ChatHuggingFace, end to end", 4.0),)


def loop_calls() -> list[list[BaseMessage]]:
    """The messages of each of the loop's 8 calls (``workloads.agent_loop``) as LangChain messages."""
    return [convert_to_messages(messages) for messages in workloads.agent_loop()]


def without_tool_messages(messages: list[BaseMessage]) -> list[BaseMessage]:
    """The same conversation for a chat model that takes no tool messages (``ChatHuggingFace``
    raises on them): a call is written in the assistant's turn as the system prompt asks
    (``<tool_call>{...}</tool_call>``), and its result comes as a user message."""
    out: list[BaseMessage] = []
    for m in messages:
        if isinstance(m, AIMessage) and m.tool_calls:
            body = [json.dumps({"name": c["name"], "arguments": c["args"]}) for c in m.tool_calls]
            out.append(AIMessage("".join(f"<tool_call>{b}</tool_call>" for b in body)))
        elif isinstance(m, ToolMessage):
            out.append(HumanMessage(f"Tool result: {m.content}"))
        else:
            out.append(m)
    return out


def chat_huggingface(pair, max_new_tokens: int):
    """``ChatHuggingFace`` over a local ``HuggingFacePipeline`` on the pair's loaded target; None when
    ``langchain-huggingface`` is not installed."""
    try:
        from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    except ImportError:
        return None
    from transformers import pipeline

    pipe = pipeline(
        "text-generation",
        model=pair.target,
        tokenizer=pair.tokenizer,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_full_text=False,
    )
    return ChatHuggingFace(llm=HuggingFacePipeline(pipeline=pipe), tokenizer=pair.tokenizer)


def loop_systems(pair, max_new_tokens: int, cache_bytes: int) -> dict[str, Any]:
    """The agent loop's chat models by name (ChatHuggingFace only when installed)."""
    systems: dict[str, Any] = {
        # its own prefix cache, empty at the start of the loop: nothing carried over from other work
        "agentspec full": ChatSpecDecode(pair=pair, max_tokens=max_new_tokens, prefix_cache=cache_bytes),
        "agentspec baseline": ChatSpecDecode(
            pair=pair, max_tokens=max_new_tokens, speculative=False, prefix_cache=False
        ),
    }
    hf = chat_huggingface(pair, max_new_tokens)
    if hf is not None:
        systems["ChatHuggingFace"] = hf
    return systems


def agent_loop(pair, chat_models: dict[str, Any], bar=None) -> list[dict[str, Any]]:
    """Each of the loop's calls by every chat model, the first system rotating call by call; per
    call and system: seconds, reply text and the reply's token usage."""
    rows = []
    names = list(chat_models)
    for j, messages in enumerate(loop_calls()):
        row: dict[str, Any] = {"call": j, "systems": {}}
        s0 = j % len(names)
        for s in names[s0:] + names[:s0]:
            model = chat_models[s]
            given = without_tool_messages(messages) if s == "ChatHuggingFace" else messages
            t0 = time.perf_counter()
            reply = model.invoke(given)
            seconds = time.perf_counter() - t0
            usage = reply.usage_metadata or {}
            row["systems"][s] = {
                "seconds": seconds,
                "text": reply.content,
                "prompt_tokens": usage.get("input_tokens"),
                "cached_tokens": (usage.get("input_token_details") or {}).get("cache_read"),
                "output_tokens": usage.get("output_tokens"),
            }
            if bar is not None:
                bar.update(1)
        rows.append(row)
    return rows


def summarise_loop(rows: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    totals = {s: sum(r["systems"][s]["seconds"] for r in rows) for s in systems}
    out: dict[str, Any] = {"calls": len(rows), "total_seconds": totals}
    for ref in ("ChatHuggingFace", "agentspec baseline"):
        if ref in totals:
            out[f"speedup_vs_{ref}"] = {s: totals[ref] / totals[s] for s in systems}
    out["full_equals_baseline"] = all(
        r["systems"]["agentspec full"]["text"] == r["systems"]["agentspec baseline"]["text"] for r in rows
    )
    return out


def goals(loop: dict[str, Any]) -> list[dict[str, Any]]:
    vs_hf = loop.get("speedup_vs_ChatHuggingFace") or {}
    return report.goal_rows(GOALS, {"loop_vs_chat_huggingface": vs_hf.get("agentspec full")})


def run_agent_loop(
    pair=None, loop_max_new_tokens: int = 16, device: str | None = None, dtype: str = "auto"
) -> dict[str, Any]:
    """The agent loop on ``pair`` (default: ``agentspec.load_pair(device=device, dtype=dtype)``) after an
    untimed warm-up of the code paths it takes: ``{"loop": summary, "loop_rows": per call, "goals": ...}``."""
    pair = pair if pair is not None else agentspec.load_pair(device=device, dtype=dtype)
    # generate() is what ChatHuggingFace's pipeline runs; the full and baseline models decode with
    # the auto drafter and without one
    warm_up(pair, ["transformers generate", "agentspec none", "agentspec auto"])
    chat_models = loop_systems(pair, loop_max_new_tokens, cache_bytes=1 << 30)
    total = len(workloads.agent_loop()) * len(chat_models)
    with tqdm(total=total, desc="agentspec bench: agent loop", unit="call") as bar:
        rows = agent_loop(pair, chat_models, bar)
    loop = summarise_loop(rows, list(chat_models))
    if "ChatHuggingFace" not in chat_models:
        loop["note"] = "ChatHuggingFace skipped: langchain-huggingface is not installed"
    return {"loop": loop, "loop_rows": rows, "goals": goals(loop)}


def environment(pair) -> dict[str, Any]:
    """The core bench's environment, with the LangChain packages' versions (None: not installed)."""
    env = core_environment(pair)
    for name in ("langchain-core", "langchain-huggingface"):
        try:
            env[name.replace("-", "_")] = version(name)
        except PackageNotFoundError:
            env[name.replace("-", "_")] = None
    return env


def markdown(result: dict[str, Any]) -> str:
    loop = result["loop"]
    lines = [
        "# agentspec bench: the agent loop",
        "",
        f"{report.where(result['environment'])}; {result['settings']['loop_max_new_tokens']} new tokens "
        "per call. Greedy throughout; each call's systems in a rotating order.",
        "",
        *report.goals_table(result["goals"]),
        "",
        f"## Agent loop ({loop['calls']} calls over a growing ~1,200-token prefix)",
        "",
        "| system | total s | vs ChatHuggingFace | vs agentspec baseline |",
        "| --- | --- | --- | --- |",
    ]
    for s, total in loop["total_seconds"].items():
        vs_hf = (loop.get("speedup_vs_ChatHuggingFace") or {}).get(s)
        vs_base = (loop.get("speedup_vs_agentspec baseline") or {}).get(s)
        lines.append(f"| {s} | {total:.1f} | {report.fmt(vs_hf)}x | {report.fmt(vs_base)}x |")
    lines += [
        "",
        f"agentspec full's replies equal the baseline's: {'yes' if loop['full_equals_baseline'] else 'NO'}. "
        "ChatHuggingFace takes no tool messages: it gets each tool call as `<tool_call>` text in the "
        "assistant's turn and each result as a user message (`Tool result: ...`), so its prompts and "
        "replies differ a little from the others'.",
    ]
    if "note" in loop:
        lines += ["", loop["note"] + "."]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["loop_rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in result["loop"]["total_seconds"]:
        ax.plot(range(1, len(rows) + 1), [r["systems"][s]["seconds"] for r in rows], marker="o", label=s)
    title = "Per-call latency across the agent loop"
    return report.finish_plot(fig, ax, title, "call in the agent loop", "seconds", path)


def run(
    out: Path = DEFAULT_OUT, loop_max_new_tokens: int = 16, device: str | None = None, dtype: str = "auto"
) -> dict[str, Any]:
    """``run_agent_loop`` on a freshly loaded pair, written to ``<out>.json``, ``.md`` and ``.png``
    (``environment["dtype"]``: the dtype ``dtype`` resolved to)."""
    t_start = time.perf_counter()
    pair = agentspec.load_pair(device=device, dtype=dtype)
    env = environment(pair)
    settings = {"loop_max_new_tokens": loop_max_new_tokens, "out": str(out), "device": device, "dtype": dtype}
    result = {"settings": settings, "environment": env, **run_agent_loop(pair, loop_max_new_tokens)}
    result["wall_s"] = time.perf_counter() - t_start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    result["plots"] = [str(plot(result, out.with_suffix(".png")))]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="path stem of the .json/.md/.png files")
    parser.add_argument("--full", action="store_true", help="longer replies (48 new tokens a call)")
    parser.add_argument("--loop-max-new-tokens", type=int, help="per call (quick 16, full 48)")
    parser.add_argument("--device", help="cpu, cuda, ... (default: CUDA when available)")
    add_dtype_argument(parser)
    args = parser.parse_args(argv)
    n = args.loop_max_new_tokens or LOOP_MAX_NEW_TOKENS["full" if args.full else "quick"]
    result = run(args.out, n, args.device, args.dtype)
    print(args.out.with_suffix(".md").read_text())
    print("wrote", args.out.with_suffix(".json"), *result["plots"])
    return 0 if result["loop"]["full_equals_baseline"] else 1


if __name__ == "__main__":
    sys.exit(main())
