"""agentspec.threads: a thread's OpenMP workers are let go once it stops computing."""

from __future__ import annotations

import copy
import os
import threading
import time

import pytest
import torch

from agentspec import threads


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(expected: int) -> int:
    """The process's thread count once it reaches ``expected`` (workers exit after release returns)."""
    for _ in range(100):
        if _tasks() == expected:
            break
        time.sleep(0.01)
    return _tasks()


@pytest.mark.skipif(threads._pause() is None, reason="no libgomp in this process (another OpenMP runtime)")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no parallel region, no pool")
def test_release_pool_lets_this_threads_openmp_workers_go():
    seen: dict[str, int] = {}

    def work() -> None:
        before = _tasks()
        torch.ones(1 << 22).mul_(2)  # a parallel region: this thread gets a pool of its own
        seen["added"] = _tasks() - before
        threads.release_pool()
        seen["left"] = _settled(before) - before
        threads.release_pool()  # no pool now: nothing to do
        torch.ones(1 << 22).mul_(2)  # and the next parallel op builds one again
        seen["again"] = _tasks() - before
        threads.release_pool()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["added"] == torch.get_num_threads() - 1, seen
    assert seen["left"] == 0, seen
    assert seen["again"] == torch.get_num_threads() - 1, seen


def test_a_caller_waits_for_its_steps_with_no_pool_of_its_own(target, tokenizer):
    """A caller that computed before its call keeps no OpenMP workers while the pass thread runs its
    passes: the workers its parallel op started are gone by its first Step."""
    if threads._pause() is None or torch.get_num_threads() < 2:
        pytest.skip("no libgomp pools here")
    import agentspec

    pair = agentspec.ModelPair(target=copy.deepcopy(target), tokenizer=tokenizer)
    seen: dict[str, set] = {}

    def caller() -> None:
        before = set(os.listdir("/proc/self/task"))
        torch.ones(1 << 22).mul_(2)  # this thread's pool
        seen["workers"] = set(os.listdir("/proc/self/task")) - before
        steps = agentspec.stream(pair, [1, 2, 3, 4], None, False, max_new_tokens=3, speculative=False)
        for _ in steps:
            seen.setdefault("at_first_step", set(os.listdir("/proc/self/task")))

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    assert len(seen["workers"]) == torch.get_num_threads() - 1, seen
    assert not seen["workers"] & seen["at_first_step"], seen
