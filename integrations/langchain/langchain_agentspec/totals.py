"""Speculation totals over an agent run: latency saved, draft tokens drafted and accepted, cache reads.

Each ``ChatSpecDecode`` reply reports its own call (``response_metadata``: ``speculative``, and
``latency`` locally or ``agentspec`` from an agentspec server; ``usage_metadata``'s
``input_token_details.cache_read``); a run of many calls has no total of its own. This module adds
them up, in the manner of langchain-core's ``get_usage_metadata_callback``::

    with get_speculation_callback() as cb:
        agent.invoke({"messages": [...]})
    cb.totals.latency_saved_s, cb.totals.accepted_tokens

``SpeculationCallbackHandler`` is the callback handler (pass it in ``config["callbacks"]`` to count
one run); ``get_speculation_callback`` registers one for every LangChain run its block starts. Where a
LangChain tracer (OpenInference, OpenLLMetry, LangSmith's OpenTelemetry export: ``_run``) opened a
span for the run's root, each counted reply also writes the run's totals so far on that span, as
``agentspec.run.*`` (``RUN_ATTRIBUTES``), so the last call leaves the whole run's there. With no
tracer, the caller may put them on a span of its own: ``span.set_attributes(cb.totals.attributes())``.

The attribute names are the engine's (``agentspec.telemetry.attributes``), written out here because
that module imports the engine and a remote ``ChatSpecDecode`` runs without it; a unit test checks
each against the engine's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, LLMResult

from langchain_agentspec._run import SeesTracers, run_span, trace_root

# -- names: agentspec.telemetry.attributes' -----------------------------------------------------------
RUN_CALLS = "agentspec.run.calls"
RUN_DRAFT_TOKENS = "agentspec.run.draft_tokens"
RUN_ACCEPTED_TOKENS = "agentspec.run.accepted_tokens"
RUN_CACHE_READ_TOKENS = "agentspec.run.cache_read_tokens"
RUN_LATENCY_SAVED = "agentspec.run.latency_saved_s"
RUN_BASELINE_ESTIMATE = "agentspec.run.baseline_estimate_s"
RUN_DECODE_TIME = "agentspec.run.decode_s"

# SpeculationTotals field -> its attribute on the run's root span
RUN_ATTRIBUTES = {
    "calls": RUN_CALLS,
    "draft_tokens": RUN_DRAFT_TOKENS,
    "accepted_tokens": RUN_ACCEPTED_TOKENS,
    "cache_read_tokens": RUN_CACHE_READ_TOKENS,
    "latency_saved_s": RUN_LATENCY_SAVED,
    "baseline_s": RUN_BASELINE_ESTIMATE,
    "decode_s": RUN_DECODE_TIME,
}


@dataclasses.dataclass
class SpeculationTotals:
    """The sums over a run's replies that reported speculation or latency (``calls`` of them).

    The three times are None until a reply carries them (a vLLM server reports no latency estimate);
    ``latency_saved_s`` is ``baseline_s - decode_s`` over the calls that have an estimate.
    """

    calls: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cache_read_tokens: int = 0
    latency_saved_s: float | None = None
    baseline_s: float | None = None
    decode_s: float | None = None

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over the run (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def add(self, message: AIMessage) -> bool:
        """Add one reply's figures; False (nothing added) for a reply that reports none."""
        metadata = message.response_metadata or {}
        speculative = metadata.get("speculative") or {}
        latency = metadata.get("latency") or metadata.get("agentspec") or {}
        if not speculative and not latency:
            return False
        self.calls += 1
        self.draft_tokens += speculative.get("draft_tokens") or 0
        self.accepted_tokens += speculative.get("accepted_tokens") or 0
        details = (message.usage_metadata or {}).get("input_token_details") or {}
        self.cache_read_tokens += details.get("cache_read") or 0
        for key in ("latency_saved_s", "baseline_s", "decode_s"):
            if latency.get(key) is not None:
                setattr(self, key, (getattr(self, key) or 0.0) + latency[key])
        return True

    def attributes(self) -> dict[str, Any]:
        """The totals as span attributes, ``agentspec.run.*`` (the times only once known)."""
        values = dataclasses.asdict(self)
        return {name: values[key] for key, name in RUN_ATTRIBUTES.items() if values[key] is not None}


def _reply(response: LLMResult) -> AIMessage | None:
    generation = response.generations[0][0] if response.generations and response.generations[0] else None
    if isinstance(generation, ChatGeneration) and isinstance(generation.message, AIMessage):
        return generation.message
    return None


