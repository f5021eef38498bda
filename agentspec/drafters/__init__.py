"""Drafters propose tokens for the target to verify. See ``base.Drafter`` for the interface.

``model``: a draft model (fixed length, or confidence-scheduled with ``schedule``); ``prompt_lookup``:
n-gram lookup in the context; ``suffix``: suffix trees over the request and earlier outputs;
``hybrid``: ``drafter="auto"``, the suffix draft or the model's, whichever is worth more per pass;
``registry``: the names, the default and ``build_drafter``; ``tenants``: what a pair keeps per
namespace (drafting memory, drafter health), under a byte budget.
"""

from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.hybrid import DraftMemory, HybridDrafter
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.drafters.registry import DEFAULT, NAMES, build_drafter
from agentspec.drafters.schedule import Calibration, ConfidenceSchedule
from agentspec.drafters.suffix import SuffixDrafter, SuffixStore
from agentspec.drafters.tenants import TenantStore

__all__ = [
    "DEFAULT",
    "NAMES",
    "Calibration",
    "ConfidenceSchedule",
    "Draft",
    "DraftMemory",
    "Drafter",
    "HybridDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "SuffixDrafter",
    "SuffixStore",
    "TenantStore",
    "build_drafter",
]
