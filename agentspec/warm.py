"""Warming a loaded pair up, so that its first call runs as fast as a later one.

A model's first passes pay for what is done once: the allocator grows its pools for the KV cache
and the activations, oneDNN and MKL pick (and on a CPU JIT-compile) their kernels for each
(weight, rows) shape, and lazily imported code is imported. Measured by ``python -m benchmarks vllm
--part first_call`` (the first call against a later one, and the warm-up's share of the load).

``warm_up`` runs at load (``load_pair``), as a task of the pair's engine in its thread, the kinds of
pass a call runs: a few rows with their logits (a prefill's and a verify pass's shapes) and a one-row
step through the target, with the features an EAGLE head reads, and the draft's own steps. Each runs
in a throwaway state outside the engine's passes, so nothing a call sees (the prefix cache, the
drafters' memory, the pair's cost model and pass counts) changes. The grammar compiler's vocabulary,
the slowest part of a first constrained call, is read in a thread of its own (a constrained call
waits for it; so does the interpreter at exit: xgrammar aborts the process when torn down mid-read),
so it adds nothing to the load time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from agentspec.drafters.block import BlockHead, BlockState
from agentspec.drafters.eagle import EagleState, is_feature_head
from agentspec.kv import ModelState

# The passes run at load: PREFILL_ROWS tokens with a logits row each (a prefill's shapes, and a verify
# pass's few-row LM head), then one of each VERIFY_ROWS size (a plain decode step). Few passes: what a
# first pass pays once is about 0.05 s here whatever its rows, while each pass reads every weight, and
# the warm-up is to stay within a fifth of the load (the vllm suite's ``warm_up_over_load``: three
# passes took 0.38-0.55 s of a 1.1-1.4 s load).
PREFILL_ROWS = 8
VERIFY_ROWS = (1,)


def warm_up(pair: Any) -> float:
    """Run each kind of pass of ``pair`` once (see the module doc); the seconds it took."""
    start = time.perf_counter()
    ids = _token_ids(pair.tokenizer, PREFILL_ROWS + sum(VERIFY_ROWS))
    head = pair.draft if is_feature_head(pair.draft) else None
    with torch.inference_mode():
        feats = _target_passes(pair.target_forward, ids, head.feature_layers if head is not None else ())
        if isinstance(head, BlockHead):
            _block_passes(head, ids, feats)
        elif head is not None:
            _eagle_passes(head, pair.draft_head, ids, feats)
        elif pair.draft is not None:
            _target_passes(pair.draft_forward, ids, ())
    threading.Thread(target=pair.grammar_compiler.prepare, name="agentspec-grammar").start()
    return time.perf_counter() - start


def _token_ids(tokenizer: Any, n: int) -> list[int]:
    """``n`` ids of ordinary text (a real token stream, not one id repeated: attention sees a real mix)."""
    text = "The agent calls a tool, reads its result and answers the user in a sentence or two. "
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def _target_passes(forward: Any, ids: list[int], features: tuple[int, ...]) -> list[torch.Tensor]:
    """A prefill and each verify size through a fresh ``ModelState``; the ``features`` of every
    position (what an EAGLE head drafts from), if any."""
    state = ModelState(forward)
    feats: list[torch.Tensor] = []
    pos = 0
    for rows in (PREFILL_ROWS, *VERIFY_ROWS):
        out = state.forward(ids[pos : pos + rows], rows, features)
        if features:
            feats.append(out[1])
        pos += rows
    return feats


def _eagle_passes(head: Any, run: Any, ids: list[int], feats: list[torch.Tensor]) -> None:
    """An EAGLE head fed the target's features as a call feeds it (through ``run``, the pair's
    ``draft_head``), then a few draft steps."""
    state = EagleState(head, run)
    pos = 0
    for rows, hidden in zip((PREFILL_ROWS, *VERIFY_ROWS), feats, strict=True):
        state.observe(pos, hidden)
        state.forward(ids[pos : pos + rows], 1)
        pos += rows
    for token in ids[:3]:  # drafting: each step fed the head's own last output
        state.forward([token], 1)


def _block_passes(head: BlockHead, ids: list[int], feats: list[torch.Tensor]) -> None:
    """A DFlash or DSpark head's context fed the target's features as a call feeds it, and a block."""
    state = BlockState(head)
    pos = 0
    for rows, features in zip((PREFILL_ROWS, *VERIFY_ROWS), feats, strict=True):
        state.observe(pos, features)
        pos += rows
    head.block(ids[pos - 1], state.cache)
