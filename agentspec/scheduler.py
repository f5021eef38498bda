"""A pair's passes, shared by every call on it: continuous batching of draft/verify passes.

Every call on a pair (``agentspec.decode.stream`` and all that consume it: ``generate``, the chat
model's invoke, stream, batch and async forms, the server) is a ``Request`` of the pair's one
``Scheduler``. Its thread, the engine's, owns the models: each pass asks every running request for
its share (its draft, and the tokens to feed: pending, forced, drafted; the requests' drafting steps
run together, ``agentspec.packed.DraftRound``), runs **one** target forward over the new rows of all
of them (``agentspec.packed``), and hands each request its logits to accept, roll back and turn into
its caller's Step. A caller never runs the models: it hands the engine its join (the prompt
checked, the prefix cache restored, the request added) and its leave (the verified state saved) as
tasks (``Scheduler.call``), which the engine runs between passes, and reads its Steps from its
request's outbox.

A long prompt joining while others decode is prefilled in chunks of ``prefill_chunk`` tokens, one
per pass, beside the others' rows (vLLM's chunked prefill), so it does not stall them; where
several prompts are being prefilled, those of the most urgent ``GenerationConfig.priority`` go first
(``urgent``). A request whose caller has not taken its last ``LOOKAHEAD`` Steps sits out passes until
it does.

Failures stay with their request: a share that cannot be planned or landed fails that call alone; a
packed forward that fails is retried per request (out of memory: in halves, after freeing memory),
so only the request whose rows fail gets the error. The state of every other request is whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from agentspec import request
from agentspec.cost import PairCost
from agentspec.kv import common_prefix_len, longest_holder
from agentspec.memory import forward_retrying, is_oom, release_cached_memory
from agentspec.packed import DraftRound, forward_packed, packable, read_verdicts
from agentspec.request import Request
from agentspec.steps import run_alone

log = logging.getLogger(__name__)

# prompt tokens a joining request feeds per pass while others decode, by device kind: on a CPU a long
# prompt fed in larger chunks stretches the decoding calls' time between tokens far past its median
# (docs/benchmarks.md, concurrency: join); a GPU's passes take far more rows for the time of one
# (vLLM's default budget there is thousands of tokens)
PREFILL_CHUNKS = {"cpu": 64}
PREFILL_CHUNK = 512  # any other device
# None: calls draft under load as they would alone. A bound of 2 one-row passes' worth of rows cut the
# drafts of concurrent agent sessions to about nothing and lost throughput (docs/benchmarks.md,
# "concurrency"): their suffix drafts are mostly accepted, which a bound by cost alone cannot see. Set
# ``Scheduler.load_factor`` to bound them.
LOAD_FACTOR: float | None = None
SCHEDULE_DRAFTS = True  # a shared pass verifies the drafts likely to survive (``_verify_lengths``)
SHARE_PROMPTS = True  # prompt rows a running call holds are copied, not computed (``_share_prompts``)


@dataclass
class SchedulerStats:
    """What the scheduler has done, for metrics (read without the pair's lock: a snapshot)."""

    running: int = 0  # requests decoding
    waiting: int = 0  # callers waiting to join (for the lock, or for a slot)
    passes: int = 0  # target forwards run
    rows: int = 0  # tokens fed over all those forwards
    members: int = 0  # requests' shares over all those forwards (requests per pass = members / passes)
    trimmed: int = 0  # draft tokens drafted but not verified: their rows did not pay in a shared pass
    shared: int = 0  # prompt rows copied from another running call's state, not computed
    draft_shared: int = 0  # the same, of draft models' states (``packed.DraftRound``)
    deferred: int = 0  # request shares that sat out a pass to copy, at the next, rows another computes
    # drafters' model steps (draft model or head) asked, and the passes that ran them: packed, a pass
    # runs one step of every call drafting at once (steps per pass = draft_steps / draft_passes)
    draft_steps: int = 0
    draft_passes: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (requests, rows) of recent passes


def _share(req: Request, chunk: int | None, cap: int | None) -> Any:
    """``req``'s share planned by itself (its drafter's steps run one by one), or its error."""
    try:
        return run_alone(request.plan(req, chunk, cap))
    except Exception as exc:
        return exc


def batch_lengths(
    survivals: Sequence[Sequence[float]], fixed_rows: int, pass_s: Callable[[int], float]
) -> list[int]:
    """Each request's draft length in one packed pass, for the most expected tokens per second.

    ``survivals[i]`` are request i's S_1 >= S_2 >= ... (its draft's prefix survivals); ``fixed_rows``
    the rows the pass feeds whatever the drafts (each request's pending token, prompt chunks, drafts
    not scheduled); ``pass_s(rows)`` what a pass of that many rows costs. Each request yields 1 + the
    survivals it keeps. Draft tokens are admitted most likely first (DSpark: a prefix's survival
    never rises along it, so every request keeps a prefix), and the count kept is the one with the
    best tokens per second over every count: a lone call keeps its drafts while rows are cheap, a
    full pass only what will likely survive.
    """
    ranked = sorted(
        ((s, i, j) for i, req in enumerate(survivals) for j, s in enumerate(req)),
        key=lambda t: (-t[0], t[2], t[1]),
    )
    tokens = float(len(survivals))
    best_n, best = 0, tokens / pass_s(fixed_rows)
    for n, (s, _, _) in enumerate(ranked, start=1):
        tokens += s
        rate = tokens / pass_s(fixed_rows + n)
        if rate > best:
            best_n, best = n, rate
    lengths = [0] * len(survivals)
    for _, i, _ in ranked[:best_n]:
        lengths[i] += 1
    return lengths


def urgent(reqs: list[Request]) -> list[Request]:
    """The requests that take part in a pass: every one, except that while two or more prompts are
    being prefilled in chunks, only those of the most urgent priority among them feed theirs; the
    others wait until they are through, so a prompt that matters more reaches its first token in
    fewer passes. Calls already decoding are never held back."""
    waiting = [m for m in reqs if m.prefilling]
    if len(reqs) < 2 or len(waiting) < 2:
        return reqs
    best = min(m.priority for m in waiting)
    return [m for m in reqs if not m.prefilling or m.priority == best]


class NotTaken(TimeoutError):
    """A caller's task waited longer than its timeout for the engine (``Scheduler.call``)."""


@dataclass
class _Task:
    """A caller's function for the engine's thread to run between passes (``Scheduler.call``)."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False  # the engine took it: it runs to its end, whatever the caller's timeout
    out: Any = None
    error: BaseException | None = None


class Scheduler:
    """The passes of one pair (``ModelPair.scheduler``); see the module docstring."""

    def __init__(
        self,
        lock: threading.RLock,
        cost: PairCost,
        prefill_chunk: int = PREFILL_CHUNK,
        batch_drafts: bool = True,
        load_factor: float | None = LOAD_FACTOR,
        schedule_drafts: bool = SCHEDULE_DRAFTS,
        share_prompts: bool = SHARE_PROMPTS,
    ):
        self.lock = lock  # the pair's: held by the engine's thread for each pass and each task
        self.cost = cost  # the pair's: what a pass of so many rows costs (``draft_cap``)
        self.prefill_chunk = prefill_chunk
        self.load_factor = load_factor  # None: requests draft as alone, whatever the load
        self.schedule_drafts = schedule_drafts  # each shared pass verifies what will likely survive
        self.share_prompts = share_prompts  # a prompt's rows held by another call are copied, not computed
        # requests draft in lockstep, a draft model's steps run together (``packed.DraftRound``); False
        # where drafters share one draft state (``ModelPair.draft_cache`` static or compiled)
        self.batch_drafts = batch_drafts
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._turns = threading.Condition()  # guards _tasks and _thread; wakes the pass loop
        self._tasks: deque[_Task] = deque()  # callers' joins and leaves, run before the next pass
        self._thread: threading.Thread | None = None
        self._between_passes = False  # the engine holds the lock outside a pass (it runs tasks next)
        self._observers: list[Callable[[], AbstractContextManager]] = []

    @contextmanager
    def observing(self, observer: Callable[[], AbstractContextManager]) -> Iterator[None]:
        """Within the block, each pass runs inside a fresh ``observer()`` in the pass thread: a way
        in for what watches the thread's tensor calls (``agentspec.bench.syncs.HostSyncs``), since
        a ``TorchFunctionMode`` entered in the caller's thread does not see the passes."""
        self._observers.append(observer)
        try:
            yield
        finally:
            self._observers.remove(observer)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """``fn()``, run in the engine's thread between passes, holding the pair's lock, while the
        caller waits: how a call joins (its prompt checked, its prefix restored, its request added)
        and leaves (its state saved). Its error is raised here; ``NotTaken`` where ``timeout``
        (seconds; None: no limit) ran out before the engine took it. Starts the engine's thread
        where none runs (a new one after one that died)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "agentspec: a call on a pair from its own engine thread (a drafter or a callback of "
                "a call calling the pair it runs on) would wait on itself; call it from another thread"
            )
        task = _Task(fn)
        with self._turns:
            self._tasks.append(task)
            self.stats.waiting += 1
            if self._thread is None:
                # not a daemon: at exit the interpreter waits for the passes under way (the thread ends
                # once no call runs), instead of tearing down torch beneath them
                self._thread = threading.Thread(target=self._loop, name="agentspec-passes")
                self._thread.start()
            self._turns.notify_all()
        if not task.done.wait(timeout):
            with self._turns:
                if not task.taken and not self._idle():
                    self._tasks.remove(task)
                    self.stats.waiting -= 1
                    raise NotTaken(f"the engine did not take the call within {timeout:g} s")
            task.done.wait()  # taken, or about to be: nothing else holds the engine
        if task.error is not None:
            raise task.error
        return task.out

    def _idle(self) -> bool:
        """No pass runs and nothing but the engine holds the pair's lock: a task waiting is taken next."""
        if self._between_passes:
            return True
        if not self.lock.acquire(blocking=False):
            return False
        self.lock.release()
        return True

    def add(self, req: Request) -> None:
        """Run ``req`` from the next pass on (in a task of the engine's thread: ``call``)."""
        self.running.append(req)
        self.stats.running = len(self.running)

    def remove(self, req: Request) -> None:
        """Stop running ``req`` (in the engine's thread); a request no longer running is left alone."""
        if req in self.running:
            self.running.remove(req)
            self.stats.running = len(self.running)

    def wake(self) -> None:
        """A caller took a Step (or left): a request that sat out may run again."""
        with self._turns:
            self._turns.notify_all()

    def _loop(self) -> None:
        """The engine's thread: tasks (joins, leaves), then a pass, until no call runs and no task
        waits. If it dies, every running call and every waiting task gets the error."""
        try:
            while self._step():
                pass
        except BaseException as exc:  # the callers get it: the thread ends here
            log.exception("the engine's thread died")
            self._die(exc)

    def _step(self) -> bool:
        """The tasks waiting, then one pass of the requests ready; False once nothing is left to run."""
        with self.lock, ExitStack() as observed:
            self._between_passes = True  # holding the lock: a task submitted now is taken next
            try:
                self._run_tasks()
                if not self.running:
                    with self._turns:
                        if not self._tasks:
                            self._thread = None
                            return False
                    return True
                reqs = urgent([m for m in self.running if m.ready()])
            finally:
                self._between_passes = False
            for observer in tuple(self._observers):
                observed.enter_context(observer())
            if reqs:
                self._guarded_pass(reqs)
        if not reqs:  # every caller is behind: wait for one to take a Step, or for a task
            with self._turns:
                if not self._tasks:
                    self._turns.wait(timeout=0.05)
        return True

    def _run_tasks(self) -> None:
        with self._turns:
            tasks, self._tasks = self._tasks, deque()
            for task in tasks:
                task.taken = True
            self.stats.waiting -= len(tasks)
        for task in tasks:
            try:
                task.out = task.fn()
            except Exception as exc:  # the caller's: raised in its thread
                task.error = exc
            finally:
                task.done.set()

    def _die(self, exc: BaseException) -> None:
        with self._turns:
            self._thread = None
            tasks, self._tasks = self._tasks, deque()
            self.stats.waiting -= len(tasks)
        for task in tasks:
            task.error = exc
            task.done.set()
        for m in list(self.running):
            self._fail(m, exc)

    def _guarded_pass(self, reqs: list[Request]) -> None:
        """A pass; a failure of the scheduler's own (not a request's) fails the requests of the pass,
        so that no caller waits on a pass that will never come."""
        try:
            self._pass(reqs)
        except Exception as exc:
            log.exception("a pass of %d calls failed", len(reqs))
            for m in reqs:
                if m in self.running:
                    self._fail(m, exc)

    def _pass(self, reqs: list[Request]) -> None:
        if self.share_prompts:
            reqs = self._share_prompts(reqs)
        chunk = self.prefill_chunk if len(reqs) > 1 else None
        shares = []
        for m, share in zip(reqs, self._shares(reqs, chunk)):
            if isinstance(share, BaseException):  # that call's own failure: the others run
                self._fail(m, share)
            else:
                shares.append((m, share))
        fed = [(m, s) for m, s in shares if s.feed is not None]
        if len(fed) > 1 and self.schedule_drafts:
            self._verify_lengths(fed)
        begun = time.perf_counter()
        outs = self._forward(fed) if fed else {}
        rows = sum(len(s.feed) for _, s in fed)
        if fed:
            self.stats.passes += 1
            self.stats.members += len(fed)
            self.stats.rows += rows
            self.stats.recent.append((len(fed), rows))
        judged = []
        for m, s in shares:
            out = outs.get(id(m))
            try:
                if isinstance(out, BaseException):
                    raise out
                judged.append((m, s, request.judge(m, s, out)))
            except Exception as exc:
                self._fail(m, exc)
        landing = self._read(judged)  # the host read: the pass is done on the device
        seconds, alone = time.perf_counter() - begun, None
        for m, s, read in landing:
            try:
                step, left = request.land(m, s, read)
            except Exception as exc:
                self._fail(m, exc)
                continue
            if len(fed) == 1 and step is not None and step.target_pass:  # a pass of its own
                alone = (step.cached, step.seconds)
            if left:
                self.remove(m)
        if fed and len(landing) == len(shares):  # no request failed before its landing: a whole pass
            self.cost.observe(rows, seconds, alone)

    def _read(self, judged: list) -> list:
        """(request, share, its verdict as read) with every request's verdict read in one host read (on
        a GPU, the one wait of the pass; log-probabilities, where asked for, in one more); a failed
        read fails its requests."""
        verdicts = [v for _, _, v in judged if v is not None]
        try:
            values = iter(read_verdicts(verdicts)) if verdicts else iter(())
        except Exception as exc:
            for m, _, _ in judged:
                self._fail(m, exc)
            return []
        return [(m, s, next(values) if v is not None else None) for m, s, v in judged]

    def draft_cap(self, reqs: list[Request]) -> int | None:
        """The most drafter tokens each request may add to a pass of ``reqs`` (None: no bound).

        Drafts are rows of the pass; while a pass is bound by reading the weights, rows are nearly
        free, and past ``rows_within(load_factor)`` (the cost model, by rows) each costs its share.
        Under that load every request keeps its pending token and drafts within an equal part of
        the budget (vLLM lowers its draft length with the batch size for the same reason); one
        request alone drafts as its schedule says.
        """
        if len(reqs) == 1 or self.load_factor is None:
            return None
        rows = self.cost.rows_within(self.load_factor, max(m.cached for m in reqs))
        return max(0, rows // len(reqs) - 1)

    def _verify_lengths(self, fed: list[tuple[Request, request.Share]]) -> None:
        """DSpark's one decision for the pass: the draft tokens of all its requests, likeliest to
        survive first, admitted while the pass's expected tokens per second still rise, priced by
        the pair's measured pass times by rows (``PairCost.pricer``). A request whose draft has no
        survival estimates (a sampled call's, a grammar's) is fed whole."""
        estimates = request.survivals([s for _, s in fed])  # a head's, read in one read for the pass
        flexible = [(m, s, est) for (m, s), est in zip(fed, estimates) if est]
        if not flexible:
            return
        fixed = sum(len(s.feed) for _, s in fed) - sum(len(est) for _, _, est in flexible)
        price = self.cost.pricer(max(m.cached for m, _ in fed))
        lengths = batch_lengths([est for _, _, est in flexible], fixed, price)
        for (m, s, est), n in zip(flexible, lengths):
            if n < len(est):
                self.stats.trimmed += len(est) - n
                request.trim(m, s, n)

    def _share_prompts(self, reqs: list[Request]) -> list[Request]:
        """A prompt's rows computed once in flight, as SGLang's in-batch prefix sharing: each request
        still prefilling first copies the rows of its prompt that a running call of its namespace
        holds (``_take_rows``); of requests whose next prompt rows are the same tokens, the first
        computes them and the others sit this pass out, to copy them at the next. A request sits out
        only where what it would copy is at least half the rows it would compute (a chunk, or the
        rest of its prompt), so a prompt that shares a few tokens does not lose a pass for them.
        Returns the requests that take part in the pass."""
        prefilling = [m for m in reqs if m.prefilling]
        if not prefilling:
            return reqs
        computing: list[tuple[Request, list[int]]] = []  # requests feeding prompt rows, and their wanted
        waiting: set[int] = set()
        for m in prefilling:
            wanted = m.wanted()
            self._take_rows(m, wanted)
            at = m.cached
            own = min(len(wanted) - at, self.prefill_chunk)  # rows it would compute this pass
            if own <= 0:
                continue
            led = any(
                other.namespace == m.namespace
                and other.cached == at
                and 2 * (common_prefix_len(ids, wanted, at) - at) >= own
                for other, ids in computing
            )
            if led:
                waiting.add(id(m))
            else:
                computing.append((m, wanted))
        self.stats.deferred += len(waiting)
        return [m for m in reqs if id(m) not in waiting]

    def _take_rows(self, req: Request, wanted: list[int]) -> None:
        """Copy into ``req`` the longest run of ``wanted`` past what it holds that a running call
        of its namespace holds."""
        at = req.cached
        if at >= len(wanted):
            return
        others = [o for o in self.running if o is not req and o.namespace == req.namespace]
        donor, end = longest_holder([o.target for o in others], wanted, at)
        if donor is None:
            return
        try:
            self.stats.shared += request.take_rows(req, others[donor], end)
        except Exception:  # the request computes them instead: a copy only saves work
            log.warning("copying %d prompt rows from another call failed", end - at, exc_info=True)

    def _shares(self, reqs: list[Request], chunk: int | None) -> list:
        """Each request's share of the pass (or the exception its drafting raised)."""
        cap = self.draft_cap(reqs)
        if len(reqs) == 1 or not self.batch_drafts:
            return [_share(m, chunk, cap) for m in reqs]
        drafting = DraftRound(share=self.share_prompts)
        shares = drafting.run([request.plan(m, chunk, cap) for m in reqs], [m.namespace for m in reqs])
        self.stats.draft_steps += drafting.steps
        self.stats.draft_passes += drafting.passes
        self.stats.draft_shared += drafting.shared
        return shares

    def _fail(self, req: Request, exc: BaseException) -> None:
        self.remove(req)
        request.fail(req, exc)

    def _forward(self, fed: list[tuple[Request, request.Share]]) -> dict[int, Any]:
        """Each fed request's logits (or the exception its rows failed with), by ``id(request)``."""
        if len(fed) == 1:
            m, s = fed[0]
            return {id(m): self._alone(m, s)}
        states = [m.target for m, _ in fed]
        if not all(packable(state) for state in states):  # a model or cache the packed pass cannot feed
            return {id(m): self._alone(m, s) for m, s in fed}
        # every head on a pair reads the same layers: a pass taps them for the requests that read them
        tap = next((s.tap for _, s in fed if s.tap), ())
        try:
            outs = forward_packed(states, [s.feed for _, s in fed], [s.keep for _, s in fed], tap)
        except Exception as exc:
            if is_oom(exc):
                log.warning("out of memory in a pass of %d calls: retrying them in halves", len(fed))
                self._free(fed)
            half = len(fed) // 2  # otherwise one call's rows may be at fault: narrow it down
            return {**self._forward(fed[:half]), **self._forward(fed[half:])}
        return {id(m): out if s.tap or not tap else out[0] for (m, s), out in zip(fed, outs)}

    @staticmethod
    def _alone(req: Request, share: request.Share) -> Any:
        try:
            return forward_retrying(req.target, share.feed, share.keep, req.free_memory, share.tap)
        except Exception as exc:
            return exc

    @staticmethod
    def _free(fed: list[tuple[Request, request.Share]]) -> None:
        frees = {id(m.free_memory): m.free_memory for m, _ in fed if m.free_memory is not None}
        for free in frees.values():
            try:
                free()
            except Exception:  # freeing is best effort: the retry says whether it sufficed
                log.exception("freeing memory before a retry failed")
        release_cached_memory()
