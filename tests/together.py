"""Calls started together on one pair, all joining its scheduler before its first pass: for the tests
of shared passes (imported by test modules in several folders; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import threading
import time

from agentspec import ModelPair


def start_together(pair: ModelPair, calls: list) -> list:
    """Run ``calls`` (functions of no argument) in threads that all join the scheduler before its
    first pass; return their results (an exception raised is returned as the result)."""
    results: list = [None] * len(calls)
    waiting0 = pair.scheduler.stats.waiting

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    with pair.lock:
        for t in threads:
            t.start()
        for _ in range(2000):  # every thread is waiting for the lock to join (bounded)
            if pair.scheduler.stats.waiting - waiting0 >= len(calls):
                break
            time.sleep(0.005)
        assert pair.scheduler.stats.waiting - waiting0 >= len(calls), "the calls did not all wait to join"
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a call did not finish"
    return results