class SpeculationCallbackHandler(BaseCallbackHandler, SeesTracers):
    """Adds up the speculation figures of the replies of the runs it sees (``totals``, across them all),
    and keeps each root run's own totals on the span a tracer opened for that root.

    It follows the runs' parents (each start event names one) to find a reply's root run, and writes
    that run's totals so far on the root's span at each reply it counts: the root span is open until
    the run ends, after its last reply. Thread-safe: a run's calls may end on several threads.
    """

    run_inline = True  # quick bookkeeping: no executor hop under an async run

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._totals = SpeculationTotals()
        self._parents: dict[UUID, UUID | None] = {}  # each open run -> its parent run
        self._runs: dict[UUID, SpeculationTotals] = {}  # each open root run with a counted reply
        self._tracers: list[Any] = []  # the tracers model calls found among their handlers

    def __repr__(self) -> str:
        return repr(self.totals)

    @property
    def totals(self) -> SpeculationTotals:
        """The sums so far (a copy)."""
        with self._lock:
            return dataclasses.replace(self._totals)

    def see_tracers(self, found: list[Any]) -> None:
        with self._lock:  # the last call's (LangChain hands each run copies of the same tracers)
            self._tracers = list(found)

    def _root(self, run_id: UUID) -> UUID:
        """The topmost run this handler saw start above ``run_id`` (a handler given to an inner
        runnable takes that runnable's run as the root); across a parent it never saw start (a
        langsmith ``traceable`` run), the trace's root as a tracer recorded it."""
        while (parent := self._parents.get(run_id)) is not None and parent in self._parents:
            run_id = parent
        root = trace_root(self._tracers, run_id) if parent is not None else None
        return self._root(root) if root != run_id and root in self._parents else run_id

    def _started(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            self._parents[run_id] = parent_run_id

    def _ended(self, run_id: UUID) -> None:
        with self._lock:
            parent = self._parents.pop(run_id, None)
            if parent is None or parent not in self._parents:  # a root: its totals are on its span
                self._runs.pop(run_id, None)

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        """Count the reply (if it reports speculation or latency); update its root run's span."""
        message, update = _reply(response), None
        with self._lock:
            root = self._root(run_id)
            run = self._runs.get(root, SpeculationTotals())
            if message is not None and run.add(message):
                self._runs[root] = run
                self._totals.add(message)
                update = (root, run.attributes(), list(self._tracers))
        self._ended(run_id)
        if update is not None and (span := run_span(update[2], update[0])) is not None:
            span.set_attributes(update[1])

    def on_chain_start(self, *args: Any, run_id: UUID, parent_run_id: UUID | None = None, **kw: Any) -> None:
        self._started(run_id, parent_run_id)

    def on_chat_model_start(
        self, *args: Any, run_id: UUID, parent_run_id: UUID | None = None, **kw: Any
    ) -> None:
        self._started(run_id, parent_run_id)

    def on_llm_start(self, *args: Any, run_id: UUID, parent_run_id: UUID | None = None, **kw: Any) -> None:
        self._started(run_id, parent_run_id)

    def on_tool_start(self, *args: Any, run_id: UUID, parent_run_id: UUID | None = None, **kw: Any) -> None:
        self._started(run_id, parent_run_id)

    def on_retriever_start(
        self, *args: Any, run_id: UUID, parent_run_id: UUID | None = None, **kw: Any
    ) -> None:
        self._started(run_id, parent_run_id)

    def on_chain_end(self, *args: Any, run_id: UUID, **kw: Any) -> None:
        self._ended(run_id)

    def on_chain_error(self, *args: Any, run_id: UUID, **kw: Any) -> None:
        self._ended(run_id)

    def on_llm_error(self, *args: Any, run_id: UUID, **kw: Any) -> None:
        self._ended(run_id)

    def on_tool_end(self, *args: Any, run_id: UUID, **kw: Any) -> None:
        self._ended(run_id)

    def on_tool_error(self, *args: Any, run_id: UUID, **kw: Any) -> None:
        self._ended(run_id)

    def on_retriever_end(self, *args: Any, run_id: UUID, **kw: Any) -> None:
        self._ended(run_id)

    def on_retriever_error(self, *args: Any, run_id: UUID, **kw: Any) -> None:
        self._ended(run_id)


# One context variable per nesting depth, each registered once with LangChain's configure hooks
# (registering one per block, as get_usage_metadata_callback does, grows LangChain's hook list with
# every block a process ever opens); a nested block's handler and its outer ones all count its runs.
_DEPTH: ContextVar[int] = ContextVar("agentspec_speculation_depth", default=0)
_HANDLERS: list[ContextVar[SpeculationCallbackHandler | None]] = []
_HANDLERS_LOCK = threading.Lock()


def _handler_var(depth: int) -> ContextVar[SpeculationCallbackHandler | None]:
    from langchain_core.tracers.context import register_configure_hook  # on first use: not cheap

    with _HANDLERS_LOCK:
        while len(_HANDLERS) <= depth:
            var: ContextVar[SpeculationCallbackHandler | None] = ContextVar(
                f"agentspec_speculation_callback_{len(_HANDLERS)}", default=None
            )
            register_configure_hook(var, inheritable=True)
            _HANDLERS.append(var)
        return _HANDLERS[depth]


@contextmanager
def get_speculation_callback() -> Iterator[SpeculationCallbackHandler]:
    """A ``SpeculationCallbackHandler`` added to every LangChain run started in the block (and
    their children): its ``totals`` are the block's calls' sums.

    Example::

        with get_speculation_callback() as cb:
            agent.invoke({"messages": [HumanMessage("What time is it?")]})
        print(cb.totals.latency_saved_s, cb.totals.accepted_tokens, cb.totals.draft_tokens)
    """
    depth = _DEPTH.get()
    var = _handler_var(depth)
    handler = SpeculationCallbackHandler()
    tokens = (var.set(handler), _DEPTH.set(depth + 1))
    try:
        yield handler
    finally:  # also when the block raises: later runs are not this block's
        _DEPTH.reset(tokens[1])
        var.reset(tokens[0])
