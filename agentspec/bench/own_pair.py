"""The pair a measurement runs on, as ``agentspec bench`` and the demo agent (``examples/agent_demo.py``)
take it: the embedded one by default, or a user's own.

``add_pair_arguments`` adds ``--model``, ``--draft-model`` (or ``--no-draft-model``), ``--drafter``,
``--dtype`` and ``--device``; ``load`` loads what they name with ``agentspec.load_pair`` and turns what a
user can get wrong (a folder that is not there, a draft of another tokenizer, a drafter the pair cannot
build, a device this machine lacks) into a ``PairError``, one line naming the option, before any
measurement starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import agentspec
from agentspec.bench.run import add_dtype_argument
from agentspec.drafters import DraftMemory, build_drafter
from agentspec.drafters.registry import NAMES
from agentspec.models import TokenizerMismatchError


class PairError(ValueError):
    """The options name a pair that cannot be loaded or drafted for; the message says which and why."""


def add_pair_arguments(
    parser: argparse.ArgumentParser, drafter_default: str | None, drafter_help: str
) -> None:
    """The options that name the pair, its drafter, dtype and device."""
    parser.add_argument(
        "--model", help="target: a hub id, a folder or a .gguf file (default: the embedded SmolLM2-135M)"
    )
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument(
        "--draft-model",
        help="a draft model of the target's tokenizer: hub id, folder (`agentspec distill` writes one) "
        "or .gguf (default: the embedded draft with the embedded target, none with another target)",
    )
    draft.add_argument(
        "--no-draft-model", action="store_true", help="no draft model: drafts come from the text alone"
    )
    parser.add_argument("--drafter", choices=NAMES, default=drafter_default, help=drafter_help)
    add_dtype_argument(parser)
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: CUDA when available)")


def draft_source(args: argparse.Namespace) -> str | bool | None:
    """``load_pair``'s ``draft_model``: False for ``--no-draft-model``, None for the default."""
    return False if args.no_draft_model else args.draft_model


def load(args: argparse.Namespace) -> Any:
    """The ``ModelPair`` the options of ``add_pair_arguments`` name, checked that ``--drafter`` drafts
    for it; a ``PairError`` where they name something this machine cannot load."""
    draft = draft_source(args)
    check_device(args.device)
    check_source("--model", args.model)
    check_source("--draft-model", draft)
    try:
        pair = agentspec.load_pair(args.model, draft, device=args.device, dtype=args.dtype)
    except TokenizerMismatchError as exc:
        raise PairError(f"--draft-model {draft}: its tokenizer is not the target's ({exc})") from exc
    except OSError as exc:  # transformers' "not a folder here, and no such hub repository", offline, ...
        raise PairError(f"cannot load {names(args.model, draft)}: {exc}") from exc
    check_drafter(pair, args.drafter)
    return pair


def names(model: str | None, draft: str | bool | None) -> str:
    """The pair as the options named it, for a message."""
    target = model or "the embedded model"
    return target if draft in (None, False) else f"{target} with draft {draft}"


def looks_local(source: str) -> bool:
    """Whether ``source`` can only be a path here: a hub id is "name" or "owner/name"."""
    return source.endswith(".gguf") or source.startswith(("/", ".", "~")) or source.count("/") > 1


def check_source(option: str, source: str | bool | None) -> None:
    """A PairError for a path that is not there (transformers would look it up on the hub instead)."""
    if isinstance(source, str) and looks_local(source) and not Path(source).expanduser().exists():
        raise PairError(f"{option} {source}: no such folder or file")


def check_device(device: str | None) -> None:
    """A PairError for a device torch does not know or this machine does not have."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise PairError(f"--device {device}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PairError(f"--device {device}: no CUDA device here (torch {torch.__version__})")


def check_drafter(pair: Any, name: str | None) -> None:
    """A PairError where ``name`` cannot draft for ``pair`` ("model" without a draft model, say)."""
    if name is None:
        return
    try:
        build_drafter(pair, name, DraftMemory())
    except ValueError as exc:
        raise PairError(f"--drafter {name}: {exc}") from exc
