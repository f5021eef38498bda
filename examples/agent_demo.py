"""A LangChain agent on ChatSpecDecode: right answers, and how much faster than plain decoding.

Run it (a few minutes on 2 CPU cores; the embedded model is fetched on first use):

    .venv/bin/python examples/agent_demo.py [--tasks 6] [--threads 1] [--dtype auto|float32|bfloat16]
        [--model M] [--draft-model D | --no-draft-model] [--drafter auto] [--device cuda]
        [--check-answers | --no-check-answers] [--json results.json]
        [--otlp-endpoint http://127.0.0.1:6006]

A ``langchain.agents.create_agent`` agent answers a maintainer's questions about a software project,
Harbor, on the embedded SmolLM2-135M-Instruct, or on the pair ``--model`` and ``--draft-model`` name
(a hub id, a folder or a .gguf file each, as ``agentspec.load_pair`` takes them). It has two real tools
(they read a release log and an issue tracker held in this file, as JSON records) and answers with a
structured reply (a pydantic model): each question is one conversation (a LangGraph thread with a
checkpointer) of two model calls, a tool call and the answer. The same agent then runs again on
``ChatSpecDecode(speculative=False, prefix_cache=False)`` (the same model and decoding loop, no drafts,
no reuse) and the script prints:

- each answer, checked against the record its tool returned (a wrong answer is printed as WRONG; on
  the embedded pair the script then exits with status 1, on a ``--model`` of the user's only with
  ``--check-answers``: whether a model answers right is that model's quality, whereas identical
  replies are agentspec's promise for any model);
- the end-to-end speed-up, and whether every reply of the two runs was identical (greedy decoding is
  lossless: it must be);
- a table built from the OpenTelemetry spans of every model call (kept in memory): latency, the time
  agentspec estimates it saved against plain decoding without cache, accepted/drafted tokens and prompt
  tokens read from the prefix cache.

``--otlp-endpoint`` also exports the spans over OTLP/HTTP (to Arize Phoenix, say: see
``examples/phoenix_trace.py``), with the agent's own steps traced by OpenInference when
``openinference-instrumentation-langchain`` is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Annotated, Literal

import torch
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel, Field

from agentspec.bench.own_pair import PairError, add_pair_arguments, load
from agentspec.bench.run import environment
from agentspec.cost import calibrate
from agentspec.drafters.registry import DEFAULT
from agentspec.telemetry import attributes as A
from langchain_agentspec import ChatSpecDecode, get_speculation_callback

SYSTEM = """You are the release assistant of the Harbor project, a job scheduler written in Python.
You answer questions from maintainers about releases and issues. Rules:
- Look up the release or the issue asked about with a tool before answering.
- Answer from the tool's result only: copy versions, dates, numbers and names exactly as it gives them.
- If the tool does not know the release or issue, say so; never invent one."""

RELEASES = [
    {
        "version": "v2.4.0",
        "date": "2025-03-02",
        "changes": "added cron expressions with seconds and retry policies per job; fixed a crash when a "
        "job returned None",
    },
    {
        "version": "v2.3.1",
        "date": "2025-01-20",
        "changes": "fixed the scheduler skipping jobs after a daylight-saving change",
    },
    {
        "version": "v2.3.0",
        "date": "2024-12-05",
        "changes": "added job priorities and a Prometheus exporter; dropped Python 3.8",
    },
]
ISSUES = [
    {
        "number": 412,
        "kind": "bug",
        "priority": "high",
        "assignee": "Dana",
        "title": "high-priority jobs starve low-priority jobs under load",
    },
    {
        "number": 407,
        "kind": "bug",
        "priority": "normal",
        "assignee": "Omar",
        "title": "the Prometheus exporter reports queue depth as a float",
    },
    {
        "number": 398,
        "kind": "feature",
        "priority": "low",
        "assignee": "Lena",
        "title": "pause and resume a single worker from the dashboard",
    },
]

# The tool's argument schema is also a grammar: a version can only be written as one
VersionNumber = Annotated[str, Field(pattern=r"^v?[0-9]+[.][0-9]+[.][0-9]+$")]


@tool
def read_release_notes(version: VersionNumber) -> str:
    """Read the notes of one Harbor release (its date and changes), by version number."""
    wanted = "v" + version.removeprefix("v")
    found = [r for r in RELEASES if r["version"] == wanted]
    if not found:
        return f"no release {version}; the releases are " + ", ".join(r["version"] for r in RELEASES)
    return json.dumps(found[0])


@tool
def read_issue(number: int) -> str:
    """Read one issue of the Harbor tracker (its priority and assignee), by issue number."""
    found = [i for i in ISSUES if i["number"] == number]
    return json.dumps(found[0]) if found else f"no issue #{number}"


class ReleaseAnswer(BaseModel):
    """When a release came out."""

    version: str = Field(pattern=r"^v[0-9]+[.][0-9]+[.][0-9]+$")
    date: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


class IssueAnswer(BaseModel):
    """Who handles an issue, and how urgent it is."""

    number: int
    priority: Literal["low", "normal", "high"]
    assignee: str = Field(max_length=20)


ANSWER_FORMAT = {"read_release_notes": ReleaseAnswer, "read_issue": IssueAnswer}

# each question and what it is about: the record its answer must come from
TASKS = [
    ("When was release v2.3.1 published?", "v2.3.1"),
    ("Who is assigned to issue #407?", 407),
    ("What is the priority of issue #412?", 412),
    ("When did release v2.3.0 come out?", "v2.3.0"),
    ("Who works on issue #398?", 398),
    ("When was release v2.4.0 published?", "v2.4.0"),
]


def tools_called(messages: list) -> list[str]:
    """The names of the tools the agent called so far in this conversation."""
    return [c["name"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]


class LookUpThenAnswer(AgentMiddleware):
    """Each question gets one tool call, then a structured answer in the format of that tool's facts.

    Why steer: a 135M model does not reliably decide by itself whether to call a tool or to stop, so
    each model call is told which kind of reply it makes, through LangChain's ``wrap_model_call`` and
    ``ModelRequest.override``. Which tool, its arguments and every field of the answer are the
    model's own, constrained by the tool's and the answer's JSON schemas.
    """

    def wrap_model_call(self, request, handler):
        called = tools_called(request.messages)
        if not called:  # look it up: exactly one tool call, no answer format yet
            settings = {**request.model_settings, "parallel_tool_calls": False}
            return handler(
                request.override(tool_choice="required", response_format=None, model_settings=settings)
            )
        # answer: create_agent binds the format as the model's response_format (its provider strategy,
        # ChatSpecDecode's JSON being constrained by a grammar); that binding ignores the request's
        # tool_choice, so "no more tool calls" goes in through model_settings
        settings = {**request.model_settings, "tool_choice": "none"}
        return handler(request.override(response_format=ANSWER_FORMAT[called[-1]], model_settings=settings))


class Meter(AgentMiddleware):
    """Records what each model call cost, from the reply's usage and speculative metadata."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label
        self.calls: list[dict] = []

    def wrap_model_call(self, request, handler):
        start = time.perf_counter()
        response = handler(request)
        seconds = time.perf_counter() - start
        message = next(m for m in response.result if isinstance(m, AIMessage))
        usage, spec = message.usage_metadata, message.response_metadata["speculative"]
        row = {
            "seconds": round(seconds, 3),
            "prompt": usage["input_tokens"],
            "cached": usage["input_token_details"].get("cache_read", 0),
            "output": usage["output_tokens"],
            "accepted": spec["accepted_tokens"],
            "what": ", ".join(c["name"] for c in message.tool_calls) or "answer",
        }
        self.calls.append(row)
        print(
            f"  [{self.label}] call {len(self.calls):2d} {row['what']:<18} {seconds:6.2f} s  "
            f"prompt {row['prompt']:4d} (cache {row['cached']:4d})  out {row['output']:3d} "
            f"(accepted drafts {row['accepted']:3d})",
            flush=True,
        )
        return response


