"""The agent loop through LangChain chat models against ChatHuggingFace; tracing's estimate and its cost.

    python -m benchmarks loop [--part loop] [--max-new-tokens 48] [--dtype auto|float32|bfloat16]
    python -m benchmarks loop --part telemetry [--rounds 2] [--tasks 6] [--max-new-tokens 64] \
        [--drafter auto] [--overhead-reps 10] [--threads 1]

``loop`` (the default): the core's ``agentspec.bench.workloads.agent_loop``, 8 tool-calling calls over
a growing ~1,200-token prefix, by three chat models, each call's systems in a rotating order: agentspec
full (``ChatSpecDecode()``'s defaults: the auto drafter, a prefix cache of its own, empty at the start),
agentspec baseline (``speculative=False, prefix_cache=False``: the same loop as a plain local model) and
``ChatHuggingFace`` over a transformers pipeline on the same loaded target (if ``langchain-huggingface``
is installed). ChatHuggingFace takes no tool messages: it gets each call as ``<tool_call>`` text in the
assistant's turn and each result as a user message, so its prompts differ a little. Reported: each
system's total, the speed-ups over ChatHuggingFace and the baseline, the goal, and whether full's replies
equal the baseline's (greedy decoding: they must). ``agentspec bench`` measures the single calls; the loop
lives here so that no installed package carries benchmark code (``run_agent_loop``: for ``before-after``).

``telemetry``: (a) is the latency-saved estimate right? The agent of ``examples/agent_demo.py`` runs in
rounds, each twice, task by task, the order alternating so drift hits both alike: full (the drafter, a
fresh prefix cache) and baseline (``speculative=False, prefix_cache=False``). Each full call's span
estimates what the baseline would take; the baseline run measures it call for call (greedy: the same
calls; a round whose replies differ is flagged and left out). Compared: the summed ``latency_saved_s``
against the measured difference, inside the decoder (what the estimate models) and end to end. A
baseline call's span estimates itself (``baseline_self_estimate_*``: how far a plain call's estimate
lands). The cost model is calibrated once, explicitly (tracing never calibrates); each round starts from
it, and a baseline run's passes never refresh the full run's estimates. (b) What does tracing cost? A
48-token decode with the SDK configured and with none, ABBA, the median of the paired ratios; the
machine's noise exceeds that cost, so the instrumentation is also timed alone: a recorded call's Steps
replayed through ``CallTrace``, as a fraction of that call's decode.

Writes ``results/loop.json`` (one key per part), ``loop.png`` and ``loop_telemetry.png`` beside it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage, convert_to_messages

import agentspec
from agentspec.bench import report, workloads
from agentspec.bench.conversation import prompt_ids
from benchmarks import harness
from langchain_agentspec import ChatSpecDecode

# (key, what, threshold), in the form of ``agentspec.bench.report.GOALS``
GOALS = (("loop_vs_chat_huggingface", "agent loop: agentspec full vs ChatHuggingFace, end to end", 4.0),)
OVERHEAD_PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3
OVERHEAD_TOKENS = 48


# --- the agent loop -------------------------------------------------------------------------------


def loop_calls() -> list[list[BaseMessage]]:
    """The messages of each of the loop's 8 calls (``workloads.agent_loop``) as LangChain messages."""
    return [convert_to_messages(messages) for messages in workloads.agent_loop()]


