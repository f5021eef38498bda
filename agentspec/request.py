"""A request: one call's whole state as data, and what a pass does with it.

``Request`` is the one record of a call in its pair's engine (``agentspec.scheduler``): the prompt
and output, the budget, sampling and its key, the grammar constraint, the text release, the stats,
the deadline, the namespace, the drafter, and the outbox its caller reads Steps from. ``decode``
makes one when a call joins; the engine's passes take it through the functions here:

- ``plan``: the request's share of the next pass (a prompt chunk, or its draft and what the target
  is fed), in steps its drafter's model forwards run in (``agentspec.steps``);
- ``trim``: verify a prefix of the draft only;
- ``judge``: the verdict on the pass's logits, on the device;
- ``land``: accept, roll back, finish: the Step the pass adds, put in the outbox;
- ``fail``: roll back to before the pass and hand the caller the error.

A k-token draft costs one target pass over k+1 tokens: the pending token and the k draft tokens.
Row i of that pass's logits scores draft token i; row k gives the bonus token.

Cache invariant, asserted by ``ModelState``: after every step the target's cache holds exactly the
verified sequence minus its last token, which is fed (with the next draft) on the next pass; the
draft model's cache is synced to the same verified tokens before it proposes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from agentspec import logprobs as lp
from agentspec.config import GenerationConfig
from agentspec.drafters import Draft, Drafter
from agentspec.drafters.schedule import survival
from agentspec.grammar import Constraint, apply_bitmask
from agentspec.kv import ModelState, PassIds, to_device
from agentspec.memory import is_oom, release_cached_memory
from agentspec.packed import Read, Verdict, read_flat
from agentspec.sampling import keyed_scores, probabilities
from agentspec.stats import DecodeStats
from agentspec.steps import Steps
from agentspec.text import TextTracker
from agentspec.verify import greedy_accept, speculative_accept

log = logging.getLogger(__name__)

LOOKAHEAD = 4  # Steps a request may run ahead of its caller before it sits out passes
CONFIDENCE_SCALE = 1 << 20  # a draft's confidences are read as integers, in these steps of [0, 1]


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


_CANCELLED = object()  # the end of a cancelled request's Steps (``Request.ready``)


@dataclass(eq=False)  # one request is one object: the engine finds it by identity
class Request:
    """One call's whole state, read and advanced by each pass of its pair's engine."""

    config: GenerationConfig
    target: ModelState  # covers the verified sequence minus the tokens still to feed
    drafter: Drafter | None  # None: no drafter, or it failed and was dropped for the rest of the call
    constraint: Constraint | None
    free_memory: Callable[[], None] | None  # frees memory before a target pass is retried
    seq: list[int]  # the verified sequence: prompt + output so far
    stats: DecodeStats  # the call's, live: each Step carries a snapshot
    eos: set[int]
    text: TextTracker
    gen: torch.Generator | None  # None: greedy
    draft_cap: int  # the most drafter tokens per pass
    budget: int  # the most output tokens (max_new_tokens, within the context window)
    start: float  # ``time.perf_counter()`` when the call began: the one clock of its times
    deadline: float | None  # ``time.perf_counter()`` past which no further pass starts (None: no limit)
    vocab: int  # the target's vocabulary size
    device: torch.device  # where the target's passes run
    invariant_rows: int | None  # the pair's ``invariant_rows`` (``_invariant_cap``)
    namespace: str | None = None  # its tenant: calls share prompt rows within one only
    cancelled: threading.Event | None = None  # set: it takes no further pass (its consumer left)
    key: int | None = None  # a reproducible sampled call's seed: its draws are keyed by it and the position
    draft_config: GenerationConfig | None = None  # what the drafter is told (greedy for a keyed call)
    out: list[int] = field(default_factory=list)  # the output so far
    passes: int = 0  # steps yielded so far
    draft_oom: bool = False  # the drafter was dropped out of memory: a failure of the pair's, not the call's
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # Steps, then a last one or an error
    delivered: int = 0  # items put in the outbox
    taken: int = 0  # items the caller took
    closed: bool = False  # the caller left: it takes no further pass
    rollback: int = 0  # the target's length before the pass under way (where a failed pass returns)
    hidden: torch.Tensor | None = None  # the pass's hidden rows, from ``judge`` to ``land``

    @property
    def jump(self) -> bool:
        return self.constraint is not None and self.config.jump_forward

    @property
    def cached(self) -> int:
        """Positions the target's state holds for it (what its rows attend to)."""
        return len(self.target.ids)

    @property
    def priority(self) -> int:
        """Its ``GenerationConfig.priority``: lower goes first where the engine chooses."""
        return self.config.priority

    @property
    def prefilling(self) -> bool:
        """Part of its prompt is still to be fed before its last token (a chunk per pass)."""
        return len(self.target.ids) < len(self.seq) - 1

    def ready(self) -> bool:
        """It takes part in the next pass (its caller kept up and has not left). A cancelled request
        takes none: the first time it is asked after the cancel, its Steps end (``_CANCELLED``),
        waking a caller waiting for the next."""
        if self.cancelled is not None and self.cancelled.is_set():
            if not self.closed:
                self.closed = True
                _put(self, _CANCELLED)
            return False
        return not self.closed and self.delivered - self.taken < LOOKAHEAD

    def wanted(self) -> list[int]:
        """While it prefills: the prompt ids its target is to hold before its first full pass, which
        it may copy from another request's state instead of computing them (else [])."""
        if not self.prefilling:
            return []
        # a head recomputes its last context rows for their features, as after a restore
        d = self.drafter
        return self.seq[: len(self.seq) - 1 - (d.context_rows if d is not None else 0)]

    def drop(self, exc: Exception) -> None:
        """Drop its drafter for the rest of the call, after a failure (the target alone goes on)."""
        self.draft_oom = is_oom(exc)
        self.drafter = _drop(self.drafter, exc, self.stats)


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
    confidence = draft.confidence
    if confidence is not None:
        confidence = confidence[: len(tokens)]
        if tuple(confidence.shape) != (len(tokens),) or not confidence.is_floating_point():
            shape = list(confidence.shape)
            raise ValueError(
                f"draft confidence: expected a [{len(tokens)}] float tensor, got {confidence.dtype} {shape}"
            )
    return Draft(tokens, q, draft.source, est, confidence)


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


