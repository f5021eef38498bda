"""The engine, ``agentspec`` (distribution ``agentspec-decode``), imported on first local use.

The one module of the adapter that imports ``agentspec`` at run time (the others name its types under
``TYPE_CHECKING``), so that ``import langchain_agentspec`` and building a ``ChatSpecDecode`` need no
torch, transformers or xgrammar: a client of a remote endpoint installs ``langchain-agentspec`` alone.
The engine is imported to run a local pair (the first call, or ``pair=``); where it is not installed,
that raises ``ImportError(INSTALL_HINT)``.

What only the engine's code can check (sampling settings, drafter names, tool schemas and the grammar
they make) is checked when a ``ChatSpecDecode`` is built or tools are bound if ``installed()``, and
otherwise at the first local call, which runs the same checks on the way to decoding.
"""

from __future__ import annotations

import functools
from types import ModuleType

INSTALL_HINT = (
    "ChatSpecDecode runs a local model pair with the agentspec engine: install langchain-agentspec's "
    "local extra with the engine (docs/install.md's first line)"
)


def engine() -> ModuleType:
    """The ``agentspec`` package with the submodules the adapter reads as its attributes (``chat``,
    ``cache``, ``telemetry``) imported; ``ImportError(INSTALL_HINT)`` where it, or torch,
    transformers or xgrammar under it, is missing."""
    try:
        import agentspec
        import agentspec.cache
        import agentspec.chat
        import agentspec.telemetry
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return agentspec


@functools.cache
def installed() -> bool:
    """Whether the engine imports here (asked once per process)."""
    try:
        engine()
    except ImportError:
        return False
    return True


# What the adapter reads of submodules the package does not expose as attributes
# (``agentspec.decode`` is the function of that name).


def drafter_names() -> tuple[str, ...]:
    engine()
    from agentspec.drafters import NAMES

    return NAMES


def default_model_name() -> str:
    """The name of the target ``load_pair(None)`` loads, the embedded default."""
    engine()
    from agentspec.models import DEFAULT_NAME

    return DEFAULT_NAME


def read_max_context(model: str | None) -> int:
    """The context window of the target ``load_pair(model)`` loads, read from its config (no weights)."""
    engine()
    from agentspec.models import read_max_context as read

    return read(model)
