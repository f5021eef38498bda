"""A radix tree over token ids whose nodes hold KV segments, with a byte budget and LRU eviction.

After SGLang's RadixAttention (``mem_cache/radix_cache.py``): an edge is labelled by a run of token
ids; the node below it holds, for each model ("target", "draft"), the keys and values of exactly
those tokens, one (K, V) pair per layer, shaped [1, heads, len(edge), head_dim]. A path from the
root spells a prefix, and its segments concatenated are the KV state of that prefix.

Invariants (checked by ``check``):
- every node's segments span exactly ``len(node.key)`` positions;
- a node holds a model's KV only if its parent does (the root holds nothing), so a path that has a
  model's KV has it from the first token on;
- ``bytes_used`` is the sum of the segment bytes of all nodes and never exceeds ``budget`` after
  an insert returns;
- nodes with ``lock_ref > 0`` (being restored) are never evicted;
- ``evictable`` holds exactly the nodes without children whose ``lock_ref`` is 0.

Thread-safe: one re-entrant lock guards the tree. Keys of different model pairs never mix: each
namespace has its own root.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

Segments = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [1, H, n, D]


def segment_bytes(seg: Segments) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in seg)


def slice_segments(seg: Segments, start: int, end: int) -> Segments:
    """Positions [start, end) of every layer, copied (a view would pin the whole parent storage)."""
    return [(k[:, :, start:end].clone(), v[:, :, start:end].clone()) for k, v in seg]


@dataclass(eq=False)
class Node:
    key: tuple[int, ...] = ()
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    kv: dict[str, Segments] = field(default_factory=dict)  # model name -> segments of `key`
    lock_ref: int = 0
    last_access: int = 0  # the tree's clock at the last lookup or insert through this node

    @property
    def nbytes(self) -> int:
        return sum(segment_bytes(s) for s in self.kv.values())


@dataclass
class Match:
    """The longest cached prefix of a query that has KV for every requested model."""

    length: int  # tokens covered
    nodes: list[Node]  # the path; the last node may be covered only partly
    namespace: Hashable


class RadixCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget = budget_bytes
        self.bytes_used = 0
        self.roots: dict[Hashable, Node] = {}
        self.lock = threading.RLock()
        self.evictions = 0
        self.clock = itertools.count(1)  # LRU order: ticks of lookups and inserts
        # nodes without children and not in use (lock_ref 0): the candidates for eviction
        self.evictable: set[Node] = set()

    # --- lookup -------------------------------------------------------------------------------
    def lookup(
        self, namespace: Hashable, ids: Sequence[int], models: Sequence[str]
    ) -> tuple[int, dict[str, Segments]]:
        """The longest prefix of ids held with KV for every model, and those KV segments (copies).

        Atomic: the path is locked while it is read, so no concurrent insert splits or evicts it.
        """
        with self.lock:
            match = self._match(namespace, ids, models)
            try:
                return match.length, {m: self._gather(match, m, match.length) for m in models}
            finally:
                self._release(match)

    def lookup_each(
        self, namespace: Hashable, ids: Sequence[int], models: Sequence[str]
    ) -> dict[str, tuple[int, Segments]]:
        """Per model, the longest prefix of ids it has KV for, along the first model's match.

        The first model (the target) decides the path; another (a draft model that skipped some
        tokens) may cover less of it, and then gets its own shorter prefix rather than cutting
        the target's. Atomic like ``lookup``.
        """
        with self.lock:
            match = self._match(namespace, ids, models[:1])
            try:
                out = {}
                for m in models:
                    n = 0
                    for nd in match.nodes:
                        if m not in nd.kv:
                            break
                        n += min(len(nd.key), match.length - n)
                    out[m] = (n, self._gather(match, m, n))
                return out
            finally:
                self._release(match)

    def _match(self, namespace: Hashable, ids: Sequence[int], models: Sequence[str]) -> Match:
        """Longest prefix of ids held with KV of all ``models``; its nodes are locked until release."""
        with self.lock:
            node = self.roots.get(namespace)
            path: list[Node] = []
            length = 0
            while node is not None and length < len(ids):
                child = node.children.get(ids[length])
                if child is None or any(m not in child.kv for m in models):
                    break
                n = _shared(child.key, ids, length)
                path.append(child)
                length += n
                if n < len(child.key):
                    break
                node = child
            tick = next(self.clock)
            for nd in path:
                nd.lock_ref += 1
                nd.last_access = tick
                self.evictable.discard(nd)
            return Match(length, path, namespace)

    def _release(self, match: Match) -> None:
        with self.lock:
            for nd in match.nodes:
                nd.lock_ref -= 1
                assert nd.lock_ref >= 0, f"{nd.lock_ref=}"
                self._update_evictable(nd)

    def _update_evictable(self, node: Node) -> None:
        if node.children or node.lock_ref or node.parent is None:
            self.evictable.discard(node)
        else:
            self.evictable.add(node)

    def _gather(self, match: Match, model: str, length: int) -> Segments:
        """The first ``length`` (<= match.length) positions of ``model``'s KV along the match."""
        assert length <= match.length, f"{length=} {match.length=}"
        parts: list[Segments] = []
        taken = 0
        for nd in match.nodes:
            if taken >= length:
                break
            n = min(len(nd.key), length - taken)
            parts.append([(k[:, :, :n], v[:, :, :n]) for k, v in nd.kv[model]])
            taken += n
        if not parts:
            return []
        if len(parts) == 1:
            return [(k.clone(), v.clone()) for k, v in parts[0]]
        return [
            (torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
            for i in range(len(parts[0]))
        ]

    # --- insertion ------------------------------------------------------------------------------
    def insert(self, namespace: Hashable, ids: Sequence[int], model: str, kv: Segments) -> int:
        """Record ``model``'s KV for the prefix ``ids`` (kv covers at least len(ids) positions).

        Only positions the tree does not hold yet are copied. Returns the number of new positions.
        Then evicts least recently used leaves until the budget holds.
        """
        with self.lock:
            root = self.roots.setdefault(namespace, Node())
            node, pos, added = root, 0, 0
            tick = next(self.clock)
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:
                    if node is not root and model not in node.kv:
                        break  # invariant: a model's KV never starts below the root
                    child = Node(key=tuple(ids[pos:]), parent=node)
                    node.children[ids[pos]] = child
                    self.evictable.discard(node)
                    self._update_evictable(child)
                n = _shared(child.key, ids, pos)
                if n < len(child.key):
                    child = self._split(child, n)
                if model not in child.kv:
                    child.kv[model] = slice_segments(kv, pos, pos + n)
                    self.bytes_used += segment_bytes(child.kv[model])
                    added += n
                child.last_access = tick
                node, pos = child, pos + n
            self._evict()
            return added

    def _split(self, node: Node, n: int) -> Node:
        """Split node's edge after n tokens; return the new upper node (holding the first n)."""
        upper = Node(key=node.key[:n], parent=node.parent, last_access=node.last_access)
        upper.lock_ref = node.lock_ref
        for m, seg in node.kv.items():
            upper.kv[m] = slice_segments(seg, 0, n)
            node.kv[m] = slice_segments(seg, n, len(node.key))
        assert node.parent is not None
        node.parent.children[node.key[0]] = upper
        node.key = node.key[n:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # --- eviction -------------------------------------------------------------------------------
    def _evict(self) -> None:
        """Remove least recently used evictable leaves until the budget holds.

        As SGLang's ``RadixCache.evict``: a heap of the evictable leaves by last access; a parent
        left without children (and not in use) joins it. Nothing else touches the tree meanwhile
        (the lock is held), so no entry goes stale. Accesses stamp one path at a time and only its
        end is a leaf, so no two leaves share a time: the order is by ``last_access`` alone.
        """
        if self.bytes_used <= self.budget:
            return
        heap = [(nd.last_access, id(nd), nd) for nd in self.evictable]
        heapq.heapify(heap)
        while self.bytes_used > self.budget and heap:
            _, _, victim = heapq.heappop(heap)
            parent = victim.parent
            self._remove(victim)
            if parent is not None and parent in self.evictable:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        # what is left over budget is in use: it goes when released and the next insert runs

    def _remove(self, node: Node) -> None:
        assert node.parent is not None and not node.children
        parent = node.parent
        del parent.children[node.key[0]]
        self.evictable.discard(node)
        self._update_evictable(parent)
        self.bytes_used -= node.nbytes
        self.evictions += 1
        node.kv.clear()

    def evict_all(self) -> None:
        """Drop every unlocked entry (e.g. to free memory before retrying after an OOM)."""
        with self.lock:
            budget, self.budget = self.budget, 0
            self._evict()
            self.budget = budget

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            nd = stack.pop()
            yield nd
            stack.extend(nd.children.values())

    def __len__(self) -> int:
        with self.lock:
            return sum(1 for _ in self._nodes())

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        with self.lock:
            total = 0
            for nd in self._nodes():
                for m, seg in nd.kv.items():
                    for k, v in seg:
                        assert k.shape[2] == v.shape[2] == len(nd.key), f"{k.shape=} {len(nd.key)=}"
                    assert nd.parent is not None
                    if nd.parent.parent is not None:  # parent is not a root
                        assert m in nd.parent.kv, f"model {m!r} KV starts below the root"
                assert nd.lock_ref >= 0
                total += nd.nbytes
            assert total == self.bytes_used, f"{total=} {self.bytes_used=}"
            leaves = {nd for nd in self._nodes() if not nd.children and nd.lock_ref == 0}
            assert leaves == self.evictable, f"{len(leaves)=} {len(self.evictable)=}"


def _shared(key: tuple[int, ...], ids: Sequence[int], pos: int) -> int:
    """How many tokens of key equal ids[pos:]."""
    n = min(len(key), len(ids) - pos)
    i = 0
    while i < n and key[i] == ids[pos + i]:
        i += 1
    return i