def _propose(req: Request, seq: list[int], k: int) -> Steps[Draft]:
    """The drafter's checked proposal after ``seq``; a failure drops the drafter (an empty draft)."""
    d = req.drafter
    c = req.constraint if d.masks_own_draft else None
    try:
        draft = yield from d.propose_steps(seq, k, req.draft_config, req.gen, constraint=c)
        return check_draft(draft, k, req.vocab)
    except Exception as exc:  # the target alone gives the same output: carry on without
        req.drop(exc)
        return Draft([])


def _draft(
    req: Request, forced: list[int], k: int, finished: bool, cap: int | None = None
) -> Steps[tuple[Draft, int]]:
    """The pass's draft after ``forced``: the text the grammar forces, then the drafter's guess, fit
    to the grammar; and how many of its tokens lead as the grammar's jump-forward. The draft's tokens
    are host ids, or a [k] tensor still on the device; its ``survival`` and ``confidence`` are the
    drafter's where no grammar shaped the draft (else None); its source None where it has no token."""
    c = req.constraint
    tokens = c.push_jump_forward(min(JUMP_FORWARD_LIMIT, k)) if req.jump else []
    n_jump = len(tokens)
    k_draft = min(req.draft_cap if cap is None else min(cap, req.draft_cap), k - n_jump)
    out = Draft(tokens)
    if req.drafter is not None and k_draft > 0 and not finished:
        seq = req.seq + forced + tokens if forced or tokens else req.seq  # no copy per pass if none
        draft = yield from _propose(req, seq, k_draft)
        out.source = draft.source
        if c is None:  # no grammar: no jump-forward either, the drafter's draft as it gave it
            out.tokens, out.q, out.survival, out.confidence = (
                draft.tokens,
                draft.q,
                draft.survival,
                draft.confidence,
            )
        else:  # the grammar fits a draft on the host
            drafted = draft.tokens.tolist() if isinstance(draft.tokens, torch.Tensor) else draft.tokens
            if draft.q is not None:  # jump-forward tokens are certain proposals: one-hot q
                jumped = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), req.vocab)
                out.q = torch.cat([jumped.to(draft.q), draft.q]) if tokens else draft.q
            out.tokens = tokens + drafted
    if c is not None:
        out.tokens = out.tokens[: _fit_to_grammar(c, out.tokens, n_jump, out.q is not None)]
    if len(out.tokens) == n_jump:  # no drafter guess survived: only grammar-forced tokens, or nothing
        out.source = "jump_forward" if n_jump else None
    return out, n_jump


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
class Share:
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
    confidence: torch.Tensor | None = None  # ``Draft.confidence``: read with the verdict, for the drafter

    @property
    def keep(self) -> int:
        """The logits rows the call reads: one per draft token, and the bonus row (none for a
        chunk); scored, the forced tokens' rows before them (a pass the grammar alone finishes
        keeps only those)."""
        if self.chunk:
            return 0
        forced = len(self.forced) if self.scored else 0
        return forced + (len(self.tokens) + 1 if self.verified else 0)

    def trim(self, n: int) -> None:
        """Verify only the draft's first ``n`` tokens (a shorter deterministic draft is just another
        draft: the output is the same)."""
        self.tokens = self.tokens[:n]
        self.acceptance = self.acceptance[:n]
        self.confidence = self.confidence[:n] if self.confidence is not None else None
        self.feed = PassIds(self.feed.host, self.feed.device[:n])


