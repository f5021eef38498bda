"""The decoding loop: prefill, draft, verify in one target pass, accept, roll back. One generator.

Every entry point (``generate``, ``stream``, the LangChain chat model, the benchmarks) consumes
``decode``. Cache invariant, asserted by ``ModelState``: after every step the target's cache holds
exactly the verified sequence minus its last token, which is fed (with the next draft) on the next
pass; the draft model's cache is synced to the same verified tokens before it proposes.

A k-token draft costs one target pass over k+1 tokens: the pending token and the k draft tokens.
Row i of that pass's logits scores draft token i; row k gives the bonus token.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from agentspec.config import GenerationConfig
from agentspec.drafters import Draft, Drafter, ModelDrafter
from agentspec.grammar import Constraint, Grammar, apply_mask
from agentspec.kv import ModelState
from agentspec.memory import cache_oom_frees_cache, forward_retrying, is_oom, release_cached_memory
from agentspec.models import ModelPair
from agentspec.sampling import make_generator, probabilities
from agentspec.stats import DecodeStats
from agentspec.text import TextTracker
from agentspec.verify import greedy_verify, speculative_verify

log = logging.getLogger(__name__)

DEFAULT_DRAFT_CAP = 4  # draft tokens per pass when neither the call nor the drafter sets a cap
DRAFTER_NAMES = ("auto", "model", "model_scheduled", "suffix", "prompt_lookup", "none")


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
    stats: DecodeStats = field(default_factory=DecodeStats, repr=False)  # the call's running stats
    forced: int = 0  # of ``tokens``, those a grammar forced (appended without a model guess)
    target_pass: bool = True  # a target forward ran (False: the grammar alone added these tokens)
    fed: int = 0  # tokens the target's pass was fed (uncached prompt or pending tokens, forced, drafts)
    cached: int = 0  # tokens in the target's KV cache before the pass (restored or verified earlier)
    restored: int = 0  # prompt tokens restored from the prefix cache (first step only, else 0)
    started: float = 0.0  # ``time.perf_counter()`` when the pass began


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (an EOS that ended generation is included)
    text: str  # generated text, cut before a stop string, without EOS
    finish_reason: str
    stats: DecodeStats


def resolve_drafter(pair: ModelPair, drafter: Any, speculative: bool = True) -> Drafter | None:
    """A drafter instance from a name (``DRAFTER_NAMES``) or an instance.

    "auto" (the default) is the hybrid of ``agentspec.drafters.hybrid``: suffix drafts, or the
    confidence-scheduled draft model when the pair has one and it is worth more.
    """
    if not speculative or drafter == "none":
        return None
    if drafter is None:
        drafter = "auto"
    if isinstance(drafter, str) and drafter in DRAFTER_NAMES:
        from agentspec.drafters import build_drafter

        return build_drafter(pair, drafter)
    if isinstance(drafter, Drafter):
        return drafter
    raise ValueError(f"drafter: expected one of {DRAFTER_NAMES} or a Drafter, got {drafter!r}")


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
    if len(ids) >= pair.max_context:
        raise ValueError(
            f"prompt_ids: the prompt has {len(ids)} tokens but the model's context is "
            f"{pair.max_context}; shorten the prompt"
        )
    return ids


def check_draft(draft: Draft, k: int, vocab: int) -> Draft:
    """Validate a drafter's proposal; a ValueError here counts as a drafter failure."""
    tokens = [int(t) for t in draft.tokens[:k]]
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft token ids outside [0, {vocab}): {bad[:5]}")
    q = draft.q
    if q is not None:
        q = q[: len(tokens)]
        if tuple(q.shape) != (len(tokens), vocab):
            raise ValueError(f"draft q has shape {tuple(q.shape)}, expected {(len(tokens), vocab)}")
        if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
            raise ValueError("draft q has negative or non-finite probabilities")
    return Draft(tokens, q, getattr(draft, "source", None))


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


@functools.cache
def _takes_constraint(kind: type) -> bool:
    """Whether a drafter class's ``propose`` accepts ``constraint=`` (it then masks its own draft)."""
    try:
        return "constraint" in inspect.signature(kind.propose).parameters
    except (TypeError, ValueError):
        return False


def _propose(drafter: Drafter, seq, k, config, gen, constraint: Constraint | None) -> Draft:
    if constraint is not None and _takes_constraint(type(drafter)):
        return drafter.propose(seq, k, config, gen, constraint=constraint)
    return drafter.propose(seq, k, config, gen)


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


