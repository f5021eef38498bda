"""The cross-call prefix cache: keeps the verified KV state of target and draft between calls.

An agent resends its growing conversation on every call. After a call, the KV state of the
verified tokens (prompt + accepted output) of the target, and of the draft model when one was
used, goes into a radix tree keyed by the token ids and namespaced by the model pair (names, dtype,
device, and any ``extra`` key such as an adapter) and by the call's ``namespace`` (SGLang's
``extra_key``: a server keeps tenants apart with it; one byte budget covers them all). The next
call restores its longest cached prefix and prefills only the rest. The target is restored to its
longest cached prefix; the draft model to the part of that prefix it covers (a draft that sat out
part of a call, as a scheduled draft model may, covers less), and it catches up on the rest when it
next drafts.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping

import torch

from agentspec.cache.radix import RadixCache, Tier
from agentspec.forward import Forward
from agentspec.kv import KVState, ModelState, Segments, common_prefix_len, growing_cache

__all__ = ["PrefixCache", "RadixCache", "Tier", "default_budget", "default_host_budget"]


# the device tier's default budget at most: memory past it is the models' and the calls', and what
# it evicts waits in the host tier
DEVICE_CAP = 8 << 30
HOST_CAP = 16 << 30  # the host tier's default budget at most (page-locked memory is the OS's to lend)


def default_budget(device: torch.device | None = None) -> int:
    """The device tier's budget: 20% of the memory free now on the device (GPU) or in RAM (CPU),
    at most DEVICE_CAP."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _free_ram()
    return min(int(free * 0.2), DEVICE_CAP)


def default_host_budget(device: torch.device | None = None) -> int:
    """The host tier's budget: for a CUDA device, 20% of the RAM free now, at most HOST_CAP; none
    otherwise (the device tier is host memory already)."""
    if device is None or device.type != "cuda":
        return 0
    return min(int(_free_ram() * 0.2), HOST_CAP)


def _free_ram() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on every platform
        return 4 << 30


def _state(forward: Forward, segments: Segments, ids: list[int]) -> ModelState:
    """A ModelState that adopts the segments (the tree's tensors or one copy of them, see
    ``RadixCache._gather``) as its cache tensors: ``DynamicCache.update`` would concatenate them
    onto an empty tensor, a second full copy. A ``GrowingLayer`` never writes adopted tensors (its
    first update copies them into its own buffer, ``crop`` slices), so the tree's own are safe in it."""
    cache = growing_cache(forward.model.config)
    for layer, (k, v) in zip(cache.layers, segments, strict=True):
        layer.adopt(k, v)
    return ModelState(forward, cache, ids)


class PrefixCache:
    """A byte-budgeted radix tree of KV states shared by all calls of one loaded pair.

    ``budget_bytes``: the device tier's budget (default ``default_budget(device)``); ``host_bytes``:
    the host tier's, where segments evicted from the device wait for a hit (default
    ``default_host_budget(device)``: pinned memory for a CUDA device, none for a CPU); ``device``:
    where the pair runs (default: the CPU).
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        extra_key: Hashable = None,
        *,
        device: torch.device | str | None = None,
        host_bytes: int | None = None,
    ):
        dev = torch.device("cpu") if device is None else torch.device(device)
        budget = default_budget(dev) if budget_bytes is None else budget_bytes
        host_budget = default_host_budget(dev) if host_bytes is None else host_bytes
        host = Tier("host", host_budget, pinned=dev.type == "cuda" and host_budget > 0)
        self.tree = RadixCache(budget, host, device=dev)
        self.extra_key = extra_key

    @property
    def budget_bytes(self) -> int:
        return self.tree.budget

    @property
    def bytes_used(self) -> int:
        """Bytes held in the device tier."""
        return self.tree.bytes_used

    @property
    def host_bytes_used(self) -> int:
        return self.tree.host.bytes_used

    def namespace(self, pair, namespace: str | None = None) -> Hashable:
        """The tree's key for ``pair``'s entries saved under ``namespace`` (None: the shared one)."""
        return (pair.key, self.extra_key, namespace)

    def restore(
        self, pair, ids: list[int], forwards: Mapping[str, Forward], namespace: str | None = None
    ) -> dict[str, ModelState]:
        """ModelStates for each model, named with the forward its passes call: the target's covers the
        longest cached prefix of ids[:-1], each other model's the part of it that model has in the
        cache (see the module docstring).

        Only entries saved under the same ``namespace`` are read (a tenant's, say; None: the
        default, shared one). The last prompt token is always left to feed: its logits give the
        first output token. Pass the target first.
        """
        states = {name: ModelState(forward) for name, forward in forwards.items()}
        if not all(s.reusable for s in states.values()):
            return states
        found = self.tree.lookup_each(self.namespace(pair, namespace), ids[:-1], list(forwards))
        for name, (n, segs) in found.items():
            if n:
                states[name] = _state(forwards[name], segs, ids[:n])
        return states

    def save(self, pair, states: Mapping[str, KVState], namespace: str | None = None) -> int:
        """Record the verified tokens each state covers (the draft: only what matches the target),
        under ``namespace``: only a restore under the same one reads them.

        Returns how many of the target's positions were new to the tree. They are always the last
        ones of ``target.ids``: a node holds a model's KV only if its parent does, so the positions
        the tree already held for the target are a prefix of them.
        """
        target = states["target"]
        if not target.ids or not target.reusable:
            return 0
        ns = self.namespace(pair, namespace)
        written = self.tree.insert(ns, target.ids, "target", target.segments(len(target.ids)))
        for name, state in states.items():
            if name == "target" or not state.reusable:
                continue
            n = common_prefix_len(state.ids, target.ids)  # draft positions past n are unverified
            if n:
                self.tree.insert(ns, target.ids[:n], name, state.segments(n))
        return written

    def clear(self) -> None:
        self.tree.evict_all()
