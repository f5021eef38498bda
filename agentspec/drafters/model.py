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

Host syncs: without a grammar the tokens stay on the device (the argmax, or the sample, fed back as
the next input), the draft's positions in its cache are ``unread`` until ``settle`` names the
accepted ones from the verified sequence, and the verification reads the tokens with its result.
A greedy schedule on a CPU (``early_stop``) reads the confidences once per block of DEVICE_BLOCK
tokens and replays its token-by-token decisions over them; elsewhere, where a read stalls the
device's queue, it decides the length before drafting from what its calibration expects
(``ConfidenceSchedule.planned``) and the confidences come back with the verification's one read
(``Draft.confidence``), to teach the calibration. A sampled schedule still reads each confidence
before each draw (not the token), so the generator's calls (and a seeded output) are the same as ever.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.eagle import EagleForward, EagleState, is_feature_head
from agentspec.drafters.schedule import ConfidenceSchedule, DraftStepTimer
from agentspec.forward import Forward
from agentspec.grammar import Constraint, apply_bitmask
from agentspec.kv import ModelState, PassIds, common_prefix_len
from agentspec.packed import DraftState
from agentspec.sampling import probabilities
from agentspec.static_kv import StaticState
from agentspec.steps import Steps, run_alone

CATCH_UP = 32  # the most verified tokens the draft is fed at the end of a call (see ``keep_up``)
DEVICE_BLOCK = 2  # scheduled greedy drafts: tokens drafted on the device between reads of confidences


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
        self,
        model,
        vocab_size: int,
        schedule: ConfidenceSchedule | None = None,
        name: str | None = None,
        state: StaticState | None = None,
        forward: Forward | None = None,
        head: EagleForward | None = None,
    ):
        # an EAGLE head drafts from the target's features: ``decode`` hands them to ``observe_features``
        reads = is_feature_head(model)  # an EAGLE-1 or EAGLE-3 head (a block head drafts in BlockDrafter)
        self.feature_layers = tuple(model.feature_layers) if reads else ()
        self.context_rows = model.context_rows if reads else 0
        # ``state``: a preallocated one to draft in (``ModelPair.draft_state``); ``forward``: what the
        # draft model's passes call (``ModelPair.draft_forward``; None: transformers' own); ``head``:
        # what an EAGLE head's passes call (``ModelPair.draft_head``; None: its own modules)
        if state is None:
            state = EagleState(model, head) if self.feature_layers else DraftState(forward or model)
        self.state = state
        self.vocab_size = vocab_size  # the target's logits width
        self.schedule = schedule  # None: always draft k tokens
        if schedule is not None:
            self.draft_cap = 16
        self.device = model.device  # where it drafts
        self.timer = DraftStepTimer(self.device)  # times its steps for the schedule's cost model
        # a greedy schedule stops a draft early on its confidences, read as it drafts: where a read
        # costs nothing (a CPU); elsewhere its length is planned and they come back with the verdict
        self.early_stop = self.device.type == "cpu"
        self.verified = 0  # leading ids of the state known to match this call's verified sequence
        self._fed_at: int | None = None  # position of the last draft's first token, fed unread
        if name is not None:
            self.name = name

    def propose(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Draft:
        """Up to ``k`` tokens; with a ``constraint``, drawn under its mask and pushed onto its path."""
        return run_alone(self.propose_steps(seq, k, config, generator, constraint))

    def propose_steps(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Steps[Draft]:
        self._fed_at = None
        if k <= 0:
            return Draft([])
        sched = self.schedule
        planned = sched is not None and config.greedy and constraint is None and not self.early_stop
        if sched is not None:
            if sched.calibration is None:
                sched.begin(config.greedy)
            if not sched.start(k):
                return Draft([])
            k = sched.planned(k) if planned else k
            if not k:
                return Draft([])
        start = min(self.verified, len(self.state.ids))
        pending = self.state.sync(seq, start, len(seq) - 1) + seq[-1:]
        # the host reads each token only where a grammar pushes it; otherwise the tokens stay on
        # the device until the verification reads them
        if constraint is not None:
            draft = yield from self._draft_on_host(pending, k, config, generator, constraint)
        else:
            draft = yield from self._draft_on_device(pending, k, config, generator, planned)
            self._fed_at = len(seq)  # the draft's position in the state: its first unread one
        if sched is not None:
            # a deterministic draft may also be cut after the fact, to its best prefix
            n = sched.trim() if config.greedy else len(draft.tokens)
            sched.keep(min(n, len(draft.tokens)))
            draft.tokens = draft.tokens[:n]
            draft.survival = sched.acceptance()
            draft.confidence = draft.confidence[:n] if draft.confidence is not None else None
        return draft

    def trimmed(self, n: int) -> None:
        if self.schedule is not None:
            self.schedule.keep(n)  # what it verifies is what its calibration learns from

    def _logits(self, new: list[int] | PassIds) -> Steps[torch.Tensor | None]:
        """The next token's logits [V] after feeding ``new`` (None: an EAGLE head had no feature)."""
        start = self.timer.clock.mark()  # on the device's clock: the step is queued, not waited for
        rows = yield from self.state.forward_steps(new, keep=1)
        if not len(rows):
            return None
        if self.schedule is not None and len(new) == 1:
            self.timer.step(self.schedule.cost, start)
        return fit_vocab(rows[-1], self.vocab_size)  # [V]

    def _draft_on_device(
        self, pending: list[int], k: int, config: GenerationConfig, generator, planned: bool = False
    ) -> Steps[Draft]:
        """Up to ``k`` tokens as a [n] tensor on the device, each fed back without a host read.

        With a greedy schedule, the confidences of a block of DEVICE_BLOCK tokens are read at once
        and the schedule's per-token decisions replayed over them: position i's decision reads only
        confidences up to i, as when drafting token by token, so the draft is the same; the tokens
        drafted past the cut within a block are the price of not reading each one. A ``planned``
        greedy draft (its length decided before it) reads none: its confidences go with the draft
        (``Draft.confidence``). A sampled schedule reads each confidence before its draw (a draw
        past the cut would move the generator); the token itself stays on the device.
        """
        sched = self.schedule
        new: list[int] | PassIds = pending
        tokens: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        confidences: list[torch.Tensor] = []
        included = 0
        while len(tokens) < k:
            logits = yield from self._logits(new)
            if logits is None:  # an EAGLE head without the target's feature here: no further draft
                break
            if config.greedy:
                token = logits.argmax()
                if sched is not None:
                    confidences.append(torch.softmax(logits.float(), dim=-1).max())
            else:
                q = probabilities(logits, config.temperature, config.top_k, config.top_p)
                # decided before the token is drawn: lossless, and the generator's calls stay as they are
                if sched is not None and not sched.include(float(q.max())):
                    break
                token = torch.multinomial(q, 1, generator=generator)[0]
                qs.append(q)
            tokens.append(token)
            new = PassIds([], token[None])
            if sched is None or not config.greedy or planned:
                included += 1
            elif len(confidences) == DEVICE_BLOCK:
                kept, block = self._replay(confidences), len(confidences)
                included, confidences = included + kept, []
                if kept < block:
                    break
        if confidences and not planned:
            included += self._replay(confidences)
        if not included:
            return Draft([])
        confidence = torch.stack(confidences) if planned else None
        return Draft(torch.stack(tokens[:included]), torch.stack(qs) if qs else None, confidence=confidence)

    def _replay(self, confidences: list[torch.Tensor]) -> int:
        """Read a block's confidences at once and ask the schedule about each in turn, as drafting
        token by token would: how many it includes before its first no."""
        read = torch.stack(confidences).tolist()
        return next((i for i, c in enumerate(read) if not self.schedule.include(c)), len(read))

    def _draft_on_host(
        self, pending, k, config: GenerationConfig, generator, constraint: Constraint
    ) -> Steps[Draft]:
        """Up to ``k`` tokens read one by one, each pushed onto the grammar's path."""
        sched = self.schedule
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        new = pending
        for _ in range(k):
            logits = yield from self._logits(new)
            if logits is None:  # an EAGLE head without the target's feature here: no draft
                break
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
            if not constraint.push(token):
                qs = qs[: len(tokens)]
                break
            tokens.append(token)
            new = [token]
        return Draft(tokens, torch.stack(qs) if qs else None)

    def observe_confidences(self, confidences: list[float]) -> None:
        if self.schedule is not None:
            self.schedule.observed(confidences)

    def settle(self, seq: list[int], n_accepted: int) -> None:
        """After a verify pass (``seq``: the verified sequence): the draft positions fed from the
        device hold the accepted tokens (the rest are rolled back), and the count of the state's
        ids known to be verified moves up, so the next ``sync`` compares only what is new."""
        state = self.state
        if self._fed_at is not None and state.unread:
            state.settle(seq[self._fed_at : self._fed_at + n_accepted][: state.unread])
        self._fed_at = None
        self.verified = common_prefix_len(state.ids, seq, min(self.verified, len(state.ids)))

    def observe_features(self, position: int, features: torch.Tensor) -> None:
        self.state.observe(position, features)

    def kv_state(self) -> ModelState | None:
        # an EAGLE head's cache was fed this call's target features, which the prefix cache does not keep
        return None if self.feature_layers else self.state

    def adopt_kv_state(self, state: ModelState) -> None:
        self.state = self.state.take(state)  # a static state copies it into its buffers
        self.verified = 0  # compared in full once, at the next sync

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
        pending = self.state.sync(ids, min(self.verified, len(self.state.ids)))
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
            pending = self.state.sync(seq, min(self.verified, len(self.state.ids)), len(seq) - 1)
            if pending:
                self.state.forward(pending, keep=1)

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        # the next propose() syncs the cache to the verified sequence; the schedule learns
        self.settle(seq, n_accepted)
        if self.schedule is not None and self.schedule.cost is not None:
            self.schedule.observe(n_accepted, n_drafted)
            self.keep_up(seq)

    def reset(self) -> None:
        self.state.reset()
        self.timer.reset()
        self.verified, self._fed_at = 0, None
        if self.schedule is not None:
            self.schedule.end_call()
