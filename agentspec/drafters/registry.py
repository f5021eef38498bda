"""Every drafter a name builds: ``NAMES``, the ``DEFAULT`` and ``build_drafter``, from one table.

``agentspec.stream(drafter=...)``, the chat model's and the server's ``drafter`` option and the CLI's
``--drafter`` all take these names; an unknown name is refused here with the list. A name's drafter
is built afresh per call, on the pair's drafting memory of the call's namespace
(``ModelPair.tenants``), and "none" builds nothing: the target decodes alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from agentspec.drafters.base import Drafter
from agentspec.drafters.block import BlockDrafter, BlockHead
from agentspec.drafters.hybrid import DraftMemory, HybridDrafter
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.drafters.schedule import ConfidenceSchedule
from agentspec.drafters.suffix import SuffixDrafter
from agentspec.drafters.tenants import TenantStore


class DraftSource(Protocol):
    """What a drafter is built from: the pair (``agentspec.models.ModelPair``) as drafters see it."""

    target: Any  # the target model (its vocabulary size)
    draft: Any  # the draft model, or None
    draft_forward: Any  # what the draft model's passes call (agentspec.forward.Forward); None for a head
    draft_head: Any  # what an EAGLE head's passes call (agentspec.drafters.eagle.EagleForward), or None
    tenants: TenantStore  # the drafting memory of each namespace

    def draft_state(self) -> Any: ...  # the draft's static KV state, or None for a dynamic cache


def _vocab(pair: DraftSource) -> int:
    return pair.target.config.vocab_size


def _needs_draft(pair: DraftSource, name: str) -> None:
    if pair.draft is None:
        raise ValueError(f"drafter={name!r} needs a pair loaded with a draft_model")


def _scheduled(pair: DraftSource, memory: DraftMemory) -> ModelDrafter:
    """The draft model under its confidence schedule, learning into ``memory``."""
    schedule = ConfidenceSchedule(memory.model_calibration, memory.cost)
    return ModelDrafter(
        pair.draft,
        _vocab(pair),
        schedule,
        "model_scheduled",
        pair.draft_state(),
        forward=pair.draft_forward,
        head=pair.draft_head,
    )


def _auto(pair: DraftSource, memory: DraftMemory) -> Drafter:
    # the hybrid weighs a model's drafts by a ConfidenceSchedule of token-by-token drafts, which a
    # block head's one-forward block does not fit: with one, "auto" drafts from the suffix trees alone
    scheduled = pair.draft is not None and not isinstance(pair.draft, BlockHead)
    return HybridDrafter(memory, model=_scheduled(pair, memory) if scheduled else None)


def _model(pair: DraftSource, memory: DraftMemory) -> Drafter:
    _needs_draft(pair, "model")
    if isinstance(pair.draft, BlockHead):  # a DFlash or DSpark head: a block per forward
        return BlockDrafter(pair.draft, _vocab(pair))
    return ModelDrafter(
        pair.draft,
        vocab_size=_vocab(pair),
        state=pair.draft_state(),
        forward=pair.draft_forward,
        head=pair.draft_head,
    )


def _model_scheduled(pair: DraftSource, memory: DraftMemory) -> Drafter:
    _needs_draft(pair, "model_scheduled")
    if isinstance(pair.draft, BlockHead):
        raise ValueError("drafter='model_scheduled' drafts with a draft model or an EAGLE head; use 'model'")
    return _scheduled(pair, memory)


# name -> its builder (None: no drafter). The order is the one error messages and docs list.
BUILDERS: dict[str, Callable[[DraftSource, DraftMemory], Drafter] | None] = {
    # the suffix draft or the scheduled draft model's, whichever is worth more per pass (hybrid.py)
    "auto": _auto,
    "model": _model,  # the draft model, a fixed number of tokens per pass
    "model_scheduled": _model_scheduled,  # the draft model under its confidence schedule
    # the prompt and earlier outputs
    "suffix": lambda pair, memory: SuffixDrafter(memory.store, calibration=memory.suffix_calibration),
    # n-grams of the context
    "prompt_lookup": lambda pair, memory: PromptLookupDrafter(calibration=memory.lookup_calibration),
    "none": None,  # the target alone
}
NAMES: tuple[str, ...] = tuple(BUILDERS)
DEFAULT = "auto"  # what a call that names no drafter gets


def check_name(name: Any) -> str:
    """``name`` if it names a drafter (None: the default); else a ValueError listing the names."""
    if name is None:
        return DEFAULT
    if isinstance(name, str) and name in BUILDERS:
        return name
    if isinstance(name, str):
        raise ValueError(f"drafter: expected one of {NAMES} or a Drafter, got {name!r}")
    raise ValueError(
        f"drafter: expected one of {NAMES} or a Drafter, got a {type(name).__name__}: subclass "
        "agentspec.Drafter (its members have defaults: define name and propose)"
    )


def build_drafter(pair: DraftSource, name: str | None, memory: DraftMemory | None = None) -> Drafter | None:
    """The drafter called ``name`` for ``pair`` (None for "none"); learned state comes from
    ``memory`` (default: the pair's default namespace)."""
    builder = BUILDERS[check_name(name)]
    if builder is None:
        return None
    return builder(pair, memory if memory is not None else pair.tenants.memory())
