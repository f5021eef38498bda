"""A small draft model of the target's tokenizer, with its own KV cache kept in step.

Before each proposal the draft's cache is synced to the verified sequence (rolled back to the
longest common prefix, then fed what is missing), so after a full accept the last draft token and
the bonus token are fed together in one pass, and a restored prefix is reused as is.

With a ``ConfidenceSchedule`` (``drafter="model_scheduled"``, and inside ``drafter="auto"``) the
draft length is no longer fixed: the schedule may skip the draft model for a step, and stops the
draft at the first position whose calibrated survival no longer pays for its verification. The
confidence of a position is the top probability of the distribution the token is drawn from
(after the grammar mask and, when sampling, temperature/top-k/top-p), read before the token is
drawn: the length of a sampled draft never depends on the token sampled last (see ``schedule``).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.eagle import EagleState, is_eagle
from agentspec.drafters.schedule import ConfidenceSchedule, PassTimer
from agentspec.grammar import Constraint, apply_bitmask
from agentspec.kv import ModelState
from agentspec.sampling import probabilities

CATCH_UP = 32  # the most verified tokens the draft is fed at the end of a call (see ``keep_up``)


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Pad (with -inf) or cut logits [..., V'] to the target's width V.

    Target and draft of one tokenizer can still have different embedding sizes (Qwen2.5-7B pads
    to 152,064 rows, 0.5B to 151,936); ids past the tokenizer never occur in either.
    """
    extra = width - logits.shape[-1]
    if extra > 0:
        return F.pad(logits, (0, extra), value=float("-inf"))
    return logits[..., :width]


class ModelDrafter(Drafter):
    name = "model"
    draft_cap = 4  # fixed length; with a schedule, 16 (the schedule stops drafts earlier)
    masks_own_draft = True

    def __init__(
        self, model, vocab_size: int, schedule: ConfidenceSchedule | None = None, name: str | None = None
    ):
        # an EAGLE head drafts from the target's features: ``decode`` hands them to ``observe_hidden``
        self.uses_target_hidden = is_eagle(model)
        self.state = EagleState(model) if self.uses_target_hidden else ModelState(model)
        self.vocab_size = vocab_size  # the target's logits width
        self.schedule = schedule  # None: always draft k tokens
        if schedule is not None:
            self.draft_cap = 16
        self.timer = PassTimer()  # times verify passes for the schedule's cost model
        if name is not None:
            self.name = name

    def propose(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Draft:
        """Up to ``k`` tokens; with a ``constraint``, drawn under its mask and pushed onto its path."""
        draft = self.draft(seq, k, config, generator, constraint)
        self.timer.proposed()
        return draft

    def draft(self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None) -> Draft:
        """``propose`` without timing the pass (for a drafter that holds this one and times its own)."""
        if k <= 0:
            return Draft([])
        sched = self.schedule
        if sched is not None:
            if sched.calibration is None:
                sched.begin(config.greedy)
            if not sched.start(k):
                return Draft([])
        pending = self.state.sync(seq[:-1]) + seq[-1:]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(k):
            t0 = time.perf_counter()
            rows = self.state.forward(pending, keep=1)
            if not len(rows):  # an EAGLE head without the target's feature here: no draft
                break
            logits = fit_vocab(rows[-1], self.vocab_size)  # [V]
            if sched is not None and len(pending) == 1:
                sched.cost.observe_draft(time.perf_counter() - t0)
            if constraint is not None:
                bitmask = constraint.bitmask()  # packed: the kernel applies it, nothing is unpacked
                if constraint.terminated or not bool(bitmask.any()):
                    break
                logits = apply_bitmask(logits[None], bitmask[None])[0]
            q = (
                None
                if config.greedy
                else probabilities(logits, config.temperature, config.top_k, config.top_p)
            )
            if sched is not None:  # decided before the token is drawn: lossless for sampled drafts
                confidence = torch.softmax(logits.float(), dim=-1).max() if q is None else q.max()
                if not sched.include(float(confidence)):
                    break
            if q is None:
                token = int(logits.argmax().item())
            else:
                token = int(torch.multinomial(q, 1, generator=generator).item())
                qs.append(q)
            if constraint is not None and not constraint.push(token):
                qs = qs[: len(tokens)]
                break
            tokens.append(token)
            pending = [token]
        if sched is not None:
            # a deterministic draft may also be cut after the fact, to its best prefix
            n = sched.trim() if config.greedy else len(tokens)
            sched.keep(min(n, len(tokens)))
            tokens = tokens[:n]
        return Draft(tokens, torch.stack(qs) if qs else None)

    def observe_hidden(self, position: int, hidden: torch.Tensor) -> None:
        self.state.observe(position, hidden)

    def kv_state(self) -> ModelState | None:
        # an EAGLE head's cache was fed this call's target features, which the prefix cache does not keep
        return None if self.uses_target_hidden else self.state

    def adopt_kv_state(self, state: ModelState) -> None:
        self.state = state

    @property
    def idle(self) -> bool:
        """A schedule has benched the draft model (it did not pay): keeping it in step is wasted work."""
        return self.schedule is not None and self.schedule.backing_off

    def catch_up(self, ids: list[int], limit: int = CATCH_UP) -> None:
        """Feed the few verified tokens the draft has not seen, so it covers ``ids`` like the target.

        Called when a call ends, before its state is saved to the prefix cache. A longer gap (the
        draft was reset after a failure, or sat out the call) is left alone: the cache then keeps
        the draft's shorter part, and the draft feeds the rest when it next drafts.
        """
        if self.idle:
            return
        pending = self.state.sync(ids)
        if 0 < len(pending) <= limit:
            self.state.forward(pending, keep=1)

    def keep_up(self, seq: list[int], lag: int = CATCH_UP) -> None:
        """Feed the verified tokens the draft has not seen, once they are more than ``lag``.

        A drafter that often skips the draft model (a schedule, ``drafter="auto"`` while suffix
        drafts win) would otherwise fall far behind the target, and its next draft would first
        feed the whole gap. One batched pass every ``lag`` tokens spreads that work; a benched
        draft (``idle``) is not kept up at all: its next probe feeds the gap.
        """
        if not self.idle and len(seq) - 1 - len(self.state.ids) > lag:
            pending = self.state.sync(seq[:-1])
            if pending:
                self.state.forward(pending, keep=1)

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        # the next propose() syncs the cache to the verified sequence; the schedule learns
        if self.schedule is not None and self.schedule.cost is not None:
            self.timer.verified(self.schedule.cost, n_drafted)
            self.schedule.observe(n_accepted, n_drafted)
            self.keep_up(seq)

    def reset(self) -> None:
        self.state.reset()
        self.timer.reset()
        if self.schedule is not None:
            self.schedule.end_call()
