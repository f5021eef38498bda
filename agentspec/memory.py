"""Out-of-memory handling: free what agentspec holds, retry a bounded number of times, then say so.

A device out-of-memory error is often transient on a shared GPU (another process held memory a
moment ago, or the allocator's cache is fragmented). The target's verify pass is retried with
``tenacity`` after freeing the prefix cache's KV segments and the allocator's cached blocks; the
retried pass reads exactly the same tokens, and no sample was drawn before it, so the output is the
one the call would have produced anyway. After ``OOM_ATTEMPTS`` failed attempts the call raises
``DeviceOutOfMemory``, which names the sizes involved and what to change.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator

import torch
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from agentspec.kv import ModelState

log = logging.getLogger(__name__)

OOM_ATTEMPTS = 3  # tries of one target pass (the first included) before DeviceOutOfMemory
_OOM_TEXT = ("out of memory", "can't allocate memory")  # MPS, older CUDA builds, the CPU allocator


class DeviceOutOfMemory(torch.OutOfMemoryError):
    """Out of memory after freeing the prefix cache and retrying; a ``torch.OutOfMemoryError``."""


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _OOM_TEXT)


def release_cached_memory() -> None:
    """Return the allocator's unused cached blocks to the device (and drop unreachable tensors)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def forward_retrying(
    state: ModelState,
    new_ids: list[int],
    keep: int,
    free: Callable[[], None] | None = None,
    features: tuple[int, ...] = (),
):
    """``state.forward(new_ids, keep, features)``, retried on out-of-memory after ``free()`` and
    ``release_cached_memory()``.

    The pass itself is a plain call: the retry machinery is built only once a pass has failed. A
    failed pass is rolled back to the state before it (``ModelState.forward``), so a retry feeds
    that pass's tokens only; were the state reset instead (a cache that cannot be cropped), the
    retry feeds the tokens it covered before too: the same sequence, recomputed.
    """
    covered = state.ids  # no copy per pass: a reset gives the state a new list, this one stays
    try:
        return state.forward(new_ids, keep, features)
    except Exception as exc:
        if not is_oom(exc):
            raise
        failure = _without_frames(exc)

    def attempt():
        try:
            out = state.forward(state.sync(covered) + new_ids, keep, features)
        except Exception as exc:
            if is_oom(exc):  # tenacity keeps the failure while it frees memory: not its frames
                raise _without_frames(exc) from None
            raise
        return (out[0], out[1][-len(new_ids) :]) if features else out  # feature rows: new_ids' only

    def free_all(attempt_number: int) -> None:
        log.warning(
            "out of memory in a %d-token pass (attempt %d of %d): freeing the prefix cache and retrying",
            len(covered) + len(new_ids),
            attempt_number,
            OOM_ATTEMPTS,
        )
        if free is not None:
            free()
        release_cached_memory()

    free_all(1)
    retrying = Retrying(
        retry=retry_if_exception(is_oom),
        stop=stop_after_attempt(OOM_ATTEMPTS - 1),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        before_sleep=lambda retry: free_all(retry.attempt_number + 1),
        reraise=True,
    )
    try:
        return retrying(attempt)
    except Exception as exc:
        if not is_oom(exc):
            raise
        failure = exc
    release_cached_memory()
    raise _gave_up(state, len(covered) + len(new_ids), failure) from failure


def _gave_up(state: ModelState, tokens: int, failure: BaseException) -> DeviceOutOfMemory:
    return DeviceOutOfMemory(
        f"out of memory on {state.model.device} in a pass over {tokens} tokens, {OOM_ATTEMPTS} "
        f"attempts, the prefix cache freed before each retry: use a shorter prompt, fewer "
        f"max_tokens, a smaller dtype or draft, or a smaller prefix-cache budget "
        f"({type(failure).__name__}: {str(failure)[:200]})"
    )


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` without its traceback: the failed pass's frames hold its activations, which must be
    unreachable before memory is freed and the pass retried."""
    return exc.with_traceback(None)


@contextlib.contextmanager
def cache_oom_frees_cache(cache, doing: str) -> Iterator[None]:
    """Copying KV out of or into a prefix cache: out of memory there clears the cache instead of
    failing the call (the body's effect is then skipped: a full prefill, or nothing saved)."""
    try:
        yield
    except Exception as exc:
        if not is_oom(exc):
            raise
        log.warning("out of memory %s the prefix cache (%r): clearing it", doing, exc)
        cache.clear()
        release_cached_memory()
