"""The decoding loop: prefill, draft, verify in one target pass, accept, roll back. One generator.

A pass is planned (``_plan``: forced tokens, the draft, what the target is fed), run (a target
forward), judged on the device (``_judge``), read, and landed (``_land``: accept, roll back, finish).
``stream`` makes a call a member of the pair's scheduler (``agentspec.scheduler``), whose passes run
the planned shares of every call on the pair in one forward (a call alone is a pass of one); it adds
the drafter's health and the prefix cache (read in ``_restore`` when the call joins, written in
``_save`` when it leaves). ``run`` wraps ``stream`` in a ``Run`` that ends in the call's
``CallRecord``. Every entry point (``generate``, ``agentspec.chat.run`` for the LangChain chat model
and the server, the benchmarks) consumes one of these.

Cache invariant, asserted by ``ModelState``: after every step the target's cache holds exactly the
verified sequence minus its last token, which is fed (with the next draft) on the next pass; the
draft model's cache is synced to the same verified tokens before it proposes.

A k-token draft costs one target pass over k+1 tokens: the pending token and the k draft tokens.
Row i of that pass's logits scores draft token i; row k gives the bonus token.
"""

from __future__ import annotations

import logging
import operator
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from agentspec import logprobs as lp
from agentspec.config import GenerationConfig
from agentspec.cost import baseline_seconds
from agentspec.drafters import Draft, Drafter
from agentspec.drafters.registry import build_drafter, check_name
from agentspec.drafters.schedule import survival
from agentspec.drafters.tenants import TenantStore
from agentspec.grammar import Constraint, Grammar, apply_bitmask
from agentspec.kv import ModelState, PassIds, to_device
from agentspec.memory import cache_oom_frees_cache, forward_retrying, is_oom, release_cached_memory
from agentspec.models import ModelPair
from agentspec.packed import Read, Verdict
from agentspec.sampling import keyed_scores, make_generator, probabilities
from agentspec.scheduler import LOOKAHEAD, Member, NotTaken
from agentspec.stats import DecodeStats
from agentspec.steps import Steps
from agentspec.text import TextTracker
from agentspec.threads import release_pool
from agentspec.verify import greedy_accept, speculative_accept

log = logging.getLogger(__name__)

DEFAULT_DRAFT_CAP = 4  # draft tokens per pass when neither the call nor the drafter sets a cap


class DecodeTimeout(TimeoutError):
    """A call ran past its ``GenerationConfig.timeout``: waiting for the pair (another call held its
    lock), or decoding (checked between passes). The pair, its lock and its prefix cache are ready
    for the next call; a call timed out while decoding saved its verified part, as a closed stream."""


@dataclass
class Step:
    """What one target pass added to the output."""

    tokens: list[int]  # verified tokens this pass adds to the output (after EOS/stop/length trims)
    text: str  # text newly safe to show (may be "" while a stop string or character is pending)
    drafted: int  # draft tokens verified in this pass
    accepted: int  # of those, accepted
    prefill: int  # prompt tokens the target computed in this pass (first pass only)
    seconds: float  # wall time of this pass, drafting included (``time.perf_counter`` from ``started``)
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length", on the last step
    # the call's stats as this pass left them (a snapshot: the loop runs ahead of the caller); what the
    # call's leaving adds (``cache_creation_tokens``) is in its ``CallRecord.stats``
    stats: DecodeStats = field(default_factory=DecodeStats, repr=False)
    forced: int = 0  # of ``tokens``, those a grammar forced (appended without a model guess)
    target_pass: bool = True  # a target forward ran (False: the grammar alone added these tokens)
    fed: int = 0  # tokens the target's pass was fed (uncached prompt or pending tokens, forced, drafts)
    cached: int = 0  # tokens in the target's KV cache before the pass (restored or verified earlier)
    restored: int = 0  # prompt tokens restored from the prefix cache or copied from a call (first step)
    started: float = 0.0  # ``time.perf_counter()`` when the pass began
    # each of ``tokens``' log-probability under the target, when the call asked (``config.logprobs``)
    logprobs: list[lp.TokenLogprob] | None = None
    source: str | None = None  # where the verified draft came from (``Draft.source``; None: no draft)
    # each verified draft token's estimated acceptance given those before it, as the drafter gave it
    # (``Draft.survival``: host floats, or a head's tensor, not read back: on a GPU it stays on the
    # device until a reader wants it, e.g. a calibration measurement); None where the draft had none
    acceptance: list[float] | torch.Tensor | None = None


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


