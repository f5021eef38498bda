"""A LangChain agent on ChatSpecDecode: speculative decoding + prefix reuse against the plain baseline.

Run it (a few minutes on 2 CPU cores; the embedded model is fetched on first use):

    .venv/bin/python examples/agent_demo.py [--max-tokens 64] [--tasks 2] [--threads 1]
        [--otlp-endpoint http://127.0.0.1:6006]

A ``langchain.agents.create_agent`` agent with two real Python tools (they read a release log and an
issue tracker from this file) answers questions about a software project, on the embedded
SmolLM2-135M-Instruct. Every model call prints its latency, the tokens it generated, how many of
them were draft tokens the target accepted, and how many prompt tokens came from the prefix cache.
The same agent then runs again with ``speculative=False, prefix_cache=False`` (the same model and
the same decoding loop, no drafts, no reuse) and the script prints the end-to-end speed-up and
whether every answer was identical (greedy decoding is lossless: it must be).

Every model call is traced with OpenTelemetry (``agentspec.telemetry``): after the run, a table built
from the spans (kept in memory) shows each call's latency, the time agentspec estimates it saved
against plain decoding without cache, accepted/drafted tokens and prompt tokens read from the cache,
and the end-to-end total saved next to the measured difference between the two runs.
``--otlp-endpoint`` also exports the spans over OTLP/HTTP (to Arize Phoenix, say: see
``examples/phoenix_trace.py``), with the agent's own steps traced by OpenInference when
``openinference-instrumentation-langchain`` is installed.

Tool choice is scripted: the 135M model cannot yet pick tools and fill their arguments on its own
(the grammar-constrained decoding issue addresses that), so a middleware sets ``tool_choice`` per
model call (first the release log, then the issues, then "none" for the answer). Both tools take no
arguments, so the forced call is complete and everything else is the model's own output. Expect
poor answers from a 135M model (it tends to echo the tool output's markup and loop); what this
shows is the cost of each call, and that the fast path does not change a single token.
"""

from __future__ import annotations

import argparse
import time

import torch
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agentspec
from agentspec.telemetry import attributes as A
from agentspec.telemetry import calibrate
from langchain_agentspec import ChatSpecDecode

SYSTEM = """You are the release assistant of the Harbor project, a job scheduler written in Python.
You answer questions from maintainers about releases and open issues. Rules:
- Use the tools to read the release log and the issue tracker before answering.
- Quote version numbers, issue numbers and titles exactly as the tools return them.
- Keep answers short: a few sentences or a short list. Do not invent issues or releases.
- If the tools do not contain the answer, say that you do not know."""

RELEASE_LOG = """Harbor release log
- v2.4.0 (2025-03-02): added cron expressions with seconds; retry policies per job; the web
  dashboard shows queue depth per worker. Fixed a crash when a job returned None.
- v2.3.1 (2025-01-20): fixed the scheduler skipping jobs after a daylight-saving change; fixed
  duplicate notifications when a worker restarted.
- v2.3.0 (2024-12-05): added job priorities (low, normal, high); added a Prometheus exporter;
  dropped support for Python 3.8."""

ISSUES = """Harbor open issues
- #412 (bug, high): jobs with priority high starve low-priority jobs under load.
- #407 (bug, normal): the Prometheus exporter reports queue depth as a float.
- #398 (feature, normal): pause and resume a single worker from the dashboard.
- #391 (bug, low): the cron parser accepts 61 as a seconds value."""


@tool
def read_release_log() -> str:
    """Read the Harbor release log: versions, dates, features and fixes."""
    return RELEASE_LOG


@tool
def read_open_issues() -> str:
    """Read the open issues of Harbor: number, kind, priority and title."""
    return ISSUES


TASKS = [
    "What changed in the latest release, and which open bugs have high priority?",
    "Which release added job priorities, and what open issue is about priorities?",
]
PLAN = ["read_release_log", "read_open_issues", "none"]  # tool_choice for model calls 1, 2, 3


