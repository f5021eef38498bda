"""Counting host syncs: the reads of tensor values that make the host wait for the device.

On a GPU the host queues kernels and runs ahead; a read of a device value (``.item()``,
``.tolist()``, ``bool(t)`` in an ``if``, ``int(t)`` as an index, ``.cpu()``, ``.numpy()``) waits
for every queued kernel, so a decode loop with several such reads per pass leaves the GPU idle
between them. ``HostSyncs`` counts them on any device, this CPU included, by watching those tensor
methods through a ``TorchFunctionMode`` (PyTorch's own hook for observing tensor calls): on a CPU
nothing waits, but the same calls would. On CUDA it also switches on
``torch.cuda.set_sync_debug_mode("warn")`` and counts the syncs CUDA itself reports (blocking
copies included), which the method count cannot see.

A host-side computation written with torch tensors counts too: the loop keeps host work in Python
lists, so that a count is a sync on a GPU.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from contextlib import ExitStack
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that return host values (or a host copy): each waits for the device on a GPU
SYNCING = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})


class HostSyncs(TorchFunctionMode):
    """Within ``with HostSyncs(pair) as syncs:``, ``syncs.count`` counts the reads of tensor values,
    in this thread and in the passes of the pairs given (their schedulers' thread).

    ``syncs.where`` counts them by the innermost agentspec source line that made them (the file
    and line under ``agentspec/``, else the caller's), for finding the one that costs.
    ``syncs.cuda`` counts the syncs CUDA reported (0 on other devices).
    """

    def __init__(self, *pairs: Any) -> None:
        super().__init__()
        self._pairs = pairs
        self._stack = ExitStack()
        self.count = 0
        self.cuda = 0
        self.where: Counter[str] = Counter()
        self._debug_mode: int | None = None
        self._warnings: Any = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCING:
            self.count += 1
            self.where[_site()] += 1
        return func(*args, **(kwargs or {}))

    def _in_passes(self) -> TorchFunctionMode:
        return _Counting(self)

    def __enter__(self):
        if torch.cuda.is_available():
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        for pair in self._pairs:
            self._stack.enter_context(pair.scheduler.observing(self._in_passes))
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._stack.close()
        if self._debug_mode is not None:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            self.cuda = sum("synchronizing" in str(w.message) for w in self._caught)
            self._warnings.__exit__(None, None, None)
            self._debug_mode = None
        return out


class _Counting(TorchFunctionMode):
    """``HostSyncs``'s count, entered in a pair's pass thread around each pass."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.syncs.__torch_function__(func, types, args, kwargs)


def _site() -> str:
    """The innermost frame in agentspec's own code (else the outermost one given), as "file:line"."""
    frames = traceback.extract_stack()[:-2]  # less this function and the mode's hook
    for frame in reversed(frames):
        if "/agentspec/" in frame.filename and "/agentspec/bench/" not in frame.filename:
            return f"{frame.filename.rsplit('/agentspec/', 1)[1]}:{frame.lineno}"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
