"""agentspec: lossless speculative decoding and prefix reuse for LLM agents.

The core (this package) needs torch, transformers, xgrammar and tenacity only; ``ChatSpecDecode``
is the LangChain chat model, importable from here when langchain-core is installed.
"""

from agentspec.config import GenerationConfig
from agentspec.decode import GenerationResult, Step, decode, generate, stream
from agentspec.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from agentspec.grammar import Constraint, Grammar, GrammarError
from agentspec.memory import DeviceOutOfMemory
from agentspec.models import ModelPair, TokenizerMismatchError, load_pair
from agentspec.stats import DecodeStats

__all__ = [
    "Constraint",
    "DecodeStats",
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
    "decode",
    "generate",
    "load_pair",
    "stream",
    "ChatSpecDecode",
]


def __getattr__(name: str):
    # the LangChain chat model lives in integrations/ and needs langchain-core: import it on use
    if name == "ChatSpecDecode":
        from integrations.langchain import ChatSpecDecode

        return ChatSpecDecode
    raise AttributeError(f"module 'agentspec' has no attribute {name!r}")


__version__ = "0.1.0"
