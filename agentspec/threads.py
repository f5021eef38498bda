"""A thread's OpenMP workers, let go once it stops computing, so that the pass thread's run at full speed.

Why: PyTorch's CPU ops run their parallel parts on OpenMP, and GNU OpenMP (libgomp, which PyTorch's
Linux wheels ship) gives every thread that starts a parallel region a pool of worker threads of its
own, kept for as long as that thread lives. Once the pools' threads outnumber the CPUs, libgomp's
idle workers no longer spin between parallel regions but sleep (its "throttled" spin, whatever
``OMP_WAIT_POLICY`` says), so every parallel op of a pass pays for waking them. agentspec's passes run
in the scheduler's thread (drafting, restores and saves included), while the loading thread loads
the model: each keeps a pool, and one idle pool beside the pass thread's slows every pass
(docs/benchmarks.md, "Design probes", has the measurement).

``omp_pause_resource_all`` (OpenMP 5.0) frees the calling thread's pool in libgomp (its workers
exit); the thread's next parallel op builds a new one. The library calls ``release_pool`` wherever a
thread other than the pass thread has computed and is about to wait: a caller once it joined the
scheduler (its own work before the call made a pool), ``load_pair`` after loading. Never per token.
With no pool it returns at once (a call into the runtime).

LLVM's and Intel's OpenMP runtimes (another build of PyTorch) neither throttle by pool count nor
need this; there, and where no OpenMP runtime is loaded, ``release_pool`` does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads and resources freed, state kept


@functools.cache
def _pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all``, from the copy PyTorch loaded (None: no libgomp loaded).

    Read from the process's mappings, since wheels rename their bundled libgomp (``libgomp-<hash>.so.1``):
    opening "libgomp.so.1" by name could load the system's, a second runtime with pools of its own.
    """
    path = _loaded_libgomp()
    if path is None:
        return None
    function = ctypes.CDLL(path).omp_pause_resource_all  # a loaded library: dlopen returns it as is
    function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
    return function


def _loaded_libgomp() -> str | None:
    """The path of the libgomp mapped into this process (Linux's /proc/self/maps; None elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libgomp") and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def release_pool() -> None:
    """Free the calling thread's OpenMP worker threads, if it has any (see the module doc)."""
    pause = _pause()
    if pause is not None:
        pause(OMP_PAUSE_SOFT)