def check_draft(draft: Draft, k: int, vocab: int) -> Draft:
    """Validate a drafter's proposal; a ValueError here counts as a drafter failure.

    What needs no read of device values: host ids, a tensor's form, q's shape. Device ids and q's
    values are guarded in ``_guard``, on the device, and reported with the verification's read.
    """
    if isinstance(draft.tokens, torch.Tensor):
        tokens = draft.tokens[:k]
        if tokens.dim() != 1 or tokens.dtype != torch.long:
            shape = list(tokens.shape)
            raise ValueError(f"draft tokens: expected a [k] long tensor, got {tokens.dtype} {shape}")
    else:
        tokens = [int(t) for t in draft.tokens[:k]]
        _check_ids(tokens, vocab)
    q = draft.q
    if q is not None:
        q = q[: len(tokens)]
        if tuple(q.shape) != (len(tokens), vocab):
            raise ValueError(f"draft q has shape {tuple(q.shape)}, expected {(len(tokens), vocab)}")
    est = draft.survival  # estimates that do not cover the draft are not used
    est = est[: len(tokens)] if est is not None and len(est) >= len(tokens) else None
    return Draft(tokens, q, draft.source, est)


def _check_ids(tokens: list[int], vocab: int) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft token ids outside [0, {vocab}): {bad[:5]}")


def _drop(drafter: Drafter, exc: Exception, stats: DecodeStats) -> None:
    """Log a drafter failure and drop the drafter for the rest of the call."""
    log.warning("drafter %s failed (%r); continuing with the target alone", drafter.name, exc)
    stats.draft_failures += 1
    if is_oom(exc):
        release_cached_memory()
    try:
        drafter.reset()
    except Exception:  # a drafter that cannot even reset is simply not used again
        log.exception("drafter %s failed to reset", drafter.name)
    return None


def _finish(
    new: list[int], n_out: int, budget: int, eos: set[int], text: TextTracker, out: list[int]
) -> tuple[list[int], str | None, int | None]:
    """Trim a pass's tokens at EOS, the token budget and stop strings: (kept, reason, text cut)."""
    reason = None
    for i, tok in enumerate(new):
        if tok in eos:
            new, reason = new[: i + 1], "stop"
            break
    room = budget - n_out
    if len(new) > room:
        new, reason = new[:room], "length"
    elif len(new) == room and reason is None:
        reason = "length"
    hit = text.first_stop(out, new)
    if hit is not None:
        return new[: hit[0]], "stop", hit[1]
    return new, reason, None


JUMP_FORWARD_LIMIT = 16  # the most grammar-forced tokens proposed in one verify pass


def _fit_to_grammar(constraint: Constraint, tokens: list[int], start: int, sampled: bool) -> int:
    """Push ``tokens[start:]`` onto the constraint's path; return how many draft tokens to verify.

    A drafter that masks its own draft has pushed its tokens already. At the first token the
    grammar forbids, a deterministic draft is cut before it (a shorter deterministic draft is just
    another draft); a sampled draft keeps it, since cutting a sampled draft where the sample landed
    would skew the output distribution: verification rejects that token (its masked target
    probability is 0) and resamples from the residual, as for any rejection.
    """
    if constraint.path != tokens[: len(constraint.path)]:  # a drafter pushed something else: redo
        constraint.rewind(start)
    for i in range(len(constraint.path), len(tokens)):
        if not constraint.push(tokens[i]):
            return i + 1 if sampled else i
    return len(tokens)


