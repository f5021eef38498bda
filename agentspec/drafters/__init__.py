"""Drafters propose tokens for the target to verify. See ``base.Drafter`` for the interface."""

from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "PromptLookupDrafter"]