def without_tool_messages(messages: list[BaseMessage]) -> list[BaseMessage]:
    """The same conversation for a chat model that takes no tool messages (``ChatHuggingFace`` raises
    on them): a call is written in the assistant's turn as the system prompt asks
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


def chat_models(pair, max_new_tokens: int) -> dict[str, Any]:
    """The loop's chat models by name; ChatHuggingFace (over a ``HuggingFacePipeline`` on the pair's
    loaded target) only where ``langchain-huggingface`` is installed."""
    models: dict[str, Any] = {
        # its own prefix cache, empty at the start of the loop: nothing carried over from other work
        "agentspec full": ChatSpecDecode(pair=pair, max_tokens=max_new_tokens, prefix_cache=1 << 30),
        "agentspec baseline": ChatSpecDecode(
            pair=pair, max_tokens=max_new_tokens, speculative=False, prefix_cache=False
        ),
    }
    try:
        from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    except ImportError:
        return models
    from transformers import pipeline

    pipe = pipeline("text-generation", model=pair.target, tokenizer=pair.tokenizer,
                    max_new_tokens=max_new_tokens, do_sample=False, return_full_text=False)  # fmt: skip
    models["ChatHuggingFace"] = ChatHuggingFace(
        llm=HuggingFacePipeline(pipeline=pipe), tokenizer=pair.tokenizer
    )
    return models


def agent_loop(models: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of the loop's calls by every chat model, the first system rotating call by call; per call
    and system: seconds, reply text and the reply's token usage."""
    rows = []
    for j, messages in enumerate(loop_calls()):
        row: dict[str, Any] = {"call": j, "systems": {}}
        for s in harness.rotated(list(models), j):
            given = without_tool_messages(messages) if s == "ChatHuggingFace" else messages
            t0 = time.perf_counter()
            reply = models[s].invoke(given)
            seconds = time.perf_counter() - t0
            usage = reply.usage_metadata or {}
            row["systems"][s] = {
                "seconds": seconds,
                "text": reply.content,
                "prompt_tokens": usage.get("input_tokens"),
                "cached_tokens": (usage.get("input_token_details") or {}).get("cache_read"),
                "output_tokens": usage.get("output_tokens"),
            }
        print(f"call {j}: " + ", ".join(f"{s} {v['seconds']:.2f} s" for s, v in row["systems"].items()))
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


def run_agent_loop(pair, loop_max_new_tokens: int = 16) -> dict[str, Any]:
    """The agent loop on ``pair`` after an untimed warm-up of the code paths it takes:
    ``{"loop": summary, "loop_rows": per call, "goals": ...}``."""
    from agentspec.bench.run import warm_up

    # generate() is what ChatHuggingFace's pipeline runs; full and baseline decode with the auto
    # drafter and without one
    warm_up(pair, ["transformers generate", "agentspec none", "agentspec auto"])
    models = chat_models(pair, loop_max_new_tokens)
    rows = agent_loop(models)
    loop = summarise_loop(rows, list(models))
    if "ChatHuggingFace" not in models:
        loop["note"] = "ChatHuggingFace skipped: langchain-huggingface is not installed"
    return {"loop": loop, "loop_rows": rows, "goals": goals(loop)}


def loop_part(args) -> dict[str, Any]:
    start = time.perf_counter()
    pair = agentspec.load_pair(dtype=args.dtype)
    env = harness.environment(pair)
    for name in ("langchain-core", "langchain-huggingface"):  # None: not installed
        try:
            env[name.replace("-", "_")] = version(name)
        except PackageNotFoundError:
            env[name.replace("-", "_")] = None
    n = args.max_new_tokens or 48
    result = {"settings": {"loop_max_new_tokens": n, "dtype": args.dtype}, "environment": env}
    result |= run_agent_loop(pair, n)
    result["wall_s"] = time.perf_counter() - start
    print(json.dumps(result["loop"], indent=1))
    return result


def plot_loop(result: dict[str, Any], out) -> None:
    rows = result["loop_rows"]
    with harness.figure(out, size=(8, 4.5)) as ax:
        for s in result["loop"]["total_seconds"]:
            ax.plot(range(1, len(rows) + 1), [r["systems"][s]["seconds"] for r in rows], marker="o", label=s)
        ax.set(
            xlabel="call in the agent loop", ylabel="seconds", title="Per-call latency across the agent loop"
        )
        ax.legend()


# --- telemetry: the latency-saved estimate, tracing's overhead -----------------------------------


def span_rows(spans: list) -> list[dict[str, Any]]:
    """Each call span's duration and the figures its attributes carry."""
    from agentspec.telemetry import attributes as A

    fields = {"decode_s": A.DECODE_TIME, "baseline_estimate_s": A.BASELINE_ESTIMATE,
              "latency_saved_s": A.LATENCY_SAVED, "prompt_tokens": A.USAGE_INPUT_TOKENS,
              "cache_read_tokens": A.USAGE_CACHE_READ_INPUT_TOKENS, "output_tokens": A.USAGE_OUTPUT_TOKENS,
              "draft_tokens": A.DRAFT_TOKENS, "accepted_tokens": A.ACCEPTED_TOKENS,
              "forced_tokens": A.FORCED_TOKENS, "verify_steps": A.VERIFY_STEPS}  # fmt: skip
    return [
        {
            "duration_s": (s.end_time - s.start_time) / 1e9,
            **{k: s.attributes.get(a) for k, a in fields.items()},
        }
        for s in spans
    ]