def survivals(shares: list[Share]) -> list[list[float] | None]:
    """Each share's S_1 >= S_2 >= ...: the chance that its draft's first i tokens all survive (None:
    no estimates). Read only by a scheduler sharing the pass; the heads' estimates on the device
    (``Draft.survival`` as a tensor) reach the host in one read for the whole pass."""
    tensors = [s.acceptance.float() for s in shares if isinstance(s.acceptance, torch.Tensor)]
    read = iter(read_flat(tensors) if tensors else ())
    out = []
    for s in shares:
        a = s.acceptance
        out.append(None if a is None else survival(next(read) if isinstance(a, torch.Tensor) else a))
    return out


def _chunk(req: Request, size: int) -> Share | None:
    """The next ``size`` tokens of the prompt's uncached part, when more than ``size`` are left
    before its last token (fed with the first full pass); else None."""
    at = len(req.target.ids)
    if len(req.seq) - 1 - at <= size:
        return None
    feed = PassIds(req.seq[at : at + size])
    return Share(time.perf_counter(), at, [], [], [], 0, None, False, feed=feed, chunk=True)


def _plan(req: Request, cap: int | None = None) -> Steps[Share]:
    """Draft (at most ``cap`` drafter tokens, None: the call's own cap), and what the target is to
    be fed: a call's share of its next pass. ``cap`` binds greedy calls only: a sampled call's draws
    depend on its draft lengths, and a seeded one draws the same whatever runs beside it."""
    t0 = time.perf_counter()
    seq, target, c = req.seq, req.target, req.constraint
    at = len(target.ids)
    pending = seq[at:]
    room = req.budget - len(req.out)  # tokens this pass may add (the budget is within the context)
    forced = c.take_forced(room) if req.jump else []
    # read before any draft is pushed: a drafter may draft up to the grammar's stop token on the path
    finished = c is not None and c.terminated
    # never draft past the token budget or the context window
    cap = cap if req.config.greedy or req.key is not None else None
    cap = _invariant_cap(req, len(pending) + len(forced), cap)
    draft, n_jump = yield from _draft(req, forced, room - len(forced) - 1, finished, cap)
    tokens, q = draft.tokens, draft.q
    verified = not (forced and (len(forced) == room or finished))  # else the grammar alone finishes
    scored = req.config.logprobs is not None
    p = Share(t0, at, pending, forced, tokens, n_jump, draft.source, verified, scored=scored)
    if not verified and p.scored:  # the forced tokens' rows come from a pass that feeds them
        p.feed = PassIds(pending + forced[:-1])
    if verified:
        on_device = isinstance(tokens, torch.Tensor)
        d = tokens if on_device else to_device(tokens, req.device)  # [k]
        sampled = not req.config.greedy and req.key is None  # verified by rejection sampling
        q = q[: len(tokens)] if q is not None and sampled else None
        d, p.q, p.bad = _guard(d, q, req.vocab, on_device)
        p.feed = PassIds(pending + forced, d)
        p.tap = req.drafter.feature_layers if req.drafter is not None else ()
        if draft.survival is not None and len(tokens) and not sampled:
            p.acceptance = draft.survival
        p.confidence = draft.confidence if len(tokens) else None
    return p


