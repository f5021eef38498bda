"""A call on a pair: it joins the pair's engine as a ``Request``, reads its Steps, and leaves.

``stream`` hands the engine (``agentspec.scheduler``) the call's join: the prompt checked, the
drafter readied (its health: ``pair.tenants``), the prefix cache read (``_restore``), the request
made (``_begin``, ``agentspec.request``). The engine's passes run every request on the pair in one
target forward (a call alone is a pass of one) and put each request's Steps in its outbox, which the
caller reads. Leaving is the engine's task too: the drafter's health recorded and the verified
state written to the prefix cache (``_save``). ``run`` wraps ``stream`` in a ``Run`` that ends in
the call's ``CallRecord``. Every entry point (``generate``, ``agentspec.chat.run`` for the LangChain
chat model and the server, the benchmarks) consumes one of these.
"""

from __future__ import annotations

import logging
import operator
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from agentspec.config import GenerationConfig
from agentspec.cost import baseline_seconds
from agentspec.drafters import Drafter
from agentspec.drafters.registry import build_drafter, check_name
from agentspec.drafters.tenants import TenantStore
from agentspec.grammar import Constraint, Grammar
from agentspec.kv import ModelState
from agentspec.memory import cache_oom_frees_cache, forward_retrying, is_oom
from agentspec.models import ModelPair
from agentspec.request import DecodeTimeout, Request, Step, steps
from agentspec.sampling import make_generator
from agentspec.scheduler import NotTaken
from agentspec.stats import DecodeStats
from agentspec.text import TextTracker
from agentspec.threads import release_pool

log = logging.getLogger(__name__)

DEFAULT_DRAFT_CAP = 4  # draft tokens per pass when neither the call nor the drafter sets a cap


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (an EOS that ended generation is included)
    text: str  # generated text, cut before a stop string, without EOS
    finish_reason: str
    stats: DecodeStats


def resolve_drafter(
    pair: ModelPair, drafter: Any, speculative: bool = True, namespace: str | None = None
) -> Drafter | None:
    """A drafter instance from a name (``agentspec.drafters.NAMES``; None: the default, "auto") or an
    instance (a ``Drafter`` subclass's). A drafter built from a name learns into the pair's drafting
    memory for ``namespace`` (``pair.tenants``)."""
    if not speculative:
        return None
    if isinstance(drafter, Drafter):
        return drafter
    return build_drafter(pair, check_name(drafter), pair.tenants.memory(namespace))


class ContextLengthExceeded(ValueError):
    """A prompt leaves no room in the model's context window for a reply (``context_room`` < 1)."""

    def __init__(self, prompt_tokens: int, max_context: int, what: str = "prompt_ids"):
        self.prompt_tokens, self.max_context = prompt_tokens, max_context
        super().__init__(
            f"{what}: the prompt has {prompt_tokens} tokens but the model's context is {max_context}; "
            "shorten the prompt"
        )


def context_room(pair: ModelPair, prompt_tokens: int) -> int:
    """The most output tokens a prompt of ``prompt_tokens`` leaves room for in the pair's context
    window: the one place that counts it (the chat layer's fit, the prompt check and the loop's budget)."""
    return pair.max_context - prompt_tokens