@dataclass
class _Call:
    """One call's decoding state, read and advanced by each pass (``_Member``)."""

    pair: ModelPair
    config: GenerationConfig
    target: ModelState  # covers the verified sequence minus the tokens still to feed
    drafter: Drafter | None  # None: no drafter, or it failed and was dropped for the rest of the call
    constraint: Constraint | None
    free_memory: Callable[[], None] | None  # frees memory before a target pass is retried
    seq: list[int]  # the verified sequence: prompt + output so far
    stats: DecodeStats
    eos: set[int]
    text: TextTracker
    gen: torch.Generator | None  # None: greedy
    draft_cap: int  # the most drafter tokens per pass
    budget: int  # the most output tokens (max_new_tokens, within the context window)
    start: float  # ``time.perf_counter()`` when the call began
    deadline: float | None  # ``time.perf_counter()`` past which no further pass starts (None: no limit)
    out: list[int] = field(default_factory=list)  # the output so far
    passes: int = 0  # steps yielded so far
    draft_oom: bool = False  # the drafter was dropped out of memory: a failure of the pair's, not the call's
    key: int | None = None  # a reproducible sampled call's seed: its draws are keyed by it and the position
    draft_config: GenerationConfig | None = None  # what the drafter is told (greedy for a keyed call)

    @property
    def vocab(self) -> int:
        return self.pair.target.config.vocab_size

    @property
    def jump(self) -> bool:
        return self.constraint is not None and self.config.jump_forward

    def drop(self, exc: Exception) -> None:
        self.draft_oom = is_oom(exc)
        self.drafter = _drop(self.drafter, exc, self.stats)


def _deadline(config: GenerationConfig, start: float) -> float | None:
    """The ``time.perf_counter()`` at which a call that started at ``start`` times out (None: no limit)."""
    return None if config.timeout is None else start + config.timeout


def _begin(
    pair, ids: list[int], config, drafter, target, grammar, free_memory, start: float, deadline
) -> _Call:
    """A call's state after ``ids`` (checked prompt ids); ``target`` is synced to what it covers of them.
    ``start``: when the call began (its wait for the pair and its cache restore included), the one
    origin of its times (``DecodeStats.time_to_first_token_s``, ``total_time_s``) and of its deadline."""
    target = target if target is not None else ModelState(pair.target_forward)
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
    return _Call(
        pair,
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
        deadline=deadline,
        key=key,
        # a keyed call's output does not depend on its drafts: the likeliest ones serve it best
        draft_config=config if key is None else replace(config, temperature=0.0),
    )


def _propose(call: _Call, seq: list[int], k: int) -> Steps[Draft]:
    """The drafter's checked proposal after ``seq``; a failure drops the drafter (an empty draft)."""
    d = call.drafter
    c = call.constraint if d.masks_own_draft else None
    try:
        draft = yield from d.propose_steps(seq, k, call.draft_config, call.gen, constraint=c)
        return check_draft(draft, k, call.vocab)
    except Exception as exc:  # the target alone gives the same output: carry on without
        call.drop(exc)
        return Draft([])


def _draft(call: _Call, forced: list[int], k: int, finished: bool, cap: int | None = None) -> Steps[tuple]:
    """The pass's draft after ``forced``: the text the grammar forces, then the drafter's guess, fit
    to the grammar. Returns (tokens: host ids, or a [k] tensor still on the device; q [len(tokens),
    V] or None; jump-forward tokens leading; source; each token's estimated acceptance given those
    before it, or None: none, or a grammar shaped the draft)."""
    c = call.constraint
    tokens = c.push_jump_forward(min(JUMP_FORWARD_LIMIT, k)) if call.jump else []
    n_jump = len(tokens)
    k_draft = min(call.draft_cap if cap is None else min(cap, call.draft_cap), k - n_jump)
    q, source, acceptance = None, None, None
    if call.drafter is not None and k_draft > 0 and not finished:
        seq = call.seq + forced + tokens if forced or tokens else call.seq  # no copy per pass if none
        draft = yield from _propose(call, seq, k_draft)
        source = draft.source
        acceptance = draft.survival if c is None else None
        drafted = draft.tokens
        if c is not None and isinstance(drafted, torch.Tensor):  # the grammar fits a draft on the host
            drafted = drafted.tolist()
        if draft.q is not None:  # jump-forward tokens are certain proposals: one-hot q
            jumped = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), call.vocab)
            q = torch.cat([jumped.to(draft.q), draft.q]) if tokens else draft.q
        tokens = drafted if not tokens else tokens + drafted  # no jump-forward without a grammar
    if c is not None:
        tokens = tokens[: _fit_to_grammar(c, tokens, n_jump, q is not None)]
    if len(tokens) == n_jump:  # no drafter guess survived: only grammar-forced tokens, or nothing
        source = "jump_forward" if n_jump else None
    return tokens, q, n_jump, source, acceptance


