"""One target forward over the new rows of several sequences, each with its own KV state.

The sequences' new tokens are packed into one row of ``T = sum(n_i)`` tokens, with each token's own
position; every linear, norm and MLP runs once over the ``T`` rows (the weights are read once per
pass, whatever the number of sequences). Attention is the one step that mixes rows, and it runs per
sequence: ``PackedPass.update`` (called by each attention layer as a cache's ``update``) appends a
sequence's new keys and values to its own cache layer, and ``attend`` (called by the attention
function ``agentspec_sdpa`` when the pass hands it ``agentspec_pack``) runs scaled dot-product
attention of that sequence's queries over its own keys, with the mask a solo pass would build.

Batch invariance: attention per sequence is exactly a solo pass's (same kernel, same shapes). The
linears are row-wise, but their kernels may pick another summation order for another row count
(``agentspec.linears.PassLinears`` below 65 rows, the BLAS kernel's blocking above): a sequence's logits in
a packed pass can differ from its solo pass's in the last bits, as a verify pass's differ from a
one-token step's. The lossless tests compare tokens and report the logit margin where they differ.

Why not transformers' ``continuous_batching`` (``PagedAttentionCache``): it has no per-request
roll-back (a rejected draft must leave the cache), and its CPU path (``sdpa_paged``) gathers every
sequence's whole cache through an index on every layer of every pass, a copy of the KV per pass.
Here a sequence's keys are read where they are; a state keeps its own layout (``agentspec.kv``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.attention import grouped_sdpa_forward, invariant_rows
from agentspec.forward import side_by_side
from agentspec.kv import ModelState, PassIds, common_prefix_len, longest_holder, to_device
from agentspec.steps import Job, Steps, advance


def packable(state: ModelState) -> bool:
    """A state whose forward runs packed passes (``Forward.packs``) and whose cache keeps plain keys
    and values per layer (``ModelState.reusable``): the packed pass can feed it."""
    return state.model_forward.packs and (not state.cache.layers or state.reusable)


class PackedPass:
    """The cache and attention of one packed pass (see the module docstring); ``forward`` runs it."""

    def __init__(
        self,
        states: Sequence[ModelState],
        held: Sequence[int],
        lengths: Sequence[int],
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.states = states
        each = [torch.arange(h, h + n, device=device) for h, n in zip(held, lengths)]
        self.positions = torch.cat(each)[None]  # each row's position in its own sequence [1, T]
        self.spans: list[tuple[int, int]] = []
        at = 0
        for n in lengths:
            self.spans.append((at, at + n))
            at += n
        # each sequence's mask, the same in every layer: built once a pass, as a solo pass builds its own
        self.masks = [causal_mask(h, n, device, dtype) for h, n in zip(held, lengths)]
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # this layer's per-sequence K, V

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **_: object):
        """Append each sequence's rows of ``key``/``value`` [1, Hkv, T, D] to its own cache layer."""
        self._kv = [
            state.cache.update(key[:, :, a:b], value[:, :, a:b], layer_idx)
            for state, (a, b) in zip(self.states, self.spans)
        ]
        return key, value

    def attend(self, module, query: torch.Tensor, dropout: float, scaling: float | None, **kwargs):
        """Each sequence's queries over its own keys: [1, T, Hq, D], as an attention function returns."""
        outs = []
        for (a, b), (k, v), mask in zip(self.spans, self._kv, self.masks):
            outs.append(self._one(module, query[:, :, a:b], k, v, mask, dropout, scaling, **kwargs))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], None

    @staticmethod
    def _one(module, q, k, v, mask, dropout, scaling, **kwargs) -> torch.Tensor:
        """One sequence's attention as its solo pass attends (``agentspec_sdpa``): a one-row step, no
        mask, takes the same path too (folded in bfloat16 on a CPU), so its bits are the solo step's."""
        return grouped_sdpa_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)[0]