def check_prompt(pair: ModelPair, prompt_ids: Any) -> list[int]:
    """Prompt ids as a list of ints, or a clear error."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids: expected shape [n] or [1, n], got {list(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise TypeError(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}")
    ids = list(prompt_ids)
    if not ids:
        raise ValueError("prompt_ids is empty: the prompt needs at least one token")
    vocab = pair.target.config.vocab_size
    for j, i in enumerate(ids):
        if isinstance(i, bool):
            raise ValueError(f"prompt_ids: {i!r} is not a token id in [0, {vocab})")
        try:
            ids[j] = i = operator.index(i)  # ints, numpy integers, 0-d integer tensors
        except TypeError:
            raise ValueError(f"prompt_ids: {i!r} is not a token id in [0, {vocab})") from None
        if not 0 <= i < vocab:
            raise ValueError(f"prompt_ids: {i!r} is not a token id in [0, {vocab})")
    if context_room(pair, len(ids)) < 1:
        raise ContextLengthExceeded(len(ids), pair.max_context)
    return ids


def _begin(
    pair: ModelPair,
    ids: list[int],
    config: GenerationConfig,
    drafter: Drafter | None,
    target: ModelState,
    grammar: Grammar | Constraint | None,
    free_memory: Callable[[], None] | None,
    start: float,
    namespace: str | None,
    cancelled: threading.Event | None,
) -> Request:
    """A call's request after ``ids`` (checked prompt ids); ``target`` is synced to what it covers of
    them. ``start``: when the call began (its wait for the pair and its cache restore included), the
    one origin of its times (``DecodeStats.time_to_first_token_s``, ``total_time_s``) and of its
    deadline."""
    if isinstance(grammar, Constraint) or grammar is None:
        constraint = grammar
    else:
        constraint = Constraint.for_pair(pair, grammar)
    cap = config.num_draft_tokens
    if cap is None and drafter is not None:
        cap = drafter.draft_cap
    if cap is None:
        cap = DEFAULT_DRAFT_CAP
    target.sync(ids[:-1])  # the last prompt token is fed with the first pass
    stats = DecodeStats(drafter=drafter.name if drafter else None, prompt_tokens=len(ids))
    stats.cached_tokens = len(target.ids)
    stats.prefill_tokens = len(ids) - len(target.ids)
    eos = set(config.eos_token_ids) if config.eos_token_ids is not None else pair.eos_token_ids
    key = None
    if config.reproducible and not config.greedy:
        key = config.seed if config.seed is not None else random.getrandbits(63)
    return Request(
        config,
        target,
        drafter,
        constraint,
        free_memory,
        seq=list(ids),
        stats=stats,
        eos=eos,
        text=TextTracker(pair.tokenizer, config.stop, eos),
        gen=None if config.greedy else make_generator(config.seed, pair.device),
        draft_cap=cap,
        budget=min(config.max_new_tokens, context_room(pair, len(ids))),
        start=start,
        deadline=None if config.timeout is None else start + config.timeout,
        vocab=pair.target.config.vocab_size,
        device=pair.device,
        invariant_rows=pair.invariant_rows,
        namespace=namespace,
        cancelled=cancelled,
        key=key,
        # a keyed call's output does not depend on its drafts: the likeliest ones serve it best
        draft_config=config if key is None else replace(config, temperature=0.0),
    )


def _config(options: dict) -> GenerationConfig:
    config = options.pop("config", None)
    if config is not None and options:
        raise TypeError(f"pass either config= or options, not both: {sorted(options)}")
    return config if config is not None else GenerationConfig(**options)


def _ready(
    tenants: TenantStore, namespace: str | None, d: Drafter | None, key: str | None
) -> tuple[Drafter | None, str | None]:
    """The drafter for this call, reset, or None; and the name of one sitting out its cool-down.

    Drafters named by string are built afresh per call, so their failures are counted by name
    (``key``) in the call's namespace, or the pair's when out of memory (``agentspec.drafters.tenants``);
    a Drafter instance passed in is the caller's own.
    """
    if d is None:
        return None, None
    if key is not None and not tenants.allow(namespace, key):  # it kept failing: the target alone, a while
        return None, key
    try:
        d.reset()
    except Exception as exc:
        log.warning("drafter %s failed to reset (%r); decoding without it", d.name, exc)
        if key is not None:
            tenants.record(namespace, key, failed=True, oom=is_oom(exc))
        return None, None
    return d, None


def _restore(pair: ModelPair, cache, ids: list[int], d: Drafter | None, namespace: str | None) -> ModelState:
    """The target's state for ``ids`` from the prefix cache, and the drafter's, which it adopts."""
    draft = d.kv_state() if d is not None else None
    forwards = {"target": pair.target_forward}
    if draft is not None:
        forwards["draft"] = draft.model_forward
    states = {}
    with cache_oom_frees_cache(cache, "restoring from"):  # then prefill in full
        states = cache.restore(pair, ids, forwards, namespace)
    if "draft" in states:
        d.adopt_kv_state(states["draft"])
    target = states.get("target") or ModelState(pair.target_forward)
    if d is not None and d.context_rows and target.ids:
        # a head drafts from the target's features, which the cache does not keep: the last restored
        # positions are computed again, in the call's first pass, to give it a context
        target.truncate(max(0, len(target.ids) - d.context_rows))
    return target


def _save(
    pair: ModelPair, cache, target: ModelState, d: Drafter | None, ended: bool, namespace: str | None
) -> int:
    """Save the verified states to the prefix cache (the drafter's caught up first, unless it failed);
    returns how many target positions were new to it (the last ones of ``target.ids``)."""
    if ended and d is not None and d.kv_state() is not None:
        try:  # the draft then covers the same verified tokens (also when closed early)
            d.catch_up(target.ids)
        except Exception as exc:  # a broken draft: the cache keeps the part it covered
            log.warning("draft catch-up failed (%r); the cache keeps the draft's shorter part", exc)
    saved = {"target": target}
    draft = d.kv_state() if d is not None else None
    if draft is not None:
        saved["draft"] = draft
    written = 0
    with cache_oom_frees_cache(cache, "saving to"):  # it costs the cache, not the reply
        written = cache.save(pair, saved, namespace)
    return written


def stream(
    pair: ModelPair,
    prompt_ids: Any,
    drafter: Any = None,
    prefix_cache: Any = True,
    grammar: Grammar | Constraint | None = None,
    namespace: str | None = None,
    *,
    cancelled: threading.Event | None = None,
    **options: Any,
) -> Iterator[Step]:
    """Yield Steps as tokens are verified. Options are GenerationConfig fields (or ``config=``).

    ``grammar`` (an ``agentspec.grammar.Grammar``, or a fresh ``Constraint`` for one) constrains the
    output: the target's logits at every verified position are masked to the tokens the grammar
    allows, so the output is drawn from the target's distribution restricted to the grammar, exactly
    as plain constrained decoding would draw it. With ``config.jump_forward``, a token that the
    grammar alone allows is appended without a model guess (it is fed with the next pass), and text
    the grammar forces is proposed as draft tokens.

    The call decodes in the pair's scheduler (``pair.scheduler``, ``agentspec.scheduler``): its passes
    are shared with every other call running on the pair, one target forward for all of them, and
    each call's output is what it would be alone. The engine's thread joins it (restores from the
    prefix cache) and leaves it (saves to it) between passes; the caller only reads its Steps.

    ``prefix_cache``: True uses the pair's cache (restore the longest cached prefix, save the
    verified state afterwards), False decodes from scratch (the no-reuse baseline, same loop), or
    pass a ``PrefixCache``. Closing the generator early stops the call at the next pass and still
    saves what was verified. With ``timeout`` (seconds), the wait to join and the decode together
    are bounded: past it the call raises ``DecodeTimeout``, having saved what was verified, when it
    timed out decoding, as a closed stream does.

    ``namespace`` keeps tenants apart: it picks the prefix cache's namespace (a call restores only
    what calls of its own namespace saved) and the drafting memory of earlier outputs
    (``pair.tenants``) that a drafter named by string drafts from and adds to, so one namespace's
    prompts never speed up another's calls, and a drafter's failures other than out of memory rest it
    in that namespace only (None: the default, shared by every call that names none). Outputs are
    the same either way.

    ``cancelled``: once set, the call takes no further pass (a consumer that left): its Steps end
    at the next pass boundary, without a finish reason, and what was verified is saved.
    """
    yield from _calls(pair, prompt_ids, drafter, prefix_cache, grammar, namespace, cancelled, options, None)


def _calls(
    pair: ModelPair,
    prompt_ids: Any,
    drafter: Any,
    prefix_cache: Any,
    grammar: Grammar | Constraint | None,
    namespace: str | None,
    cancelled: threading.Event | None,
    options: dict[str, Any],
    left: list[DecodeStats] | None,
) -> Iterator[Step]:
    """``stream``'s Steps; once the call has left the pair (its state saved), its stats, final, are
    appended to ``left`` where given (``run``'s record reads them: nothing changes them after)."""
    config = _config(options)
    d = resolve_drafter(pair, drafter, config.speculative, namespace)
    cache = _pick_cache(pair, prefix_cache)
    # the drafter's name in pair.tenants' health records (built from a name: not the caller's own)
    key = check_name(drafter) if drafter is None or isinstance(drafter, str) else None
    start = time.perf_counter()  # the call's times and its deadline count from here, the wait included
    scheduler = pair.scheduler

    def join() -> tuple[Request, Drafter | None]:  # in the engine's thread, between passes
        ids = check_prompt(pair, prompt_ids)
        ready, resting = _ready(pair.tenants, namespace, d, key)
        target = (
            _restore(pair, cache, ids, ready, namespace)
            if cache is not None
            else ModelState(pair.target_forward)
        )
        free = cache.clear if cache is not None else None
        req = _begin(pair, ids, config, ready, target, grammar, free, start, namespace, cancelled)
        req.stats.draft_cooldown = resting
        scheduler.add(req)
        return req, ready

    try:
        req, d = scheduler.call(join, config.timeout)
    except NotTaken:
        raise DecodeTimeout(
            f"agentspec: timed out after {config.timeout:g} s waiting for the model: another call holds it"
        ) from None
    ended = False  # finished, or closed by the caller (not failed)
    release_pool()  # a pool this thread's own work made: from here it only waits (agentspec.threads)

    def leave() -> None:  # in the engine's thread, between passes
        scheduler.remove(req)
        _leave(pair, cache, req, d, key, namespace, ended)

    try:
        yield from steps(req, scheduler.wake)
        ended = True
    except (GeneratorExit, DecodeTimeout):  # the state is whole between passes: saved as verified
        ended = True
        raise
    finally:
        req.closed = True
        scheduler.call(leave)
        if left is not None:
            left.append(req.stats)


def prefill(
    pair: ModelPair, prompt_ids: Any, prefix_cache: Any = True, namespace: str | None = None
) -> tuple[int, int]:
    """Put the KV state of ``prompt_ids`` (all but the last token, which a call feeds with its first
    pass) in the prefix cache, so that the calls after it restore the prompt instead of computing
    it: the server's n choices of one request prefill their prompt once. Returns (tokens restored
    from the cache, tokens computed); with no cache, (0, 0) and nothing is computed.

    While other calls decode, the prompt is fed in the scheduler's chunks, each a task of the engine
    between passes, so their passes go on beside it, as for a call's own prompt.
    """
    cache = _pick_cache(pair, prefix_cache)
    if cache is None:
        return 0, 0
    ids, scheduler = check_prompt(pair, prompt_ids), pair.scheduler
    target = scheduler.call(lambda: _restore(pair, cache, ids, None, namespace))
    restored = len(target.ids)

    def chunk() -> None:  # in the engine's thread: the others' passes run between chunks
        rest = ids[len(target.ids) : -1]
        size = scheduler.prefill_chunk if scheduler.running else len(rest)
        forward_retrying(target, rest[:size], 1, cache.clear)

    def save() -> None:
        with cache_oom_frees_cache(cache, "saving to"):
            cache.save(pair, {"target": target}, namespace)

    while len(target.ids) < len(ids) - 1:
        scheduler.call(chunk)
    scheduler.call(save)
    return restored, len(target.ids) - restored


def _leave(
    pair: ModelPair, cache, req: Request, d, key: str | None, namespace: str | None, ended: bool
) -> None:
    """A call's end, in the engine's thread between passes: its drafter's (``d``, dropped by the call or not)
    health, and its verified state saved."""
    stats = req.stats
    if key is not None and req.passes and stats.drafter is not None:
        pair.tenants.record(namespace, key, stats.draft_failures > 0, req.draft_oom)
    if cache is not None:
        target = req.target
        written = _save(pair, cache, target, d, ended, namespace)
        if req.passes:  # the new positions are the last ones: count those in the prompt
            held = len(target.ids) - written
            stats.cache_creation_tokens = max(0, min(stats.prompt_tokens, len(target.ids)) - held)


def _pick_cache(pair: ModelPair, prefix_cache: Any):
    from agentspec.cache import PrefixCache

    if prefix_cache is True:
        return pair.prefix_cache
    if prefix_cache is False or prefix_cache is None:
        return None
    if isinstance(prefix_cache, PrefixCache):
        return prefix_cache
    raise TypeError(f"prefix_cache: expected True, False or a PrefixCache, got {prefix_cache!r}")


def generate(
    pair: ModelPair,
    prompt_ids: Any,
    drafter: Any = None,
    prefix_cache: Any = True,
    grammar: Grammar | Constraint | None = None,
    namespace: str | None = None,
    **options: Any,
) -> GenerationResult:
    """Generate to the end; returns ids, text, finish reason and stats.

    >>> pair = load_pair()
    >>> ids = pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    >>> result = generate(pair, ids, max_new_tokens=64)  # greedy by default
    """
    ids: list[int] = []
    parts: list[str] = []
    last = None
    call = run(pair, prompt_ids, drafter, prefix_cache, grammar, namespace, **options)
    try:
        for last in call:
            ids += last.tokens
            parts.append(last.text)
    finally:
        record = call.close()
    assert last is not None and last.finish_reason is not None
    return GenerationResult(ids, "".join(parts), last.finish_reason, record.stats)


@dataclass
class CallRecord:
    """One call as it ended: its passes, the time inside the decoder, and the latency-saved estimate.

    The one record of a call that the span, the chat model's metadata and the server's response all
    read, so they report the same figures. ``decode_s`` is the decoder's own time: its passes and the
    time around them (the wait for the engine and the cache restore before the first, the cache
    save after the last), not the time the caller spent between Steps. ``baseline_s`` prices the same
    call with plain decoding and no cache on the pair's cost model (``agentspec.cost``), which the
    loop taught from every pass of this call before the estimate was made.
    """

    steps: list[Step]  # every Step the call yielded, in order
    # the call's stats as it left the pair (its cache writes counted); None: it yielded no Step
    stats: DecodeStats | None
    decode_s: float
    # from the call's start to the end of the first pass that gave tokens: the loop's own count
    # (``DecodeStats.time_to_first_token_s``), the one the stats and the span both report
    ttft_s: float | None
    first_chunk_s: float | None  # to the end of the first pass that released text or finished
    baseline_s: float | None  # None: no pass finished (nothing to compare)
    cost_source: str | None  # the cost model's ``source`` when the estimate was made
    closed_early: bool  # closed by the caller before its last Step (not by an error)

    @property
    def latency_saved_s(self) -> float | None:
        return None if self.baseline_s is None else self.baseline_s - self.decode_s

    @property
    def longest_draft(self) -> int:
        return max((s.drafted for s in self.steps), default=0)


class Run:
    """One call's Steps (iterate once) and, after ``close``, its ``CallRecord`` (``record``).

    Closing it closes the Step generator in the calling thread (the call leaves the engine, which
    saves the verified part to the prefix cache) and makes the record; a run that raised or was
    left early is closed the same way. ``run`` makes one from ``stream``'s arguments.
    """

    def __init__(self, pair: ModelPair, steps: Iterator[Step], left: list[DecodeStats] | None = None):
        self.pair, self._steps = pair, steps
        self._left = left if left is not None else []  # the call's final stats, once it has left
        self.steps: list[Step] = []
        self.start = time.perf_counter()
        self.record: CallRecord | None = None
        self._decode_s = 0.0
        self._first_chunk_s: float | None = None
        self._failed = False

    def __iter__(self) -> Iterator[Step]:
        # Passes are timed by the loop (Step.started, Step.seconds, on the call's perf_counter clock),
        # in the pair's scheduler thread, which runs ahead of the caller: the decoder's time is from
        # the call's start (the wait to join and the cache restore included) to the end of its last
        # pass, and the cleanup after it (``close``), not the time the caller spent between Steps.
        try:
            for step in self._steps:
                end = step.started + step.seconds - self.start
                self._decode_s = end
                self.steps.append(step)
                if self._first_chunk_s is None and (step.text or step.finish_reason is not None):
                    self._first_chunk_s = end
                yield step
        except Exception:
            self._failed = True  # the decoder raised: not a close by the caller
            raise

    def close(self) -> CallRecord:
        """Close the Steps (the cleanup timed as the decoder's) and make the record, once."""
        if self.record is None:
            t0 = time.perf_counter()
            self._steps.close()
            self._decode_s += time.perf_counter() - t0
            self.record = self._recorded()
        return self.record

    def _recorded(self) -> CallRecord:
        stats = (self._left[0] if self._left else self.steps[-1].stats) if self.steps else None
        baseline, source = None, None
        if stats is not None:
            cost = self.pair.cost.latency()
            baseline, source = baseline_seconds(cost, stats), cost.source
        finished = bool(self.steps) and self.steps[-1].finish_reason is not None
        early = not finished and not self._failed
        ttft = stats.time_to_first_token_s if stats is not None and stats.output_tokens else None
        return CallRecord(
            self.steps, stats, self._decode_s, ttft, self._first_chunk_s, baseline, source, early
        )


# ``stream``'s signature, as ``generate``'s: three forms of one call (Steps, a Run with its record, a result)
def run(
    pair: ModelPair,
    prompt_ids: Any,
    drafter: Any = None,
    prefix_cache: Any = True,
    grammar: Grammar | Constraint | None = None,
    namespace: str | None = None,
    *,
    cancelled: threading.Event | None = None,
    **options: Any,
) -> Run:
    """``stream``'s call as a ``Run``: its Steps, then (closed) its ``CallRecord``."""
    left: list[DecodeStats] = []
    steps = _calls(pair, prompt_ids, drafter, prefix_cache, grammar, namespace, cancelled, options, left)
    return Run(pair, steps, left)