def _guard(d: torch.Tensor, q: torch.Tensor | None, vocab: int, on_device: bool):
    """The draft made safe to verify without reading it: (d, q, a [] flag set when it was not).

    Device ids outside the vocabulary are clamped into it (fed to an embedding they would fault
    the device). Rows of q that are not distributions (non-finite or negative entries) become
    one-hot at their token, which speculative verification treats exactly as a model-free draft:
    lossless whatever the token was drawn from. The flag, read with the verification's result,
    makes the draft a drafter failure; a valid draft is left exactly as it was.
    """
    flags = []
    if on_device:
        flags.append(((d < 0) | (d >= vocab)).any())
        d = d.clamp(0, vocab - 1)
    if q is not None:
        ok = (torch.isfinite(q) & (q >= 0)).all(dim=-1)  # [k]
        flags.append(~ok.all())
        q = torch.where(ok[:, None], q, 0.0)  # [k, V]: one new tensor per pass, a bad row zeroed
        at = d.to(q.device)[:, None]
        q.scatter_(1, at, torch.where(ok[:, None], q.gather(1, at), 1.0))  # ... and one-hot at its token
    return d, q, torch.stack(flags).any() if flags else None


@dataclass
class _Pass:
    """One call's share of a target pass: planned before the pass runs (``_plan``), landed after it
    (``_land``). A scheduler packs the ``feed`` of several calls into one forward."""

    started: float  # ``time.perf_counter()`` when the call's pass began (its drafting included)
    at: int  # position of the pass's first token
    pending: list[int]  # verified tokens the target has not seen: the last one at least
    forced: list[int]  # tokens the grammar forces (certain: no model guess needed)
    tokens: Any  # the draft: host ids, or a [k] tensor still on the device
    n_jump: int  # of ``tokens``, the grammar's jump-forward tokens leading
    source: str | None  # the drafter's source of the draft (None: no draft)
    verified: bool  # a target forward runs (False: the grammar alone finishes the call)
    feed: PassIds | None = None  # what the target is fed: pending and forced on the host, the draft
    q: torch.Tensor | None = None  # the draft's distributions, guarded (sampled calls only)
    bad: torch.Tensor | None = None  # a [] flag: the draft was not valid (``_guard``)
    tap: tuple[int, ...] = ()  # the target's features its drafter reads (an EAGLE head's layers)
    chunk: bool = False  # a chunk of the prompt only, fed beside other calls' rows: no logits, no Step
    scored: bool = False  # the call asked for log-probabilities: the forced tokens' rows are kept too
    # each draft token's estimated acceptance given those before it (host floats, or a [k] tensor),
    # where a scheduler may verify a prefix of the draft only (a greedy or seeded call's, drafted
    # without a grammar); None: the draft is verified whole
    acceptance: list[float] | torch.Tensor | None = None

    @property
    def keep(self) -> int:
        """The logits rows the call reads: one per draft token, and the bonus row (none for a
        chunk); scored, the forced tokens' rows before them (a pass the grammar alone finishes
        keeps only those)."""
        if self.chunk:
            return 0
        forced = len(self.forced) if self.scored else 0
        return forced + (len(self.tokens) + 1 if self.verified else 0)

    @property
    def survival(self) -> list[float] | None:
        """S_1 >= S_2 >= ...: the chance that the draft's first i tokens all survive (read only by a
        scheduler sharing the pass: on a GPU, a head's estimates reach the host here)."""
        a = self.acceptance
        return None if a is None else survival(a.tolist() if isinstance(a, torch.Tensor) else a)

    def trim(self, n: int) -> None:
        """Verify only the draft's first ``n`` tokens (a shorter deterministic draft is just another
        draft: the output is the same)."""
        self.tokens = self.tokens[:n]
        self.acceptance = self.acceptance[:n]
        self.feed = PassIds(self.feed.host, self.feed.device[:n])