def decode(
    pair: ModelPair,
    prompt_ids: list[int],
    config: GenerationConfig,
    drafter: Drafter | None = None,
    target: ModelState | None = None,
    grammar: Grammar | Constraint | None = None,
    free_memory: Callable[[], None] | None = None,
) -> Iterator[Step]:
    """Generate after ``prompt_ids``, yielding one Step per target pass, the last with a finish reason.

    ``target`` may carry a KV state restored from the prefix cache: only the ids it does not cover
    are prefilled. On return (or on close) it covers exactly the verified sequence minus its last
    token, ready to be saved.

    ``grammar`` (a ``Grammar``, or a fresh ``Constraint`` for one) constrains the output: the
    target's logits at every verified position are masked to the tokens the grammar allows, so the
    output is drawn from the target's distribution restricted to the grammar, exactly as plain
    constrained decoding would draw it. With ``config.jump_forward``, a token that the grammar
    alone allows is appended without a model guess (it is fed with the next pass), and text the
    grammar forces is proposed as draft tokens.
    """
    start = time.perf_counter()
    seq = check_prompt(pair, prompt_ids)
    target = target if target is not None else ModelState(pair.target)
    stats = DecodeStats(drafter=drafter.name if drafter else None, prompt_tokens=len(seq))
    eos = set(config.eos_token_ids) if config.eos_token_ids is not None else pair.eos_token_ids
    text = TextTracker(pair.tokenizer, config.stop, eos)
    gen = None if config.greedy else make_generator(config.seed, pair.device)
    constraint = (
        grammar if isinstance(grammar, Constraint) or grammar is None else Constraint.for_pair(pair, grammar)
    )
    jump = constraint is not None and config.jump_forward
    draft_cap = config.num_draft_tokens
    if draft_cap is None:
        draft_cap = getattr(drafter, "draft_cap", DEFAULT_DRAFT_CAP)

    pending = target.sync(seq[:-1]) + seq[-1:]
    stats.cached_tokens = len(seq) - len(pending)
    stats.prefill_tokens = len(pending)
    budget = min(config.max_new_tokens, pair.max_context - len(seq))
    vocab = pair.target.config.vocab_size
    out: list[int] = []
    first_pass = True
    while True:
        t0 = time.perf_counter()
        room = min(budget - len(out), pair.max_context - len(seq))  # tokens this pass may add
        forced = constraint.take_forced(room) if jump else []  # certain: no model guess needed
        # read before any draft is pushed: a drafter may draft up to the grammar's stop token on the path
        finished = constraint is not None and constraint.terminated
        k = room - len(forced) - 1  # never draft past the token budget or the context window
        tokens = constraint.push_jump_forward(min(JUMP_FORWARD_LIMIT, k)) if jump else []
        n_jump = len(tokens)
        k_draft = min(draft_cap, k - n_jump)
        q, source = None, None
        if drafter is not None and k_draft > 0 and not finished:
            try:
                draft = _propose(drafter, seq + forced + tokens, k_draft, config, gen, constraint)
                draft = check_draft(draft, k_draft, vocab)
            except Exception as exc:  # the target alone gives the same output: carry on without
                drafter = _drop(drafter, exc, stats)
                draft = Draft([])
            source = draft.source
            if draft.q is not None:
                jumped = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), vocab)
                q = torch.cat([jumped.to(draft.q), draft.q]) if tokens else draft.q
            tokens += draft.tokens
        if constraint is not None:
            tokens = tokens[: _fit_to_grammar(constraint, tokens, n_jump, q is not None)]
        n_draft = len(tokens)
        if n_draft == n_jump:  # no drafter guess survived: only grammar-forced tokens, or nothing
            source = "jump_forward" if n_jump else None

        if forced and (len(forced) == room or finished):
            n, token, verified = 0, None, False  # the grammar alone finishes this call: no pass
            at, fed = len(target.ids), 0
        else:
            tap = getattr(drafter, "uses_target_hidden", False)  # an EAGLE head drafts from them
            at = len(target.ids)  # position of the pass's first token
            fed = len(pending) + len(forced) + n_draft
            logits = forward_retrying(target, pending + forced + tokens, n_draft + 1, free_memory, tap)
            logits, hidden = logits if tap else (logits, None)  # [k+1, V]; [pass tokens, H]
            if constraint is not None:
                logits = apply_mask(logits, constraint.masks(n_draft + 1))
            d = torch.tensor(tokens, dtype=torch.long, device=logits.device)
            if config.greedy:
                n, token = greedy_verify(d, logits)
            else:
                p = probabilities(logits, config.temperature, config.top_k, config.top_p)
                n, token = speculative_verify(d, p, q[:n_draft] if q is not None else None, gen)
            assert 0 <= token < vocab, f"{token=} {vocab=}"
            target.truncate(len(seq) + len(forced) + n)  # roll back the rejected draft tokens
            if hidden is not None:  # the verified positions' features
                try:
                    drafter.observe_hidden(at, hidden[: len(target.ids) - at])
                except Exception as exc:
                    drafter = _drop(drafter, exc, stats)
            stats.observe_step(n_draft, n, source)
            stats.jump_forward_tokens += n_jump
            stats.jump_forward_accepted += min(n, n_jump)
            verified = True
            if constraint is not None:
                constraint.commit(n)
                if not constraint.terminated and not constraint.push(token):
                    raise RuntimeError(f"the grammar rejected token {token} drawn under its own mask")
                constraint.commit(len(constraint.path))

        new = forced + tokens[:n] + ([token] if verified else [])
        new, reason, cut = _finish(new, len(out), budget, eos, text, out)
        if reason is None and constraint is not None and constraint.terminated:
            reason = "stop"  # the grammar is complete (it accepted a stop token)
        stats.forced_tokens += min(len(forced), len(new))
        out += new
        seq += new
        if drafter is not None and verified:
            try:
                drafter.feedback(seq, n, n_draft)
            except Exception as exc:
                drafter = _drop(drafter, exc, stats)
        now = time.perf_counter()
        if len(out) == len(new):
            stats.time_to_first_token_s = now - start
        stats.output_tokens = len(out)
        if reason is not None:
            target.truncate(min(len(target.ids), len(seq) - 1))
            stats.finish_reason = reason
            stats.total_time_s = now - start
        delta = text.release(out, final=reason is not None, cut=cut)
        prefill = len(pending) - 1 if verified else 0
        restored, first_pass = (stats.cached_tokens if first_pass else 0), False
        yield Step(
            new,
            delta,
            n_draft,
            n,
            prefill,
            now - t0,
            reason,
            stats,
            forced=min(len(forced), len(new)),
            target_pass=verified,
            fed=fed,
            cached=at,
            restored=restored,
            started=t0,
        )
        if reason is not None:
            return
        pending = seq[len(target.ids) :]