def run(
    llm: ChatSpecDecode, label: str, tasks: list, keep_going: bool = False
) -> tuple[float, list[dict], Meter]:
    """Every question as a conversation of its own (a thread: its spans carry the thread id); with
    ``keep_going``, one the agent cannot finish ends where it stopped (``converse``)."""
    meter = Meter(label)
    agent = create_agent(
        llm,
        tools=[read_release_notes, read_issue],
        system_prompt=SYSTEM,
        middleware=[LookUpThenAnswer(), meter],
        checkpointer=InMemorySaver(),
    )
    states = []
    start = time.perf_counter()
    for i, (question, _) in enumerate(tasks):
        config = {"configurable": {"thread_id": f"{label}-{i + 1}"}}
        states.append(converse(agent, question, config, keep_going))
    return time.perf_counter() - start, states, meter


def converse(agent, question: str, config: dict, keep_going: bool) -> dict:
    """The conversation of one question: the agent's final state, or with ``keep_going`` where an
    error stopped it, that error in its ``error`` (another model than the embedded one may write a
    reply the agent cannot use, a JSON answer cut at the token cap, say; the A/B goes on)."""
    try:
        return agent.invoke({"messages": [HumanMessage(question)]}, config)
    except Exception as exc:
        if not keep_going:
            raise
        stopped = {"messages": [], **agent.get_state(config).values}
        return {**stopped, "error": f"{type(exc).__name__}: {exc}"}