def _chunk(call: _Call, size: int) -> _Pass | None:
    """The next ``size`` tokens of the prompt's uncached part, when more than ``size`` are left
    before its last token (fed with the first full pass); else None."""
    at = len(call.target.ids)
    if len(call.seq) - 1 - at <= size:
        return None
    feed = PassIds(call.seq[at : at + size])
    return _Pass(time.perf_counter(), at, [], [], [], 0, None, False, feed=feed, chunk=True)


def _plan(call: _Call, cap: int | None = None) -> Steps[_Pass]:
    """Draft (at most ``cap`` drafter tokens, None: the call's own cap), and what the target is to
    be fed: a call's share of its next pass. ``cap`` binds greedy calls only: a sampled call's draws
    depend on its draft lengths, and a seeded one draws the same whatever runs beside it."""
    t0 = time.perf_counter()
    seq, target, c = call.seq, call.target, call.constraint
    at = len(target.ids)
    pending = seq[at:]
    room = call.budget - len(call.out)  # tokens this pass may add (the budget is within the context)
    forced = c.take_forced(room) if call.jump else []
    # read before any draft is pushed: a drafter may draft up to the grammar's stop token on the path
    finished = c is not None and c.terminated
    # never draft past the token budget or the context window
    cap = cap if call.config.greedy or call.key is not None else None
    cap = _invariant_cap(call, len(pending) + len(forced), cap)
    tokens, q, n_jump, source, acceptance = yield from _draft(
        call, forced, room - len(forced) - 1, finished, cap
    )
    verified = not (forced and (len(forced) == room or finished))  # else the grammar alone finishes
    scored = call.config.logprobs is not None
    p = _Pass(t0, at, pending, forced, tokens, n_jump, source, verified, scored=scored)
    if not verified and p.scored:  # the forced tokens' rows come from a pass that feeds them
        p.feed = PassIds(pending + forced[:-1])
    if verified:
        on_device = isinstance(tokens, torch.Tensor)
        d = tokens if on_device else to_device(tokens, call.pair.device)  # [k]
        sampled = not call.config.greedy and call.key is None  # verified by rejection sampling
        q = q[: len(tokens)] if q is not None and sampled else None
        d, p.q, p.bad = _guard(d, q, call.vocab, on_device)
        p.feed = PassIds(pending + forced, d)
        p.tap = call.drafter.feature_layers if call.drafter is not None else ()
        if acceptance is not None and len(tokens) and not sampled:
            p.acceptance = acceptance
    return p


def _invariant_cap(call: _Call, fed: int, cap: int | None) -> int | None:
    """``cap``, lowered so that a pass feeding ``fed`` tokens before its draft keeps every row as a
    one-row step computes it, where the pair's passes are row-invariant only up to some rows
    (``attention.invariant_rows``: bfloat16 on a CPU). Past that, a pass's rows depend on its row
    count, so drafts riding a prompt's pass would change the prompt's cache from plain decoding's:
    the prompt goes alone (as plain decoding feeds it) and drafting starts at the next pass."""
    limit = call.pair.invariant_rows if fed > 1 else None
    if limit is None:
        return cap
    room = max(0, limit - fed - 1) if fed < limit else 0
    return room if cap is None else min(cap, room)