def self_estimate(calls: list[dict]) -> dict[str, float]:
    """How far plain calls' estimates of themselves land from their measurements, as fractions."""
    return {
        "baseline_self_estimate_over_decode": sum(c["latency_saved_s"] for c in calls)
        / sum(c["decode_s"] for c in calls),
        "baseline_self_estimate_worst_call": max(abs(c["latency_saved_s"]) / c["decode_s"] for c in calls),
    }


def saved(estimated: float, decode_diff: float, wall_diff: float) -> dict[str, float | None]:
    return {
        "estimated_saved_s": estimated,
        "measured_saved_decode_s": decode_diff,
        "measured_saved_wall_s": wall_diff,
        "estimate_over_measured_decode": estimated / decode_diff if decode_diff else None,
        "estimate_over_measured_wall": estimated / wall_diff if wall_diff else None,
    }


def one_round(pair, args, r: int, provider, memory) -> dict[str, Any]:
    """Round ``r``: the agent's tasks run full and baseline, task by task, and the two compared."""
    from agentspec.cost import cost_model, set_cost_model
    from examples import agent_demo

    common = {"pair": pair, "max_tokens": args.max_new_tokens, "tracer_provider": provider}
    llms = {  # the full run's prefix cache is its own, empty: no reuse of an earlier round's prompts
        "full": ChatSpecDecode(**common, prefix_cache=512 << 20, drafter=args.drafter),
        "base": ChatSpecDecode(**common, speculative=False, prefix_cache=False),
    }
    runs: dict[str, dict[str, Any]] = {kind: {"wall_s": 0.0, "calls": []} for kind in llms}
    replies: dict[str, list] = {kind: [] for kind in llms}
    orders = []
    for t, task in enumerate(agent_demo.TASKS[: args.tasks]):
        orders.append(("full", "base") if (r + t) % 2 == 0 else ("base", "full"))
        for kind in orders[-1]:
            memory.clear()
            # a baseline call's passes refresh the cost model: put back after it, unseen by the full run
            kept = dataclasses.replace(cost_model(pair))
            print(f"\nround {r + 1}, task {t + 1}, {kind}:", flush=True)
            wall, states, _ = agent_demo.run(llms[kind], kind, [task])
            runs[kind]["wall_s"] += wall
            runs[kind]["calls"] += span_rows(agent_demo.call_spans(memory))
            replies[kind] += [agent_demo.replies(s) for s in states]
            if kind == "base":
                set_cost_model(pair, kept)
    runs["full"]["cost_model_after"] = cost_model(pair).as_dict()
    full, base = runs["full"]["calls"], runs["base"]["calls"]
    same = replies["full"] == replies["base"]
    row = {"comparable": same and len(full) == len(base), "order": orders, "same_answers": same}
    if not row["comparable"]:  # greedy decoding is lossless: the round measured different work
        print(f"round {r + 1}: NOT COMPARABLE: the runs differ (a losslessness bug?)", flush=True)
        return row | {"replies": replies, "runs": runs}
    decode_diff = sum(c["decode_s"] for c in base) - sum(c["decode_s"] for c in full)
    row |= saved(
        sum(c["latency_saved_s"] for c in full), decode_diff, runs["base"]["wall_s"] - runs["full"]["wall_s"]
    )
    row |= {"baseline_self_estimate_s": sum(c["latency_saved_s"] for c in base), **self_estimate(base)}
    row["per_call"] = [
        {"estimated_baseline_s": f["baseline_estimate_s"], "measured_baseline_decode_s": b["decode_s"],
         "full_decode_s": f["decode_s"], "prompt_tokens": f["prompt_tokens"],
         "cache_read_tokens": f["cache_read_tokens"],
         "output_tokens": (f["output_tokens"], b["output_tokens"])}
        for f, b in zip(full, base, strict=True)
    ]  # fmt: skip
    print(f"round {r + 1}: estimated saved {row['estimated_saved_s']:.2f} s, measured {decode_diff:.2f} s "
          "in the decoder", flush=True)  # fmt: skip
    return row | {"runs": runs}


