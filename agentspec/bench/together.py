"""Calls started together on one pair: every one joins its scheduler before the first pass they
share, so a measurement (or a test) of shared passes sees all of them from the start."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def start_together(pair: Any, calls: list[Callable[[], Any]], timeout_s: float = 600.0) -> list[Any]:
    """Run ``calls`` (functions of no argument) in threads that all wait to join ``pair``'s scheduler
    before its first pass (the pair's lock, which the engine takes to run joins, is held until each
    one waits); their results in order,
    an exception a call raised as its result. Raises TimeoutError where a call outlives ``timeout_s``."""
    results: list[Any] = [None] * len(calls)
    waiting0 = pair.scheduler.stats.waiting

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    with pair.lock:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10.0
        while pair.scheduler.stats.waiting - waiting0 < len(calls):
            if time.monotonic() > deadline:
                raise TimeoutError("the calls did not all wait to join the pair's scheduler")
            time.sleep(0.002)
    for t in threads:
        t.join(timeout=timeout_s)
        if t.is_alive():
            raise TimeoutError(f"a call did not finish within {timeout_s} s")
    return results