def _judge(call: _Call, p: _Pass, out) -> tuple[Verdict, torch.Tensor | None]:
    """Accept the draft against the pass's logits ``out`` ([keep, V], with the hidden rows when
    tapped), on the device: what the host is to read (``_accept`` takes it), and the hidden rows."""
    try:
        logits, hidden = out if p.tap else (out, None)  # [keep, V]; [pass tokens, H]
        if not p.verified:  # it scores the tokens the grammar forced, which finish the call
            forced = to_device(p.forced, logits.device)
            scores = lp.scores(lp.log_softmax(logits), forced, call.config.logprobs)
            return Verdict(forced[:0], scores), None
        return _verdict(call, p, logits), hidden
    except BaseException:
        call.target.truncate(p.at)  # the pass's positions are not verified: the state stays whole
        raise


def _verdict(call: _Call, p: _Pass, logits: torch.Tensor) -> Verdict:
    """``_judge`` for a verified pass: [n, token, (the draft was bad), (the draft's ids)], and the
    emitted tokens' scores where asked for."""
    c, config = call.constraint, call.config
    k, d, on_device = len(p.tokens), p.feed.device, isinstance(p.tokens, torch.Tensor)
    raw = lp.log_softmax(logits) if p.scored else None  # before any mask: the raw log-probabilities
    logits = logits[len(p.forced) :] if p.scored else logits  # [k+1, V]
    if c is not None:
        logits = apply_bitmask(logits, c.bitmasks(k + 1))
    if config.greedy:
        result = greedy_accept(d, logits)  # [2]
    else:
        probs = probabilities(logits, config.temperature, config.top_k, config.top_p)
        if call.key is not None:  # each row's draw is keyed by its output position: verified as greedy
            result = greedy_accept(d, keyed_scores(probs, call.key, len(call.out) + len(p.forced)))
        else:
            result = speculative_accept(d, probs, p.q, call.gen)
    parts = [result]
    if p.bad is not None:
        parts.append(p.bad.long().reshape(1).to(result.device))
    if on_device:
        parts.append(d.to(result.device))
    scores = None
    if raw is not None:
        tokens = lp.emitted(to_device(p.forced, raw.device), d, result)
        scores = lp.scores(raw, tokens, config.logprobs)
    return Verdict(torch.cat(parts), scores)


def _accept(
    call: _Call, p: _Pass, read: list[int], hidden: torch.Tensor | None
) -> tuple[int, int, list[int]]:
    """Take the verdict's values as read (``Verdict.values``): returns (draft tokens accepted, the
    token drawn after them, the accepted draft tokens); the target is rolled back to the verified
    tokens, and the constraint commits them."""
    target, c = call.target, call.constraint
    n, token = read[0], read[1]
    flagged = p.bad is not None and bool(read[2])
    accepted = read[2 + (p.bad is not None) :][:n] if isinstance(p.tokens, torch.Tensor) else p.tokens[:n]
    assert 0 <= token < call.vocab, f"{token=} {call.vocab=}"
    target.settle(accepted)  # roll back the rejected draft tokens
    if hidden is not None:  # the verified positions' features
        try:
            call.drafter.observe_features(p.at, hidden[: len(target.ids) - p.at])
        except Exception as exc:
            call.drop(exc)
    if flagged and call.drafter is not None:  # verified as a model-free draft: the output stands
        call.drop(ValueError("draft ids outside the vocabulary, or a q with negative or non-finite values"))
    if c is not None:
        c.commit(n)
        if not c.terminated and not c.push(token):
            raise RuntimeError(f"the grammar rejected token {token} drawn under its own mask")
        c.commit(len(c.path))
    return n, token, accepted