def _invariant_cap(req: Request, fed: int, cap: int | None) -> int | None:
    """``cap``, lowered so that a pass feeding ``fed`` tokens before its draft keeps every row as a
    one-row step computes it, where the pair's passes are row-invariant only up to some rows
    (``attention.invariant_rows``: bfloat16 on a CPU). Past that, a pass's rows depend on its row
    count, so drafts riding a prompt's pass would change the prompt's cache from plain decoding's:
    the prompt goes alone (as plain decoding feeds it) and drafting starts at the next pass."""
    limit = req.invariant_rows if fed > 1 else None
    if limit is None:
        return cap
    room = max(0, limit - fed - 1) if fed < limit else 0
    return room if cap is None else min(cap, room)


def _judge(req: Request, p: Share, out) -> tuple[Verdict, torch.Tensor | None]:
    """Accept the draft against the pass's logits ``out`` ([keep, V], with the hidden rows when
    tapped), on the device: what the host is to read (``_accept`` takes it), and the hidden rows."""
    try:
        logits, hidden = out if p.tap else (out, None)  # [keep, V]; [pass tokens, H]
        if not p.verified:  # it scores the tokens the grammar forced, which finish the call
            forced = to_device(p.forced, logits.device)
            scores = lp.scores(lp.log_softmax(logits), forced, req.config.logprobs)
            return Verdict(forced[:0], scores), None
        return _verdict(req, p, logits), hidden
    except BaseException:
        req.target.truncate(p.at)  # the pass's positions are not verified: the state stays whole
        raise


def _verdict(req: Request, p: Share, logits: torch.Tensor) -> Verdict:
    """``_judge`` for a verified pass: [n, token, (the draft was bad), (the draft's ids), (its
    confidences, scaled to integers)], and the emitted tokens' scores where asked for."""
    c, config = req.constraint, req.config
    k, d, on_device = len(p.tokens), p.feed.device, isinstance(p.tokens, torch.Tensor)
    raw = lp.log_softmax(logits) if p.scored else None  # before any mask: the raw log-probabilities
    logits = logits[len(p.forced) :] if p.scored else logits  # [k+1, V]
    if c is not None:
        logits = apply_bitmask(logits, c.bitmasks(k + 1))
    if config.greedy:
        result = greedy_accept(d, logits)  # [2]
    else:
        probs = probabilities(logits, config.temperature, config.top_k, config.top_p)
        if req.key is not None:  # each row's draw is keyed by its output position: verified as greedy
            result = greedy_accept(d, keyed_scores(probs, req.key, len(req.out) + len(p.forced)))
        else:
            result = speculative_accept(d, probs, p.q, req.gen)
    parts = [result]
    if p.bad is not None:
        parts.append(p.bad.long().reshape(1).to(result.device))
    if on_device:
        parts.append(d.to(result.device))
    if p.confidence is not None:  # read with the rest as integers: a calibration's bins need no more
        parts.append((p.confidence.float().clamp(0, 1) * CONFIDENCE_SCALE).round().long().to(result.device))
    scores = None
    if raw is not None:
        tokens = lp.emitted(to_device(p.forced, raw.device), d, result)
        scores = lp.scores(raw, tokens, config.logprobs)
    return Verdict(torch.cat(parts), scores)


