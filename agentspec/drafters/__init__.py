"""Drafters propose tokens for the target to verify. See ``base.Drafter`` for the interface.

``model``: a draft model (fixed length, or confidence-scheduled with ``schedule``); ``prompt_lookup``:
n-gram lookup in the context; ``suffix``: suffix trees over the request and earlier outputs;
``hybrid``: ``drafter="auto"``, the suffix draft or the model's, whichever is worth more per pass;
``registry``: the names, the default and ``build_drafter``.
"""

from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.hybrid import DraftMemories, DraftMemory, HybridDrafter
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.drafters.registry import DEFAULT, NAMES, build_drafter
from agentspec.drafters.schedule import Calibration, ConfidenceSchedule
from agentspec.drafters.suffix import SuffixDrafter, SuffixStore

__all__ = [
    "DEFAULT",
    "NAMES",
    "Calibration",
    "ConfidenceSchedule",
    "Draft",
    "DraftMemories",
    "DraftMemory",
    "Drafter",
    "HybridDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "SuffixDrafter",
    "SuffixStore",
    "build_drafter",
]
