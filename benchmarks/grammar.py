"""Tool calls and structured output under a grammar: speculation and jump-forward, each on and off.

    python -m benchmarks grammar [--threads 1] [--max-tokens 96] [--tasks N]

On the embedded pair, greedy, through ChatSpecDecode (the real path): the 20 tool-calling prompts of
``benchmarks.workloads.PROMPTS`` with ``tool_choice="any"`` (one call each) and its 5 structured-output
prompts (``with_structured_output``, json_schema). Four configurations, run side by side for each prompt
(the order rotating) so that drift hits them alike: ``plain`` (``speculative=False, jump_forward=False``:
constrained decoding, one token a pass), ``jump_forward`` (forced tokens appended, forced text proposed
as drafts, no drafter), ``speculation`` (prompt-lookup drafts, no jump-forward) and ``both`` (the
default). The prefix cache is off so that every call pays the same prefill. Reported per configuration:
seconds, output tokens per second, the speed-up over plain, the share of tokens the grammar forced,
jump-forward and drafter acceptance, valid results; and whether every output equals plain's
(``identical_outputs``: greedy decoding is lossless, so it must). Writes JSON and a PNG.
"""

from __future__ import annotations

import time

import agentspec
from benchmarks import harness
from benchmarks.workloads import PROMPTS, STRUCTURED, TOOLS
from langchain_agentspec import ChatSpecDecode

CONFIGS = {
    "plain": {"speculative": False, "jump_forward": False},
    "jump_forward": {"speculative": False, "jump_forward": True},
    "speculation": {"speculative": True, "jump_forward": False},
    "both": {"speculative": True, "jump_forward": True},
}
COUNTS = ("seconds", "output", "forced", "jf_drafted", "jf_accepted", "drafted", "accepted", "steps", "valid")


def run_one(pair, options: dict, task, max_tokens: int) -> tuple[float, dict, object]:
    """One task under one configuration: (seconds, the reply's stats, the calls or parsed object)."""
    kind, prompt, schema = task
    llm = ChatSpecDecode(pair=pair, max_tokens=max_tokens, prefix_cache=False, **options)
    start = time.perf_counter()
    if kind == "tool":
        message = llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False).invoke(prompt)
        result = [(c["name"], c["args"]) for c in message.tool_calls]
    else:
        out = llm.with_structured_output(schema, include_raw=True).invoke(prompt)
        message, result = out["raw"], out["parsed"] and out["parsed"].model_dump()
    return time.perf_counter() - start, message.response_metadata["stats"], result


def add(t: dict, seconds: float, stats: dict, result) -> None:
    """One reply's figures added to its configuration's totals, jump-forward's drafts apart."""
    jf = stats["jump_forward_tokens"], stats["jump_forward_accepted"]
    counts = (seconds, stats["output_tokens"], stats["forced_tokens"], *jf, stats["draft_tokens"] - jf[0],
              stats["accepted_tokens"] - jf[1], stats["verify_steps"], bool(result))  # fmt: skip
    for key, value in zip(COUNTS, counts, strict=True):
        t[key] += value


def figures(name: str, t: dict, plain_s: float, tasks: int) -> dict:
    def ratio(a, b, digits=3):
        return round(a / b, digits) if b else None

    return {**CONFIGS[name], "seconds": round(t["seconds"], 2), "output_tokens": t["output"],
            "tokens_per_second": ratio(t["output"], t["seconds"], 2),
            "speedup_vs_plain": ratio(plain_s, t["seconds"]),
            "forced_share": ratio(t["forced"], t["output"]),
            "jump_forward_acceptance": ratio(t["jf_accepted"], t["jf_drafted"]),
            "drafter_acceptance": ratio(t["accepted"], t["drafted"]),
            "tokens_per_pass": ratio(t["output"] - t["forced"], t["steps"]),
            "valid_results": f"{t['valid']}/{tasks}"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("grammar", __doc__, threads=1)
    ap.add_argument("--max-tokens", type=int, default=96, help="per reply")
    ap.add_argument("--tasks", type=int, default=None, help="the first N tasks only (a quick check)")
    args = ap.parse_args(argv)
    harness.set_threads(args.threads)
    pair = agentspec.load_pair(draft_model=False)  # no draft model: prompt lookup and jump-forward
    tasks = [("tool", p, None) for p, _ in PROMPTS] + [("structured", t, s) for s, t in STRUCTURED]
    tasks = tasks[: args.tasks]
    run_one(pair, CONFIGS["both"], tasks[0], args.max_tokens)  # warm-up: grammar compile, first-call costs
    totals = {name: dict.fromkeys(COUNTS, 0) for name in CONFIGS}
    same = True
    for i, task in enumerate(tasks):
        results = {}
        for name in harness.rotated(list(CONFIGS), i):
            seconds, stats, results[name] = run_one(pair, CONFIGS[name], task, args.max_tokens)
            add(totals[name], seconds, stats, results[name])
        same &= all(r == results["plain"] for r in results.values())
        print(
            f"{i + 1:2d}/{len(tasks)} {task[0]:10s} "
            + "  ".join(f"{n} {t['seconds']:6.1f}s" for n, t in totals.items())
        )
    plain_s = totals["plain"]["seconds"]
    report = {name: figures(name, t, plain_s, len(tasks)) for name, t in totals.items()}
    harness.write(
        args.out, {"identical_outputs": same, "configs": report, "environment": harness.environment(pair)}
    )
    with harness.figure(args.out, size=(6, 3.2), dpi=120) as ax:
        tps = [c["tokens_per_second"] for c in report.values()]
        ax.bar(list(report), tps, color=["#999", "#7a9", "#79c", "#35a"])
        for i, c in enumerate(report.values()):
            ax.text(i, tps[i], f"{c['speedup_vs_plain']:.2f}x", ha="center", va="bottom")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Constrained tool calls and structured output", fontsize=9)
    return 0 if same else 1