def check(subject: str | int, state: dict) -> tuple[bool, str]:
    """Whether the agent's answer states what its tool returned about ``subject``, and a line saying so."""
    if "error" in state:
        return False, f"WRONG: the conversation stopped on {state['error']}"
    key = "version" if isinstance(subject, str) else "number"
    results = [m.content for m in state["messages"] if isinstance(m, ToolMessage)]
    records = [json.loads(r) for r in results if r.startswith("{")]
    record = next((r for r in records if r.get(key) == subject), None)
    if record is None:
        return False, f"WRONG: no tool result about {subject} (the tools returned {results})"
    answer = state.get("structured_response")
    if answer is None:
        return False, "WRONG: no structured answer"
    wrong = [
        f"{k}={v!r}, the tool said {record.get(k)!r}"
        for k, v in answer.model_dump().items()
        if v != record.get(k)
    ]
    if wrong:
        return False, "WRONG: " + "; ".join(wrong)
    return True, "right (every field as the tool returned it)"


def describe(answer: BaseModel | None) -> str:
    if isinstance(answer, ReleaseAnswer):
        return f"{answer.version} was released on {answer.date}."
    if isinstance(answer, IssueAnswer):
        return f"#{answer.number} is assigned to {answer.assignee}, priority {answer.priority}."
    return "(no answer)"