def replay(pair, steps: list, providers: dict, n: int) -> float:
    """Seconds per call of the instrumentation alone: a recorded call's Steps through ``CallTrace``."""
    from agentspec.decode import Run
    from agentspec.telemetry import CallInfo, Telemetry

    config = agentspec.GenerationConfig(max_new_tokens=OVERHEAD_TOKENS, temperature=0.0, speculative=True)
    telemetry = Telemetry(**providers)  # one per caller, as the chat model keeps one

    def restamped():
        for s in steps:  # each pass as just begun: the trace reads Step.started on the call's clock
            s.started = time.perf_counter()
            yield s

    t0 = time.perf_counter()
    for _ in range(n):
        call = telemetry.call(CallInfo(pair.name, config))
        replayed = Run(pair, restamped())  # the call's record, as agentspec.decode.run gives it
        for _ in replayed:
            pass
        call.end(replayed.close())
    return (time.perf_counter() - t0) / n


def overhead(pair, reps: int) -> dict[str, Any]:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracer_provider, meter_provider = TracerProvider(), MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    providers = {
        "sdk": {"tracer_provider": tracer_provider, "meter_provider": meter_provider},
        "none": {
            "tracer_provider": trace.NoOpTracerProvider(),
            "meter_provider": metrics.NoOpMeterProvider(),
        },
    }
    times: dict[str, list[float]] = {"sdk": [], "none": []}
    for i in range(2 * reps):
        kind = ("sdk", "none", "none", "sdk")[i % 4]  # ABBA
        llm = ChatSpecDecode(pair=pair, max_tokens=OVERHEAD_TOKENS, prefix_cache=False, **providers[kind])
        t0 = time.perf_counter()
        llm.invoke(OVERHEAD_PROMPT)
        times[kind].append(time.perf_counter() - t0)
    # each traced decode against the untraced one next to it (drift cancels within a pair)
    paired = [a / b for a, b in zip(times["sdk"], times["none"], strict=True)]
    ids = prompt_ids(pair.tokenizer, [{"role": "user", "content": OVERHEAD_PROMPT}])
    steps = list(agentspec.stream(pair, ids, max_new_tokens=OVERHEAD_TOKENS, prefix_cache=False))
    per_call = {kind: replay(pair, steps, p, 300) for kind, p in providers.items()}
    tracer_provider.shutdown()
    meter_provider.shutdown()
    decode_s = sum(s.seconds for s in steps)
    print(f"tracing: end to end {statistics.median(paired):.4f}x; instrumentation alone "
          f"{100 * per_call['sdk'] / decode_s:.3f}% of a decode")  # fmt: skip
    return {
        "decode_new_tokens": OVERHEAD_TOKENS,
        "end_to_end_s": times,
        "end_to_end_ratio_sdk_over_none": statistics.median(paired),
        "end_to_end_paired_ratios": paired,
        "end_to_end_ratio_of_medians": statistics.median(times["sdk"]) / statistics.median(times["none"]),
        "instrumentation_per_call_sdk_s": per_call["sdk"],
        "instrumentation_per_call_no_sdk_s": per_call["none"],
        "steps_per_call": len(steps),
        "decode_s_of_that_call": decode_s,
        "instrumentation_fraction_of_decode": per_call["sdk"] / decode_s,
    }