def _config(options: dict) -> GenerationConfig:
    config = options.pop("config", None)
    if config is not None and options:
        raise TypeError(f"pass either config= or options, not both: {sorted(options)}")
    return config if config is not None else GenerationConfig(**options)


def stream(
    pair: ModelPair,
    prompt_ids: Any,
    drafter: Any = None,
    prefix_cache: Any = True,
    grammar: Grammar | Constraint | None = None,
    **options: Any,
) -> Iterator[Step]:
    """Yield Steps as tokens are verified. Options are GenerationConfig fields (or ``config=``).

    ``grammar`` (an ``agentspec.grammar.Grammar`` or ``Constraint``) constrains the output; see ``decode``.

    ``prefix_cache``: True uses the pair's cache (restore the longest cached prefix, save the
    verified state afterwards), False decodes from scratch (the no-reuse baseline, same loop), or
    pass a ``PrefixCache``. The pair's lock is held while the generator runs; closing the generator
    early releases it and still saves what was verified.
    """
    config = _config(options)
    drafter = "auto" if drafter is None else drafter
    d = resolve_drafter(pair, drafter, config.speculative)
    cache = _pick_cache(pair, prefix_cache)
    # drafters named by string are built afresh per call, so their failures are counted per pair and
    # name (a cool-down, agentspec.drafters.health); a Drafter instance passed in is the caller's own
    health = pair.draft_health
    key = drafter if isinstance(drafter, str) else None
    with pair.lock:
        ids = check_prompt(pair, prompt_ids)
        resting = None  # a drafter sitting out its cool-down (it kept failing): the target alone
        if d is not None and key is not None and not health.allow(key):
            resting, d = key, None
        if d is not None:
            try:
                d.reset()
            except Exception as exc:
                log.warning("drafter %s failed to reset (%r); decoding without it", d.name, exc)
                if key is not None:
                    health.record(key, failed=True)
                d = None
        models = {"target": pair.target}
        cached_draft = isinstance(d, ModelDrafter) and d.caches_state  # (an EAGLE head's is not)
        if cached_draft:
            models["draft"] = d.state.model
        states = {}
        if cache is not None:
            with cache_oom_frees_cache(cache, "restoring from"):  # then prefill in full
                states = cache.restore(pair, ids, models)
        target = states.get("target") or ModelState(pair.target)
        if cached_draft and "draft" in states:
            d.state = states["draft"]
        ended = False  # finished, or closed by the caller: not failed
        stats = None
        try:
            free = cache.clear if cache is not None else None
            for step in decode(pair, ids, config, d, target=target, grammar=grammar, free_memory=free):
                if stats is None:  # one DecodeStats per call, shared by its steps
                    stats = step.stats
                    stats.draft_cooldown = resting
                yield step
            ended = True
        except GeneratorExit:
            ended = True
            raise
        finally:
            if d is not None and key is not None and stats is not None:
                health.record(key, failed=stats.draft_failures > 0)
            if ended and cache is not None and cached_draft:
                try:  # the draft then covers the same verified tokens (also when closed early)
                    d.catch_up(target.ids)
                except Exception as exc:  # a broken draft: the cache keeps the part it covered
                    log.warning("draft catch-up failed (%r); the cache keeps the draft's shorter part", exc)
            if cache is not None:
                saved = {"target": target}
                if cached_draft:
                    saved["draft"] = d.state
                with cache_oom_frees_cache(cache, "saving to"):  # it costs the cache, not the reply
                    cache.save(pair, saved)


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
    for last in stream(pair, prompt_ids, drafter, prefix_cache, grammar, **options):
        ids += last.tokens
        parts.append(last.text)
    assert last is not None and last.finish_reason is not None
    return GenerationResult(ids, "".join(parts), last.finish_reason, last.stats)
