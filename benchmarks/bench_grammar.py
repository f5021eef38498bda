"""Constrained tool calls and structured output: speculation and jump-forward, each on and off.

    .venv/bin/python -m benchmarks.bench_grammar [--threads 1] [--out benchmarks/results/grammar.json]

On the embedded SmolLM2-135M-Instruct, greedy, through ChatSpecDecode (the real path): the 20 tool-
calling prompts of ``grammar_tasks.py`` (shared with ``tests/test_chat_grammar.py``) with
``tool_choice="any"`` (one call each) and 5 structured-output prompts (``with_structured_output``,
json_schema). Four configurations, run side by side for each prompt (the order rotates) so that
machine noise hits them alike:

- plain: ``speculative=False, jump_forward=False``, plain constrained decoding, one token per pass
- jump-forward only: no drafter; forced tokens appended, forced text proposed as drafts
- speculation only: prompt-lookup drafts, no jump-forward
- both (the default)

The prefix cache is off everywhere so each call pays the same prefill. Reported per configuration:
wall time, output tokens per second, speed-up over plain, the share of output tokens the grammar
forced (no model guess), jump-forward and drafter acceptance, and whether every output equals the
plain one (it must: greedy decoding is lossless).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import agentspec
from benchmarks.grammar_tasks import PROMPTS, STRUCTURED, TOOLS
from langchain_agentspec import ChatSpecDecode

CONFIGS = {
    "plain": {"speculative": False, "jump_forward": False},
    "jump_forward": {"speculative": False, "jump_forward": True},
    "speculation": {"speculative": True, "jump_forward": False},
    "both": {"speculative": True, "jump_forward": True},
}


def run_one(pair, options: dict, task) -> tuple[float, dict, object]:
    kind, prompt, schema = task
    llm = ChatSpecDecode(pair=pair, max_tokens=96, prefix_cache=False, **options)
    start = time.perf_counter()
    if kind == "tool":
        bound = llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False)
        message = bound.invoke(prompt)
        result = [(c["name"], c["args"]) for c in message.tool_calls]
    else:
        out = llm.with_structured_output(schema, include_raw=True).invoke(prompt)
        message, result = out["raw"], out["parsed"]
        result = result.model_dump() if result is not None else None
    return time.perf_counter() - start, message.response_metadata["stats"], result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/grammar.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = agentspec.load_pair(draft_model=False)  # as in the committed results: no draft model
    tasks = [("tool", p, None) for p, _ in PROMPTS] + [("structured", t, s) for s, t in STRUCTURED]
    run_one(pair, CONFIGS["both"], tasks[0])  # warm up (grammar compile, first-call costs)

    totals = {name: {"seconds": 0.0, "output": 0, "forced": 0, "jf_drafted": 0, "jf_accepted": 0,
                     "drafted": 0, "accepted": 0, "steps": 0, "valid": 0} for name in CONFIGS}  # fmt: skip
    same = True
    names = list(CONFIGS)
    for i, task in enumerate(tasks):
        order = names[i % 4 :] + names[: i % 4]
        results = {}
        for name in order:
            seconds, stats, result = run_one(pair, CONFIGS[name], task)
            t = totals[name]
            t["seconds"] += seconds
            t["output"] += stats["output_tokens"]
            t["forced"] += stats["forced_tokens"]
            t["jf_drafted"] += stats["jump_forward_tokens"]
            t["jf_accepted"] += stats["jump_forward_accepted"]
            t["drafted"] += stats["draft_tokens"] - stats["jump_forward_tokens"]
            t["accepted"] += stats["accepted_tokens"] - stats["jump_forward_accepted"]
            t["steps"] += stats["verify_steps"]
            t["valid"] += bool(result)
            results[name] = result
        same &= all(r == results["plain"] for r in results.values())
        print(f"{i + 1:2d}/{len(tasks)} {task[0]:10s} " + "  ".join(
            f"{n} {totals[n]['seconds']:6.1f}s" for n in names), flush=True)  # fmt: skip

    base = totals["plain"]["seconds"]
    report = {}
    for name, t in totals.items():
        report[name] = {
            **CONFIGS[name],
            "seconds": round(t["seconds"], 2),
            "output_tokens": t["output"],
            "tokens_per_second": round(t["output"] / t["seconds"], 2),
            "speedup_vs_plain": round(base / t["seconds"], 3),
            "forced_share": round(t["forced"] / t["output"], 3),
            "jump_forward_acceptance": round(t["jf_accepted"] / t["jf_drafted"], 3)
            if t["jf_drafted"]
            else None,
            "drafter_acceptance": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
            "tokens_per_pass": round((t["output"] - t["forced"]) / t["steps"], 3),
            "valid_results": f"{t['valid']}/{len(tasks)}",
        }
    out = {
        "benchmark": "grammar-constrained tool calls (20) and structured output (5), greedy",
        "model": pair.name,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), cpu",
        "identical_outputs": same,
        "configs": report,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        xs = list(report)
        ax.bar(xs, [report[x]["tokens_per_second"] for x in xs], color=["#999", "#7a9", "#79c", "#35a"])
        for i, x in enumerate(xs):
            ax.text(i, report[x]["tokens_per_second"], f"{report[x]['speedup_vs_plain']:.2f}x", ha="center",
                    va="bottom")  # fmt: skip
        ax.set_ylabel("output tokens / s")
        ax.set_title("Constrained tool calls + structured output (SmolLM2-135M, CPU)", fontsize=9)
        fig.tight_layout()
        fig.savefig(Path(args.out).with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