def _accept(
    req: Request, p: Share, read: list[int], hidden: torch.Tensor | None
) -> tuple[int, int, list[int]]:
    """Take the verdict's values as read (``Verdict.values``): returns (draft tokens accepted, the
    token drawn after them, the accepted draft tokens); the target is rolled back to the verified
    tokens, and the constraint commits them."""
    target, c, k = req.target, req.constraint, len(p.tokens)
    n, token = read[0], read[1]
    flagged = p.bad is not None and bool(read[2])
    at = 2 + (p.bad is not None)  # where the draft's ids begin, if they were read
    on_device = isinstance(p.tokens, torch.Tensor)
    accepted = read[at : at + n] if on_device else p.tokens[:n]
    assert 0 <= token < req.vocab, f"{token=} {req.vocab=}"
    if p.confidence is not None and req.drafter is not None:
        at += k if on_device else 0
        try:
            req.drafter.observe_confidences([v / CONFIDENCE_SCALE for v in read[at : at + k]])
        except Exception as exc:
            req.drop(exc)
    target.settle(accepted)  # roll back the rejected draft tokens
    if hidden is not None:  # the verified positions' features
        try:
            req.drafter.observe_features(p.at, hidden[: len(target.ids) - p.at])
        except Exception as exc:
            req.drop(exc)
    if flagged and req.drafter is not None:  # verified as a model-free draft: the output stands
        req.drop(ValueError("draft ids outside the vocabulary, or a q with negative or non-finite values"))
    if c is not None:
        c.commit(n)
        if not c.terminated and not c.push(token):
            raise RuntimeError(f"the grammar rejected token {token} drawn under its own mask")
        c.commit(len(c.path))
    return n, token, accepted


def _land(req: Request, p: Share, read: Read | None, hidden: torch.Tensor | None = None) -> Step:
    """Accept, roll back, finish: what the pass (``read``: its verdict as read; None when no
    forward ran, the grammar alone) adds to the call's output."""
    seq, target, c, stats = req.seq, req.target, req.constraint, req.stats
    tokens, forced = p.tokens, p.forced
    n, new = 0, list(forced)
    if p.verified:
        n, token, accepted = _accept(req, p, read.values, hidden)
        stats.observe_step(len(tokens), n, p.source)
        stats.jump_forward_tokens += p.n_jump
        stats.jump_forward_accepted += min(n, p.n_jump)
        new += accepted + [token]
    new, reason, cut = _finish(new, len(req.out), req.budget, req.eos, req.text, req.out)
    if reason is None and c is not None and c.terminated:
        reason = "stop"  # the grammar is complete (it accepted a stop token)
    stats.forced_tokens += min(len(forced), len(new))
    req.out += new
    seq += new
    if req.drafter is not None and p.verified:
        try:
            req.drafter.feedback(seq, n, len(tokens))
        except Exception as exc:
            req.drop(exc)
    now = time.perf_counter()
    if len(req.out) == len(new):
        stats.time_to_first_token_s = now - req.start
    stats.output_tokens = len(req.out)
    if reason is not None:
        target.truncate(min(len(target.ids), len(seq) - 1))
        stats.finish_reason = reason
        stats.total_time_s = now - req.start
    req.passes += 1
    scores = read.scores if read is not None else None
    return Step(
        new,
        req.text.release(req.out, final=reason is not None, cut=cut),
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
        restored=stats.cached_tokens if req.passes == 1 else 0,
        started=p.started,
        logprobs=lp.entries(new, scores, req.config.logprobs) if scores is not None else None,
        source=(p.source or stats.drafter) if p.verified and len(tokens) else None,
        acceptance=p.acceptance,
    )