def replies(state: dict) -> list:
    """The model's replies in a conversation (tool call ids are random: left out)."""
    return [
        (m.content, [(c["name"], c["args"]) for c in m.tool_calls])
        for m in state["messages"]
        if isinstance(m, AIMessage)
    ]


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
        f"{'call':>4}  {'what':<18} {'latency':>8} {'saved':>8}  {'accepted/drafted':>16}  "
        f"{'cache read/prompt':>17}  {'out':>4}"
    ]
    for i, span in enumerate(spans):
        a = span.attributes
        latency = (span.end_time - span.start_time) / 1e9
        what = whats[i] if whats is not None and len(whats) == len(spans) else ""
        drafts = f"{a.get(A.ACCEPTED_TOKENS, 0)}/{a.get(A.DRAFT_TOKENS, 0)}"
        cache = f"{a.get(A.USAGE_CACHE_READ_INPUT_TOKENS, 0)}/{a.get(A.USAGE_INPUT_TOKENS, 0)}"
        lines.append(
            f"{i + 1:4d}  {what:<18} {latency:7.2f}s {a.get(A.LATENCY_SAVED, 0.0):+7.2f}s  {drafts:>16}  "
            f"{cache:>17}  {a.get(A.USAGE_OUTPUT_TOKENS, 0):4d}"
        )
    total = sum((s.end_time - s.start_time) / 1e9 for s in spans)
    saved = sum(s.attributes.get(A.LATENCY_SAVED, 0.0) for s in spans)
    lines.append(f"{'all':>4}  {'':<18} {total:7.2f}s {saved:+7.2f}s")
    return "\n".join(lines)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=len(TASKS), choices=range(1, len(TASKS) + 1))
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on each reply's tokens")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: batch-1 decoding of a 135M model gains little from more, "
        "and on a busy machine two threads spin against each other and time both runs badly)",
    )
    add_pair_arguments(
        parser, drafter_default=DEFAULT, drafter_help=f"the agentspec run's (default {DEFAULT})"
    )
    parser.add_argument(
        "--check-answers",
        action=argparse.BooleanOptionalAction,
        help="a wrong answer makes the exit status 1 (default: on the embedded pair, not with --model: "
        "wrong answers are still printed and counted)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures printed here to PATH")
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="also export the spans over OTLP/HTTP to URL/v1/traces (e.g. a Phoenix at http://127.0.0.1:6006)",
    )
    return parser.parse_args(argv)


def a_b(pair, args: argparse.Namespace, tasks: list) -> dict[str, dict]:
    """The agent on agentspec (speculative, prefix cache), then on plain decoding, both on ``pair``:
    per run its seconds, conversations, meter and ``chat`` spans."""
    provider, memory = tracing(args.otlp_endpoint)
    calibrate(pair)  # fit the latency-saved estimate up front (tracing alone starts from a prior)
    # first-call costs
    ChatSpecDecode(pair=pair, max_tokens=4, prefix_cache=False, tracer_provider=provider).invoke("Warm up.")
    memory.clear()
    # span_usage: the table below reads each call's tokens from its own span, also where
    # OpenInference's LLM span reports them (a backend summing both would count them twice)
    traced = {"pair": pair, "max_tokens": args.max_tokens, "tracer_provider": provider, "span_usage": True}
    plain = {"speculative": False, "prefix_cache": False}
    shown = "" if args.drafter == DEFAULT else f"drafter={args.drafter!r}"
    runs = {}
    for label, options, title in (
        ("agentspec", {"drafter": args.drafter}, f"ChatSpecDecode({shown}) (speculative, prefix cache)"),
        ("plain", plain, "ChatSpecDecode(speculative=False, prefix_cache=False)"),
    ):
        print(f"\n{title}:")
        with get_speculation_callback() as totals:  # the run's sums, as an application reads them
            seconds, states, meter = run(ChatSpecDecode(**traced, **options), label, tasks, keep_going=True)
        runs[label] = {"seconds": seconds, "states": states, "meter": meter, "spans": call_spans(memory),
                       "totals": totals.totals}  # fmt: skip
        memory.clear()
    provider.shutdown()  # flushes the OTLP export, if any
    return runs