def _land(call: _Call, p: _Pass, read: Read | None, hidden: torch.Tensor | None = None) -> Step:
    """Accept, roll back, finish: what the pass (``read``: its verdict as read; None when no
    forward ran, the grammar alone) adds to the call's output."""
    seq, target, c, stats = call.seq, call.target, call.constraint, call.stats
    tokens, forced = p.tokens, p.forced
    n, new = 0, list(forced)
    if p.verified:
        n, token, accepted = _accept(call, p, read.values, hidden)
        stats.observe_step(len(tokens), n, p.source)
        stats.jump_forward_tokens += p.n_jump
        stats.jump_forward_accepted += min(n, p.n_jump)
        new += accepted + [token]
    new, reason, cut = _finish(new, len(call.out), call.budget, call.eos, call.text, call.out)
    if reason is None and c is not None and c.terminated:
        reason = "stop"  # the grammar is complete (it accepted a stop token)
    stats.forced_tokens += min(len(forced), len(new))
    call.out += new
    seq += new
    if call.drafter is not None and p.verified:
        try:
            call.drafter.feedback(seq, n, len(tokens))
        except Exception as exc:
            call.drop(exc)
    now = time.perf_counter()
    if len(call.out) == len(new):
        stats.time_to_first_token_s = now - call.start
    stats.output_tokens = len(call.out)
    if reason is not None:
        target.truncate(min(len(target.ids), len(seq) - 1))
        stats.finish_reason = reason
        stats.total_time_s = now - call.start
    call.passes += 1
    scores = read.scores if read is not None else None
    return Step(
        new,
        call.text.release(call.out, final=reason is not None, cut=cut),
        len(tokens),
        n,
        len(p.pending) - 1 if p.feed is not None else 0,
        now - p.started,
        reason,
        stats.snapshot(),
        forced=min(len(forced), len(new)),
        target_pass=p.feed is not None,
        fed=len(p.feed) if p.feed is not None else 0,
        cached=p.at,
        restored=stats.cached_tokens if call.passes == 1 else 0,
        started=p.started,
        logprobs=lp.entries(new, scores, call.config.logprobs) if scores is not None else None,
        source=(p.source or stats.drafter) if p.verified and len(tokens) else None,
        acceptance=p.acceptance,
    )


