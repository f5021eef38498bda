"""agentspec.threads: a thread's OpenMP workers are let go once it stops computing."""

from __future__ import annotations

import copy
import os
import threading
import time

import pytest
import torch

from agentspec import threads


def _tids() -> set[str]:
    """The process's threads (their ids): OpenMP's workers are threads no Python object stands for."""
    return set(os.listdir("/proc/self/task"))


def _gone(tids: set[str]) -> bool:
    """Whether none of ``tids`` is alive, within a second (workers exit after release returns)."""
    for _ in range(100):
        if not tids & _tids():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.skipif(threads._pause() is None, reason="no libgomp in this process (another OpenMP runtime)")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no parallel region, no pool")
def test_release_pool_lets_this_threads_openmp_workers_go():
    seen: dict = {}

    def work() -> None:
        before = _tids()
        torch.ones(1 << 22).mul_(2)  # a parallel region: this thread gets a pool of its own
        seen["workers"] = _tids() - before
        threads.release_pool()
        seen["gone"] = _gone(seen["workers"])
        threads.release_pool()  # no pool now: nothing to do
        before = _tids()
        torch.ones(1 << 22).mul_(2)  # and the next parallel op builds one again
        seen["again"] = _tids() - before
        threads.release_pool()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert len(seen["workers"]) == torch.get_num_threads() - 1, seen
    assert seen["gone"], seen
    assert len(seen["again"]) == torch.get_num_threads() - 1, seen


def test_a_caller_waits_for_its_steps_with_no_pool_of_its_own(target, tokenizer):
    """A caller that computed before its call keeps no OpenMP workers while the pass thread runs its
    passes: the workers its parallel op started are gone by its first Step."""
    if threads._pause() is None or torch.get_num_threads() < 2:
        pytest.skip("no libgomp pools here")
    import agentspec

    pair = agentspec.ModelPair(target=copy.deepcopy(target), tokenizer=tokenizer)
    seen: dict = {}

    def caller() -> None:
        before = _tids()
        torch.ones(1 << 22).mul_(2)  # this thread's pool
        seen["workers"] = _tids() - before
        steps = agentspec.stream(pair, [1, 2, 3, 4], None, False, max_new_tokens=3, speculative=False)
        for _ in steps:  # the release before the first wait is the only one until the call ends
            seen.setdefault("gone_by_first_step", _gone(seen["workers"]))

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    assert len(seen["workers"]) == torch.get_num_threads() - 1, seen
    assert seen["gone_by_first_step"], seen
