"""Everything a pair keeps per namespace, in one store under a byte budget: ``TenantStore``.

A namespace (a server's API key and request salt, an in-process call's ``namespace=``) keeps two
things on its pair: its drafting memory (``DraftMemory``: the suffix store of its earlier outputs,
its calibrations) and the health of the drafters its calls named (``DraftHealth``: a drafter's own
failures there and its cool-down). Both live in one ``Tenant`` per namespace, and every tenant in
one store per pair, whose estimated size is kept under ``max_bytes``: over it, the least recently
used namespaces are dropped first (a later call of a dropped namespace starts afresh, as its first
did). The default namespace (None: every call that names none) is never dropped: it is what
in-process callers share, and it is counted in the size all the same.

What is the pair's, not a namespace's, stays on the pair: the verify cost (``agentspec.cost``,
shared by every memory) and the health of the pair's shared parts. A draft model that runs out of
memory is out of memory for every namespace, so such a failure rests the drafter for the whole pair
(``shared``); any other failure counts only in the namespace of the call that saw it, so one
tenant's failing drafter never cools another's down.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from agentspec.cost import VerifyCost
from agentspec.drafters.health import DraftHealth
from agentspec.drafters.hybrid import DraftMemory

# A tenant's bytes, estimated from counts read in O(1) (no walk over its objects). The constants were
# measured with tracemalloc on CPython 3.11, and tests/unit/test_tenants.py holds the estimate to
# tracemalloc's count: a fresh tenant (its memory, suffix store and index, two calibrations, health
# record, locks and the store's entry) takes about BASE_BYTES; each token of its suffix store about
# TOKEN_BYTES (the token's int in its sequence, the (sequence, position) tuple in the index and, in
# an output past 256 tokens, the position's int: 85 bytes in short outputs, 130 in long ones); each
# distinct token id in the index a dict entry and a list, DISTINCT_BYTES; each calibration cell
# ((group, bin) -> [hits, trials]) CELL_BYTES; the namespace's key, its length. Outputs removed from
# the store whose index entries linger until compaction count as tokens still.
BASE_BYTES = 2000
TOKEN_BYTES = 110
DISTINCT_BYTES = 110
CELL_BYTES = 220
# the default budget: about eight full suffix stores (STORE_TOKENS tokens each), or ~25,000
# tenants of one short call
TENANT_BYTES = 64 << 20


@dataclass
class Tenant:
    """What one namespace keeps on a pair."""

    memory: DraftMemory
    health: DraftHealth = field(default_factory=DraftHealth)  # its own drafters' failures
    nbytes: int = 0  # the estimate when it was last touched (``estimate``)


def estimate(namespace: str | None, tenant: Tenant) -> int:
    """A tenant's bytes (see the constants above); reads counts only, without its memory's locks."""
    m = tenant.memory
    index = m.store.index
    cells = len(m.suffix_calibration.cells) + len(m.model_calibration.cells) + len(m.model_calibration.second)
    return (
        BASE_BYTES
        + len(namespace or "")
        + TOKEN_BYTES * (index.live + index.dead)
        + DISTINCT_BYTES * len(index.where)
        + CELL_BYTES * cells
    )


class TenantStore:
    """A pair's tenants, least recently used first, under ``max_bytes`` (an estimate, see above).

    Thread-safe: one lock guards the order and the sizes. A tenant's size is re-estimated whenever
    it is touched (``memory``, ``allow``, ``record``: a call's start and end), so what a call adds
    to its suffix store is counted when the call ends; the budget is then enforced by dropping
    other namespaces. A call that still holds a dropped tenant's memory carries on with it (it is
    only forgotten by the store, and freed when that call ends).
    """

    def __init__(self, verify: VerifyCost | None = None, max_bytes: int = TENANT_BYTES):
        self.verify = verify if verify is not None else VerifyCost()  # the pair's, in every memory
        self.max_bytes = max_bytes
        # failures of the pair's shared parts (the draft model out of memory), whatever the namespace
        self.shared = DraftHealth()
        self.dropped = 0  # namespaces dropped over budget, since the store was made
        self._tenants: OrderedDict[str | None, Tenant] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """The tenants' estimated bytes (as of each one's last touch)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._tenants)

    def namespaces(self) -> list[str | None]:
        """The namespaces held, least recently used first."""
        with self._lock:
            return list(self._tenants)

    def memory(self, namespace: str | None = None) -> DraftMemory:
        """The drafting memory of ``namespace`` (made on its first call, or again after a drop)."""
        with self._lock:
            return self._touch(namespace).memory

    def allow(self, namespace: str | None, name: str) -> bool:
        """May this call of ``namespace`` use the drafter ``name``? (``DraftHealth.allow``: the pair
        must allow it, then the namespace; a call it sits out counts towards that cool-down.)"""
        with self._lock:
            return self.shared.allow(name) and self._touch(namespace).health.allow(name)

    def record(self, namespace: str | None, name: str, failed: bool, oom: bool = False) -> None:
        """The outcome of a call of ``namespace`` that used the drafter ``name``; ``oom``: it failed
        out of memory, a failure of the pair's (the module docstring). A call that drafted without
        failing forgets the past failures, the pair's and the namespace's."""
        with self._lock:
            health = self._touch(namespace).health
            if not failed:
                self.shared.record(name, failed=False)
                health.record(name, failed=False)
            else:
                (self.shared if oom else health).record(name, failed=True)

    def drop(self, namespace: str | None) -> bool:
        """Forget ``namespace`` (its next call starts afresh); False if it was not held."""
        with self._lock:
            tenant = self._tenants.pop(namespace, None)
            if tenant is not None:
                self._bytes -= tenant.nbytes
            return tenant is not None

    def _touch(self, namespace: str | None) -> Tenant:
        """The tenant of ``namespace``, now the most recently used, re-estimated; then, over budget,
        the least recently used others dropped. Holding the lock."""
        tenant = self._tenants.get(namespace)
        if tenant is None:
            tenant = self._tenants[namespace] = Tenant(DraftMemory(cost=self.verify))
        else:
            self._tenants.move_to_end(namespace)
        size = estimate(namespace, tenant)
        self._bytes += size - tenant.nbytes
        tenant.nbytes = size
        self._shrink(keep=namespace)
        return tenant

    def _shrink(self, keep: str | None) -> None:
        """Drop least recently used namespaces, never ``keep`` nor the default, until the budget
        holds (or only those two are left). Holding the lock."""
        excess = self._bytes - self.max_bytes
        victims = []
        for namespace, tenant in self._tenants.items():  # oldest first; keep is the newest
            if excess <= 0:
                break
            if namespace is not None and namespace != keep:
                victims.append(namespace)
                excess -= tenant.nbytes
        for namespace in victims:
            self._bytes -= self._tenants.pop(namespace).nbytes
        self.dropped += len(victims)