def report(runs: dict[str, dict], tasks: list) -> dict:
    """Print each answer and its check, the speed-up, the replies' identity and the span table; the
    figures printed."""
    fast, plain = runs["agentspec"], runs["plain"]
    checks = [check(subject, state) for (_, subject), state in zip(tasks, fast["states"])]
    for (question, _), state, (_, verdict) in zip(tasks, fast["states"], checks):
        print(f"\nQ: {question}\nA: {describe(state.get('structured_response'))}  [{verdict}]")
    right = sum(ok for ok, _ in checks)
    same = [replies(s) for s in fast["states"]] == [replies(s) for s in plain["states"]]
    t_fast, t_base = fast["seconds"], plain["seconds"]
    print(
        f"\n{right}/{len(tasks)} answers right; end to end: {t_base:.1f} s plain -> {t_fast:.1f} s with "
        f"agentspec = {t_base / t_fast:.2f}x speed-up; the two runs replied the same: {same}"
    )
    calls = fast["meter"].calls
    total = lambda key: sum(c[key] for c in calls)  # noqa: E731
    print(
        f"prompt tokens {total('prompt')}, read from the cache {total('cached')}; "
        f"output tokens {total('output')}, of which accepted drafts {total('accepted')}"
    )
    t = fast["totals"]  # langchain_agentspec.get_speculation_callback over the agentspec run
    print(
        f"the agentspec run's totals: {t.calls} calls, latency saved {t.latency_saved_s or 0:+.2f} s "
        f"(estimated), accepted/drafted {t.accepted_tokens}/{t.draft_tokens}, "
        f"cache reads {t.cache_read_tokens}"
    )
    print("\nper call, from the OpenTelemetry spans of the agentspec run (saved: estimated against plain")
    print("decoding without cache; see agentspec/cost.py):")
    print(call_table(fast["spans"], [c["what"] for c in calls]))
    saved = sum(s.attributes.get(A.LATENCY_SAVED, 0.0) for s in fast["spans"])
    own = sum(s.attributes.get(A.LATENCY_SAVED, 0.0) for s in plain["spans"])
    print(
        f"total saved, estimated call by call: {saved:.1f} s; measured (plain run - agentspec run): "
        f"{t_base - t_fast:.1f} s. The plain run's estimate of its own saving: {own:+.1f} s (ideally 0)"
    )
    return {
        "questions": [q for q, _ in tasks],
        "answers": [describe(s.get("structured_response")) for s in fast["states"]],
        "right": right,
        "same_replies": same,
        "agentspec_s": round(t_fast, 3),
        "plain_s": round(t_base, 3),
        "speedup": round(t_base / t_fast, 3),
        "saved_estimated_s": round(saved, 3),
        "run_totals": dataclasses.asdict(t),  # get_speculation_callback's sums over the agentspec run
        "calls": calls,
    }


def main(argv: list[str] | None = None) -> int:
    """The demo; 0 when both runs replied the same and every answer is right (where answers are
    checked: ``--check-answers``), 1 when not, 2 when the options name a pair that does not load."""
    args = arguments(argv)
    torch.set_num_threads(args.threads)
    tasks = TASKS[: args.tasks]
    t_load = time.perf_counter()
    try:
        pair = load(args)  # both agents share these weights
    except PairError as exc:
        print(f"agent_demo: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t_load
    print(
        f"loaded {pair.name} in {load_s:.1f} s ({pair.dtype}, {pair.device}); draft model "
        f"{pair.draft_name or 'none'}, drafter {args.drafter}"
    )
    print(f"{len(tasks)} question(s), replies capped at {args.max_tokens}")
    figures = report(a_b(pair, args, tasks), tasks)
    # the embedded pair answers these questions right; another model's answers are its own quality
    checked = args.check_answers if args.check_answers is not None else args.model is None
    if args.json:
        run_of = {
            "model": pair.name,
            "draft_model": pair.draft_name,
            "drafter": args.drafter,
            "device": str(pair.device),
            "dtype": str(pair.dtype),
            "load_s": round(load_s, 3),  # load_pair's wall seconds
            "threads": args.threads,
            "answers_checked": checked,
        }
        # the CPU, threads, versions and commit it ran on
        figures = {**run_of, **figures, "environment": environment(pair)}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    right = figures["right"] == len(tasks)
    return 0 if figures["same_replies"] and (right or not checked) else 1


if __name__ == "__main__":
    sys.exit(main())