def telemetry_part(args) -> dict[str, Any]:
    from agentspec.cost import calibrate, cost_model, set_cost_model
    from examples import agent_demo

    args.threads, args.max_new_tokens = args.threads or 1, args.max_new_tokens or 64  # 1: as calibrated
    harness.set_threads(args.threads)
    pair = agentspec.load_pair(draft_model=False, dtype=args.dtype)  # no draft model: the demo's drafters
    provider, memory = agent_demo.tracing()
    t0 = time.perf_counter()
    calibrate(pair)  # explicit: tracing never calibrates (it would start from the device's prior)
    calibration_s = time.perf_counter() - t0
    ChatSpecDecode(pair=pair, max_tokens=4, prefix_cache=False, tracer_provider=provider).invoke("Warm up.")
    snapshot = dataclasses.replace(cost_model(pair))
    rounds = []
    for r in range(args.rounds):
        set_cost_model(pair, dataclasses.replace(snapshot))  # each round from the calibration alone
        rounds.append(one_round(pair, args, r, provider, memory))
    result = {
        "settings": harness.settings(args, leave=("out", "part")),
        "environment": harness.environment(pair),
        "calibration_s": calibration_s,
        "estimate": {"calibration": snapshot.as_dict(), "rounds": rounds},
        "overhead": overhead(pair, args.overhead_reps),
    }
    ok = [r for r in rounds if r["comparable"]]
    keys = ("estimated_saved_s", "measured_saved_decode_s", "measured_saved_wall_s")
    result["summary"] = {
        "comparable_rounds": len(ok),
        "rounds": len(rounds),
        **saved(*(sum(r[k] for r in ok) for k in keys)),
        **(self_estimate([c for r in ok for c in r["runs"]["base"]["calls"]]) if ok else {}),
        "tracing_overhead_ratio": result["overhead"]["end_to_end_ratio_sdk_over_none"],
        "instrumentation_fraction_of_decode": result["overhead"]["instrumentation_fraction_of_decode"],
    }
    print(f"\nsummary: {json.dumps(result['summary'], indent=1)}")
    return result


def plot_telemetry(result: dict[str, Any], out) -> None:
    rounds = [r for r in result["estimate"]["rounds"] if r["comparable"]]
    with harness.figure(out, 2, part="telemetry", size=(5.5, 4), dpi=120) as (calls, totals):
        for r, row in enumerate(rounds):
            got = [c["measured_baseline_decode_s"] for c in row["per_call"]]
            calls.scatter(got, [c["estimated_baseline_s"] for c in row["per_call"]], label=f"round {r + 1}")
        every = [c for r in rounds for c in r["per_call"]]
        top = max(max(c["estimated_baseline_s"], c["measured_baseline_decode_s"]) for c in every)
        calls.plot([0, top], [0, top], "k--", lw=1)
        calls.set(
            xlabel="measured baseline call (s, in the decoder)", title="plain decoding, no cache: per call"
        )
        calls.set_ylabel("estimated by the full run's span (s)")
        calls.legend()
        x = range(len(rounds))
        for dx, key in ((-0.2, "estimated_saved_s"), (0.2, "measured_saved_decode_s")):
            totals.bar([i + dx for i in x], [r[key] for r in rounds], 0.4, label=key.split("_")[0])
        totals.set_xticks(list(x), [f"round {i + 1}" for i in x])
        totals.set(ylabel="time saved by agentspec (s)", title="agent run: saved, estimated vs measured")
        totals.legend()


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("loop", __doc__, dtype=True)
    ap.add_argument("--part", choices=("loop", "telemetry"), default="loop")
    ap.add_argument("--max-new-tokens", type=int, help="per call (loop 48, telemetry 64)")
    ap.add_argument("--rounds", type=int, default=2, help="telemetry: rounds of the agent's tasks")
    ap.add_argument("--tasks", type=int, default=None, help="telemetry: the agent demo's first N tasks")
    ap.add_argument("--drafter", default="auto", help="telemetry: the full run's drafter")
    ap.add_argument("--overhead-reps", type=int, default=10, help="telemetry: decodes each way (ABBA)")
    args = ap.parse_args(argv)
    if args.part == "loop":
        harness.set_threads(args.threads)
        result = loop_part(args)
        harness.write(args.out, result, part="loop")
        plot_loop(result, args.out)
        return 0 if result["loop"]["full_equals_baseline"] else 1
    result = telemetry_part(args)
    harness.write(args.out, result, part="telemetry")
    if result["summary"]["comparable_rounds"]:
        plot_telemetry(result, args.out)
    return 0 if result["summary"]["comparable_rounds"] == len(result["estimate"]["rounds"]) else 1
