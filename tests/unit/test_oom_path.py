"""The out-of-memory path frees what the failed pass held: its frames (and the activations they
reference) are unreachable by the time the prefix cache and the allocator are freed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from agentspec import memory
from agentspec.kv import ModelState
from agentspec.memory import DeviceOutOfMemory, forward_retrying

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def no_wait(monkeypatch):
    monkeypatch.setattr(memory, "wait_exponential", lambda **_: lambda _state: 0.0)


def failing_with_activations(monkeypatch, model, fail: int):
    """``model.forward`` allocates an activation in its frame, then fails with an OOM ``fail`` times."""
    real, held = model.forward, []

    def forward(*args, **kwargs):
        activation = torch.empty(1 << 20)  # what a real pass holds in its frames when it fails
        held.append(weakref.ref(activation))
        if len(held) <= fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    return held


def test_the_failed_pass_is_unreachable_when_memory_is_freed(monkeypatch, target):
    state = ModelState(target)
    state.forward([3, 17, 5], keep=1)
    held = failing_with_activations(monkeypatch, target, fail=2)
    alive_at_free = []

    def free():
        gc.collect()  # only what is still referenced survives: a traceback would keep the activation
        alive_at_free.append([ref() is not None for ref in held])

    forward_retrying(state, [42, 9], 2, free=free)
    assert alive_at_free == [[False], [False, False]]


def test_the_final_error_keeps_no_frames_of_the_passes(monkeypatch, target):
    state = ModelState(target)
    held = failing_with_activations(monkeypatch, target, fail=memory.OOM_ATTEMPTS)
    with pytest.raises(DeviceOutOfMemory) as info:
        forward_retrying(state, [3, 17, 5], 1)
    gc.collect()
    assert [ref() is None for ref in held] == [True] * memory.OOM_ATTEMPTS
    assert "simulated" in str(info.value)