class ScriptAndMeter(AgentMiddleware):
    """Sets each model call's tool_choice from PLAN and records what the call cost."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label
        self.calls: list[dict] = []
        self.n = 0  # model calls in the current task

    def wrap_model_call(self, request, handler):
        choice = PLAN[min(self.n, len(PLAN) - 1)]
        self.n += 1
        start = time.perf_counter()
        response = handler(request.override(tool_choice=choice))
        seconds = time.perf_counter() - start
        message = next(m for m in response.result if isinstance(m, AIMessage))
        usage, spec = message.usage_metadata, message.response_metadata["speculative"]
        row = {
            "seconds": seconds,
            "prompt": usage["input_tokens"],
            "cached": usage["input_token_details"].get("cache_read", 0),
            "output": usage["output_tokens"],
            "accepted": spec["accepted_tokens"],
            "what": ", ".join(c["name"] for c in message.tool_calls) or "answer",
        }
        self.calls.append(row)
        print(
            f"  [{self.label}] call {len(self.calls):2d} {row['what']:<17} {seconds:6.2f} s  "
            f"prompt {row['prompt']:4d} (cache {row['cached']:4d})  out {row['output']:3d} "
            f"(accepted drafts {row['accepted']:3d})",
            flush=True,
        )
        return response


def run(llm: ChatSpecDecode, label: str, tasks: list[str]) -> tuple[float, list[str], ScriptAndMeter]:
    meter = ScriptAndMeter(label)
    tools = [read_release_log, read_open_issues]
    agent = create_agent(llm, tools=tools, system_prompt=SYSTEM, middleware=[meter])
    answers = []
    start = time.perf_counter()
    for task in tasks:
        meter.n = 0
        out = agent.invoke({"messages": [HumanMessage(task)]})
        answers.append(out["messages"][-1].content)
    return time.perf_counter() - start, answers, meter


def tracing(otlp_endpoint: str | None = None) -> tuple[TracerProvider, InMemorySpanExporter]:
    """A TracerProvider keeping spans in memory and, given an endpoint, exporting them over OTLP/HTTP.

    With an endpoint, the LangChain agent's own runs are traced too (OpenInference), so a backend
    shows each ``chat`` span under the model call of the agent step that made it.
    """
    provider = TracerProvider(resource=Resource.create({"service.name": "agentspec-demo"}))
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = OTLPSpanExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(exporter))
        try:
            from openinference.instrumentation.langchain import LangChainInstrumentor
        except ImportError:
            print("(openinference-instrumentation-langchain is not installed: only model calls are traced)")
        else:
            LangChainInstrumentor().instrument(tracer_provider=provider)
    return provider, memory


def call_spans(memory: InMemorySpanExporter) -> list:
    """The finished ``chat`` spans in call order."""
    spans = [s for s in memory.get_finished_spans() if s.attributes.get(A.OPERATION_NAME) == "chat"]
    return sorted(spans, key=lambda s: s.start_time)


def call_table(spans: list, whats: list[str] | None = None) -> str:
    """Per-call latency, estimated latency saved, accepted/drafted tokens and cache reads, from spans."""
    lines = [
        f"{'call':>4}  {'what':<17} {'latency':>8} {'saved':>8}  {'accepted/drafted':>16}  "
        f"{'cache read/prompt':>17}  {'out':>4}"
    ]
    for i, span in enumerate(spans):
        a = span.attributes
        latency = (span.end_time - span.start_time) / 1e9
        what = whats[i] if whats is not None and len(whats) == len(spans) else ""
        drafts = f"{a.get(A.ACCEPTED_TOKENS, 0)}/{a.get(A.DRAFT_TOKENS, 0)}"
        cache = f"{a.get(A.USAGE_CACHE_READ_INPUT_TOKENS, 0)}/{a.get(A.USAGE_INPUT_TOKENS, 0)}"
        lines.append(
            f"{i + 1:4d}  {what:<17} {latency:7.2f}s {a.get(A.LATENCY_SAVED, 0.0):+7.2f}s  {drafts:>16}  "
            f"{cache:>17}  {a.get(A.USAGE_OUTPUT_TOKENS, 0):4d}"
        )
    total = sum((s.end_time - s.start_time) / 1e9 for s in spans)
    saved = sum(s.attributes.get(A.LATENCY_SAVED, 0.0) for s in spans)
    lines.append(f"{'all':>4}  {'':<17} {total:7.2f}s {saved:+7.2f}s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on each answer's tokens")
    parser.add_argument("--tasks", type=int, default=len(TASKS), choices=range(1, len(TASKS) + 1))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: batch-1 decoding of a 135M model gains little from more, "
        "and on a busy machine two threads spin against each other and time both runs badly)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="also export the spans over OTLP/HTTP to URL/v1/traces (e.g. a Phoenix at http://127.0.0.1:6006)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tasks = TASKS[: args.tasks]

    pair = agentspec.load_pair()  # both agents share these weights
    print(f"model: {pair.name} on {pair.device}, {len(tasks)} task(s), answers capped at {args.max_tokens}")
    provider, memory = tracing(args.otlp_endpoint)
    calibrate(pair)  # fit the latency-saved estimate up front (tracing alone starts from a prior)
    # first-call costs
    ChatSpecDecode(pair=pair, max_tokens=4, prefix_cache=False, tracer_provider=provider).invoke("Warm up.")
    memory.clear()

    traced = {"pair": pair, "max_tokens": args.max_tokens, "tracer_provider": provider}
    fast = ChatSpecDecode(**traced)  # prompt-lookup drafts + prefix cache
    base = ChatSpecDecode(**traced, speculative=False, prefix_cache=False)
    print("\nChatSpecDecode() (speculative, prefix cache):")
    t_fast, answers_fast, m_fast = run(fast, "spec", tasks)
    spans_fast = call_spans(memory)
    memory.clear()
    print("\nChatSpecDecode(speculative=False, prefix_cache=False):")
    t_base, answers_base, m_base = run(base, "base", tasks)
    spans_base = call_spans(memory)

    for task, answer in zip(tasks, answers_fast):
        print(f"\nQ: {task}\nA: {answer.strip()}")
    total = lambda m, key: sum(c[key] for c in m.calls)  # noqa: E731
    print(
        f"\nend to end: {t_base:.1f} s plain -> {t_fast:.1f} s with agentspec "
        f"= {t_base / t_fast:.2f}x speed-up; same answers: {answers_fast == answers_base}"
    )
    print(
        f"prompt tokens {total(m_fast, 'prompt')}, read from the cache {total(m_fast, 'cached')}; "
        f"output tokens {total(m_fast, 'output')}, of which accepted drafts {total(m_fast, 'accepted')}"
    )

    print("\nper call, from the OpenTelemetry spans of the agentspec run (saved: estimated against plain")
    print("decoding without cache; see agentspec/telemetry/latency.py):")
    print(call_table(spans_fast, [c["what"] for c in m_fast.calls]))
    saved = sum(s.attributes.get(A.LATENCY_SAVED, 0.0) for s in spans_fast)
    own = sum(s.attributes.get(A.LATENCY_SAVED, 0.0) for s in spans_base)
    print(
        f"total saved, estimated call by call: {saved:.1f} s; measured (plain run - agentspec run): "
        f"{t_base - t_fast:.1f} s. The plain run's estimate of its own saving: {own:+.1f} s (ideally 0)"
    )
    provider.shutdown()  # flushes the OTLP export, if any


if __name__ == "__main__":
    main()