def _late(call: _Call) -> DecodeTimeout | None:
    """The timeout of a call whose deadline has passed (None: it has time left, or no deadline)."""
    if call.deadline is None or time.perf_counter() <= call.deadline:
        return None
    n = len(call.out)
    return DecodeTimeout(
        f"agentspec: timed out decoding after {call.config.timeout:g} s, the wait for the model "
        f"included ({n} output {'token' if n == 1 else 'tokens'} verified by then)"
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


_CANCELLED = object()  # the end of a cancelled call's Steps (``_Member.ready``)


class _Member:
    """One call as a member of its pair's scheduler (``agentspec.scheduler.Member``): its state, and
    the Steps on their way from the scheduler's thread to the caller's (``steps``)."""

    def __init__(
        self, pair: ModelPair, call: _Call, cancelled: threading.Event | None, namespace: str | None
    ):
        self.pair, self.call, self.cancelled, self.namespace = pair, call, cancelled, namespace
        self.target = call.target
        self.free_memory = call.free_memory
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # Steps, then a last Step or an error
        self.delivered = 0  # items put in the outbox
        self.taken = 0  # items the caller took
        self.closed = False  # the caller left: it takes no further pass
        self._at = len(call.target.ids)  # the target's length before the pass under way
        self._hidden: torch.Tensor | None = None  # the pass's hidden rows, from ``judge`` to ``land``

    def ready(self) -> bool:
        """It takes part in the next pass. A cancelled call takes none: the first time it is asked
        after the cancel, its Steps end (``_CANCELLED``), waking a caller waiting for the next."""
        if self.cancelled is not None and self.cancelled.is_set():
            if not self.closed:
                self.closed = True
                self._put(_CANCELLED)
            return False
        return not self.closed and self.delivered - self.taken < LOOKAHEAD

    def wanted(self) -> list[int]:
        if not self.prefilling:
            return []
        # a head recomputes its last context rows for their features, as after a restore (``_restore``)
        d = self.call.drafter
        return self.call.seq[: len(self.call.seq) - 1 - (d.context_rows if d is not None else 0)]

    def take_rows(self, donor: Member, end: int) -> int:
        taken = self.target.take_rows(donor.target, end)
        stats = self.call.stats
        stats.cached_tokens += taken
        stats.prefill_tokens -= taken
        stats.shared_prefix_tokens += taken
        return taken

    def share(self, chunk: int | None, cap: int | None) -> Steps[_Pass]:
        self._at = len(self.call.target.ids)  # where a pass that fails before its landing rolls back to
        p = _chunk(self.call, chunk) if chunk is not None else None
        return p if p is not None else (yield from _plan(self.call, cap))

    def trim(self, p: _Pass, n: int) -> None:
        p.trim(n)
        try:
            self.call.drafter.trimmed(n)
        except Exception as exc:
            self.call.drop(exc)

    @property
    def cached(self) -> int:
        return len(self.call.target.ids)

    @property
    def priority(self) -> int:
        return self.call.config.priority

    @property
    def prefilling(self) -> bool:
        return len(self.call.target.ids) < len(self.call.seq) - 1

    def judge(self, p: _Pass, out: Any) -> Verdict | None:
        if p.chunk or p.feed is None:  # a chunk of the prompt, or the grammar alone: nothing to read
            return None
        verdict, self._hidden = _judge(self.call, p, out)
        return verdict

    def land(self, p: _Pass, read: Read | None, alone: bool) -> bool:
        if p.chunk:
            return False
        hidden, self._hidden = self._hidden, None
        step = _land(self.call, p, read, hidden)
        if alone and step.target_pass:  # a pass of its own teaches the cost model, as a solo call's
            self.pair.cost.observe(step.fed, step.cached, step.seconds)
        self._put(step)
        if step.finish_reason is not None:
            return True
        late = _late(self.call)
        if late is not None:
            self._put(late)
        return late is not None

    def fail(self, exc: BaseException) -> None:
        self.call.target.truncate(self._at)  # the verified state, whatever the failed pass fed
        self._put(exc)

    def _put(self, item: Step | BaseException) -> None:
        self.delivered += 1
        self.outbox.put(item)

    def steps(self) -> Iterator[Step]:
        """The call's Steps as the scheduler lands them; an error it met is raised here."""
        while True:
            item = self.outbox.get()
            self.taken += 1
            self.pair.scheduler.wake()
            if isinstance(item, BaseException):
                raise item
            if item is _CANCELLED:
                return
            yield item
            if item.finish_reason is not None:
                return


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
    deadline = _deadline(config, start)
    scheduler = pair.scheduler

    def join() -> tuple[_Member, Drafter | None]:  # in the engine's thread, between passes
        ids = check_prompt(pair, prompt_ids)
        ready, resting = _ready(pair.tenants, namespace, d, key)
        target = (
            _restore(pair, cache, ids, ready, namespace)
            if cache is not None
            else ModelState(pair.target_forward)
        )
        free = cache.clear if cache is not None else None
        call = _begin(pair, ids, config, ready, target, grammar, free, start, deadline)
        call.stats.draft_cooldown = resting
        member = _Member(pair, call, cancelled, namespace)
        scheduler.add(member)
        return member, ready

    try:
        member, d = scheduler.call(join, config.timeout)
    except NotTaken:
        raise DecodeTimeout(
            f"agentspec: timed out after {config.timeout:g} s waiting for the model: another call holds it"
        ) from None
    call, ended = member.call, False  # ended: finished, or closed by the caller (not failed)
    release_pool()  # a pool this thread's own work made: from here it only waits (agentspec.threads)

    def leave() -> None:  # in the engine's thread, between passes
        scheduler.remove(member)
        _leave(pair, cache, call, d, key, namespace, ended)

    try:
        yield from member.steps()
        ended = True
    except (GeneratorExit, DecodeTimeout):  # the state is whole between passes: saved as verified
        ended = True
        raise
    finally:
        member.closed = True
        scheduler.call(leave)
        if left is not None:
            left.append(call.stats)


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
    pair: ModelPair, cache, call: _Call, d, key: str | None, namespace: str | None, ended: bool
) -> None:
    """A call's end, in the engine's thread between passes: its drafter's (``d``, dropped by the call or not)
    health, and its verified state saved."""
    stats = call.stats
    if key is not None and call.passes and stats.drafter is not None:
        pair.tenants.record(namespace, key, stats.draft_failures > 0, call.draft_oom)
    if cache is not None:
        target = call.target
        written = _save(pair, cache, target, d, ended, namespace)
        if call.passes:  # the new positions are the last ones: count those in the prompt
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
