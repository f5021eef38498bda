"""agentspec: lossless speculative decoding and prefix reuse for LLM agents.

The engine (this package, distribution ``agentspec-decode``) imports no LangChain. ``ChatSpecDecode``,
the LangChain chat model, is the distribution ``langchain-agentspec``:
``from langchain_agentspec import ChatSpecDecode``.
"""

import agentspec.numerics  # noqa: F401  (first: it refuses a transformers older than the cache API)
from agentspec.config import GenerationConfig
from agentspec.decode import DecodeTimeout, GenerationResult, Step, generate, stream
from agentspec.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from agentspec.grammar import Constraint, Grammar, GrammarError
from agentspec.memory import DeviceOutOfMemory
from agentspec.models import ModelPair, TokenizerMismatchError, load_pair
from agentspec.stats import DecodeStats

__all__ = [
    "Constraint",
    "DecodeStats",
    "DecodeTimeout",
    "DeviceOutOfMemory",
    "Draft",
    "Drafter",
    "GenerationConfig",
    "GenerationResult",
    "Grammar",
    "GrammarError",
    "ModelDrafter",
    "ModelPair",
    "PromptLookupDrafter",
    "Step",
    "TokenizerMismatchError",
    "generate",
    "load_pair",
    "stream",
]


__version__ = "0.1.0+git"  # the distribution's version (pyproject.toml)