def causal_mask(held: int, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask of ``n`` rows after ``held`` cached ones, as ``agentspec_sdpa`` is to attend them: what
    transformers' ``sdpa_mask`` builds for a solo pass. None for one row (it sees every key) and for a
    prompt from empty (SDPA's own causal flag, at half a mask's cost in bfloat16: 1,000 rows 8.4
    against 18.4 ms a layer), except within the rows a pass keeps row-invariant
    (``attention.invariant_rows``), which attend row by row over the mask."""
    limit = invariant_rows(device, dtype)
    if n == 1 or (held == 0 and (limit is None or n > limit)):
        return None
    length = held + n
    rows = torch.arange(held, length, device=device)[:, None]
    return (torch.arange(length, device=device)[None, :] <= rows)[None, None]


@torch.inference_mode()
def forward_packed(
    states: Sequence[ModelState],
    news: Sequence[PassIds],
    keeps: Sequence[int],
    features: tuple[int, ...] = (),
) -> list:
    """One forward of the states' model over every ``news[i]`` after ``states[i]``'s cached ids.

    Returns per state its last ``keeps[i]`` logits rows [keeps[i], V] (0: none), with ``features`` as
    (logits, those features of its new rows side by side [n_i, n x H]); each state then covers its new
    ids as after ``ModelState.forward`` (device ids ``unread``). A failed pass rolls every state back
    to before it.
    """
    forward = states[0].model_forward
    device = forward.model.device
    lengths = [len(n) for n in news]
    held = [len(s.ids) + s.unread for s in states]
    ids = torch.cat([n.tensor(device) for n in news], dim=1)  # [1, T]
    ends = itertools.accumulate(lengths)
    # the kept rows' indices, staged pinned and copied without the host waiting (``kv.to_device``): a
    # blocking copy from pageable memory would stall the stream every packed pass
    rows = to_device([r for e, k in zip(ends, keeps) for r in range(e - k, e)], device)
    pack = PackedPass(states, held, lengths, device, forward.model.dtype)
    try:
        out = forward(ids, rows, pack=pack, features=features)
    except BaseException:
        for state, h in zip(states, held):
            state._roll_back(h)
        raise
    logits = out.logits  # [sum(keeps), V]
    results, at = [], 0
    for state, new, keep, (a, b) in zip(states, news, keeps, pack.spans):
        state.advance(new)
        rows_i = logits[at : at + keep]
        at += keep
        results.append((rows_i, side_by_side(out.features, slice(a, b))) if features else rows_i)
    return results


class DraftState(ModelState):
    """A draft model's ``ModelState``, whose forwards are also drafting steps (``forward_steps``) that a
    round of several calls' drafting runs as one packed pass (``DraftRound``)."""

    def forward_steps(self, new_ids: list[int] | PassIds, keep: int) -> Steps[torch.Tensor]:
        """``forward`` as a drafter's step (``agentspec.steps``): packed with the round's other steps
        of this model where the pass can feed it."""
        new = new_ids if isinstance(new_ids, PassIds) else PassIds(new_ids)
        together = forward_together if packable(self) else None
        alone = functools.partial(self.forward, new, keep)
        return (yield Job(id(self.model_forward), alone, together, (self, new, keep)))

    def take(self, state: ModelState) -> DraftState:
        """This state, now holding what ``state`` (restored from the prefix cache) holds."""
        self.cache, self.ids, self.unread = state.cache, state.ids, state.unread
        return self


class DraftRound:
    """The drafting of several calls, their model steps run together (``agentspec.steps``).

    The scheduler hands a round each call's drafting generator; the round starts them all, then
    runs the jobs they wait on, those of one model as one packed pass (``Job.together``), sends each
    its result and moves them all on, until every one has returned. A drafter so takes one forward
    per draft position for all the calls, in the scheduler's own thread. A packed pass that fails is
    run again job by job, so only a call whose own step fails gets its error. ``steps`` and
    ``passes`` count what it ran (jobs, and the passes that ran them).

    Draft models catch up on a call's prompt in a step, so calls that start together after one system
    prompt would each compute its draft rows: as the scheduler does for the target's, a step copies
    the rows of its new tokens that a draft state of its namespace holds, or that another step
    computes (then after that one, in a second pass: ``_sharing``); ``shared`` counts the rows.
    """

    def __init__(self, share: bool = True):
        self.share = share  # draft models' steps copy the prompt rows another holds or computes
        self.steps = self.passes = self.shared = 0
        self._states: dict[int, ModelState] = {}  # the draft models' states met so far, by id
        self._namespaces: dict[int, str | None] = {}  # id(draft state) -> its call's namespace

    def run(self, plans: Sequence[Steps], namespaces: Sequence[str | None]) -> list:
        """What each of ``plans`` returns, or the exception it raised; ``namespaces[i]``: plan i's
        call's (its steps share prompt rows within it only)."""
        results: list = [None] * len(plans)
        waiting: dict[int, Job] = {}
        for i in range(len(plans)):
            self._move(plans, namespaces, i, None, waiting, results)
        while waiting:
            ran, waiting = waiting, {}
            with torch.inference_mode():  # as a model's forward runs
                self._run_jobs(list(ran.values()))
            for i, job in ran.items():
                self._move(plans, namespaces, i, job, waiting, results)
        return results

    def _move(self, plans, namespaces, i: int, job: Job | None, waiting: dict, results: list) -> None:
        """Plan ``i`` past ``job``: its next job waits in ``waiting``, or its result (or error) is in."""
        try:
            got = advance(plans[i], job)
        except Exception as exc:  # that call's own failure: the others draft on
            results[i] = exc
            return
        if not isinstance(got, Job):
            results[i] = got
            return
        waiting[i] = got
        if got.together is forward_together:  # a draft model's step: its rows may be copied
            state = got.payload[0]
            self._states[id(state)], self._namespaces[id(state)] = state, namespaces[i]

    def _run_jobs(self, jobs: list[Job]) -> None:
        by_key: dict[Any, list[Job]] = {}
        for job in jobs:
            by_key.setdefault(job.key, []).append(job)
        for group in by_key.values():
            self.steps += len(group)
            self.passes += self._sharing(group)

    def _sharing(self, group: list[Job]) -> int:
        """Run ``group`` (``_run``) once its draft-model steps have copied what they can: first the
        prompt rows a state of this round already holds, then, in a second pass after the first,
        those another step computes in it (``_followers``). Returns the passes run."""
        if not self.share:
            return _run(group)
        copying = [job for job in group if _copies(job)]
        for job in copying:
            state, new, keep = job.payload
            donor, end = self._holder(state, new, keep)
            if donor is not None:
                self._take(job, donor, end)
        followers = self._followers(copying)
        if not followers:
            return _run(group)
        passes = _run([job for job in group if id(job) not in followers])
        for job in copying:
            if id(job) in followers:
                leader, end = followers[id(job)]
                if leader.error is None:
                    self._take(job, leader.payload[0], end)
        return passes + _run([job for job in copying if id(job) in followers])

    def _holder(self, state: ModelState, new: PassIds, keep: int) -> tuple[ModelState | None, int]:
        """The state of this round (of ``state``'s model and namespace) that holds the longest run of
        ``new``'s rows, and the position it holds them to (at most all but the rows read)."""
        at, space = len(state.ids), self._namespaces[id(state)]
        others = [
            other
            for other in self._states.values()
            if other is not state and self._namespaces[id(other)] == space and other.model is state.model
        ]
        held, end = longest_holder(others, state.ids + new.host, at)
        end = min(end, at + len(new) - max(keep, 1))  # the rows it reads logits of are its own
        return (others[held], end) if held is not None and end > at else (None, at)

    def _followers(self, jobs: list[Job]) -> dict[int, tuple[Job, int]]:
        """Of ``jobs``, those whose new rows, at least half of them, another of their namespace computes
        from the same position: by id(job), (that job, the position it copies to)."""
        computing: list[tuple[Job, list[int]]] = []
        followers: dict[int, tuple[Job, int]] = {}
        for job in jobs:
            state, new, keep = job.payload
            at, ids = len(state.ids), state.ids + new.host
            space = self._namespaces[id(state)]
            lead = next(
                (
                    (other, min(common_prefix_len(ids, theirs, at), len(ids) - max(keep, 1)))
                    for other, theirs in computing
                    if self._namespaces[id(other.payload[0])] == space and other.payload[0].ids == state.ids
                ),
                None,
            )
            if lead is not None and 2 * (lead[1] - at) >= len(new):
                followers[id(job)] = lead
            else:
                computing.append((job, ids))
        return followers

    def _take(self, job: Job, donor: ModelState, end: int) -> None:
        """``job``'s state copies ``donor``'s rows up to ``end``; the job then feeds only the rest."""
        state, new, keep = job.payload
        try:
            taken = state.take_rows(donor, end)
        except Exception:  # it computes them instead: a copy only saves work
            taken = 0
        if taken:
            self.shared += taken
            rest = PassIds(new.host[taken:])
            job.payload, job.alone = (state, rest, keep), functools.partial(state.forward, rest, keep)


def _copies(job: Job) -> bool:
    """A draft model's packed step of host ids (its catch-up on a prompt): one that may copy rows."""
    if job.together is not forward_together:
        return False
    state, new, _ = job.payload
    return new.device is None and not state.unread and len(new) > 1


def one_product(
    parts: Sequence[torch.Tensor | None], product: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor | None]:
    """``product`` of each part's rows [n_i, H] (None: none), computed once over all of them (its
    weights read once, as a packed pass's LM head) and split back per part."""
    rows = [part for part in parts if part is not None]
    if not rows:
        return [None] * len(parts)
    out = iter(product(torch.cat(rows)).split([len(part) for part in rows]))
    return [next(out) if part is not None else None for part in parts]


def forward_together(jobs: list[Job]) -> list:
    """Several states' ``ModelState.forward_steps`` jobs of one model as one packed pass."""
    states, news, keeps = zip(*(job.payload for job in jobs))
    return forward_packed(states, news, keeps)


def _run(group: list[Job]) -> int:
    """Each job's result (or error): one pass together, or, alone or when that fails, one by one;
    returns the passes run."""
    outs = None
    if len(group) > 1 and group[0].together is not None:
        try:
            outs = group[0].together(group)
        except Exception:  # one step's rows may be at fault: each is run alone below
            outs = None
    for i, job in enumerate(group):
        if outs is not None:
            job.out = outs[i]
        else:
            try:
                job.out = job.alone()
            except Exception as exc:
                job.error = exc
    return 1 if outs is not None else len(group)


@dataclass
class Verdict:
    """What one call reads after a pass: ``values``, integers (its accepted count, the next token,
    ...), and ``scores``, floats ([rows, columns]: the log-probabilities it was asked for), or None."""

    values: torch.Tensor
    scores: torch.Tensor | None = None


@dataclass
class Read:
    """A ``Verdict`` on the host."""

    values: list[int]
    scores: list[list[float]] | None = None


def read_verdicts(verdicts: list[Verdict]) -> list[Read]:
    """Several calls' verdicts on the host: their values in one read (on a GPU, the one per pass that
    waits for the device), and their scores, where any call asked for some, in one more."""
    values = read_flat([v.values for v in verdicts])
    scored = [v.scores for v in verdicts if v.scores is not None]
    flat = iter(read_flat([s.reshape(-1) for s in scored]) if scored else ())
    reads = []
    for v, ints in zip(verdicts, values):
        rows = None
        if v.scores is not None:
            cells = next(flat)
            width = v.scores.shape[1]  # shapes are host metadata: no read
            rows = [cells[i : i + width] for i in range(0, len(cells), width)]
        reads.append(Read(ints, rows))
    return reads


def read_flat(tensors: list[torch.Tensor]) -> list[list]:
    """One-dimensional tensors of one dtype (and device) on the host, in one read."""
    if len(tensors) == 1:
        return [tensors[0].tolist()]
    flat = torch.cat(tensors).tolist()
    out, at = [], 0
    for t in tensors:  # a tensor's length is host metadata: no read
        out.append(flat[at : at + t.shape[0]])
        at += t.shape[0]
    return out