def _late(req: Request) -> DecodeTimeout | None:
    """The timeout of a call whose deadline has passed (None: it has time left, or no deadline)."""
    if req.deadline is None or time.perf_counter() <= req.deadline:
        return None
    n = len(req.out)
    return DecodeTimeout(
        f"agentspec: timed out decoding after {req.config.timeout:g} s, the wait for the model "
        f"included ({n} output {'token' if n == 1 else 'tokens'} verified by then)"
    )


def take_rows(req: Request, donor: Request, end: int) -> int:
    """Copy ``donor``'s target rows up to position ``end`` (a prefix of ``req.wanted()``) instead of
    computing them; returns how many it took."""
    taken = req.target.take_rows(donor.target, end)
    req.stats.cached_tokens += taken
    req.stats.prefill_tokens -= taken
    req.stats.shared_prefix_tokens += taken
    return taken


def plan(req: Request, chunk: int | None, cap: int | None) -> Steps[Share]:
    """Its share of the next pass, planned in steps (its drafter's model forwards) that the engine
    runs with the other requests'; ``chunk``: the most uncached prompt tokens it may feed; ``cap``:
    the most drafter tokens (None: its own cap)."""
    req.rollback = len(req.target.ids)
    p = _chunk(req, chunk) if chunk is not None else None
    return p if p is not None else (yield from _plan(req, cap))


def trim(req: Request, p: Share, n: int) -> None:
    """Verify only the first ``n`` tokens of the pass's draft (its feed shrinks to match)."""
    p.trim(n)
    try:
        req.drafter.trimmed(n)
    except Exception as exc:
        req.drop(exc)


def judge(req: Request, p: Share, out: Any) -> Verdict | None:
    """The pass's verdict from its logits ``out``, on the device: what the host is to read (None:
    nothing; a prompt chunk, or no forward ran)."""
    if p.chunk or p.feed is None:
        return None
    verdict, req.hidden = _judge(req, p, out)
    return verdict


def land(req: Request, p: Share, read: Read | None) -> tuple[Step | None, bool]:
    """Take the verdict's values as read: (the Step the pass adds, put in the outbox; None for a
    prompt chunk), and whether the request leaves the running set (finished, or timed out: its
    caller is told)."""
    if p.chunk:
        return None, False
    hidden, req.hidden = req.hidden, None
    step = _land(req, p, read, hidden)
    _put(req, step)
    if step.finish_reason is not None:
        return step, True
    timeout = _late(req)
    if timeout is not None:
        _put(req, timeout)
    return step, timeout is not None


def fail(req: Request, exc: BaseException) -> None:
    """Roll the target back to before the pass under way, and hand the caller ``exc``."""
    req.target.truncate(req.rollback)  # the verified state, whatever the failed pass fed
    _put(req, exc)


def _put(req: Request, item: Step | BaseException | object) -> None:
    req.delivered += 1
    req.outbox.put(item)


def steps(req: Request, wake: Callable[[], None]) -> Iterator[Step]:
    """The request's Steps as the engine lands them, in its caller's thread; an error it met is
    raised here. ``wake`` tells the engine a Step was taken (a request that sat out may run again)."""
    while True:
        item = req.outbox.get()
        req.taken += 1
        wake()
        if isinstance(item, BaseException):
            raise item
        if item is _CANCELLED:
            return
        yield item
        if item.finish_reason is not None:
            return
