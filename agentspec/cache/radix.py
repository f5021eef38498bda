"""A radix tree over token ids whose nodes hold KV segments, in two tiers with byte budgets and LRU.

After SGLang's RadixAttention (``mem_cache/radix_cache.py``): an edge is labelled by a run of token
ids; the node below it holds, for each model ("target", "draft"), the keys and values of exactly
those tokens, one (K, V) pair per layer, shaped [1, heads, len(edge), head_dim]. A path from the
root spells a prefix, and its segments concatenated are the KV state of that prefix.

Two tiers, after SGLang's HiCache (``hiradix_cache.py``): a node's segments live in the device tier
(where the models run) or in the host tier (pinned CPU memory on CUDA), each with its own byte
budget. Over the device budget, the least recently used nodes move to the host tier instead of
being dropped; over the host budget, the least recently used host leaves are dropped. A lookup that
reaches host nodes moves them back to the device (asynchronous copies from pinned memory on CUDA,
ordered before the restore's first pass by the stream) before their segments are handed out.

Invariants (checked by ``check``):
- every node's segments span exactly ``len(node.key)`` positions and lie on its tier's device;
- a node holds a model's KV only if its parent does (the root holds nothing), so a path that has a
  model's KV has it from the first token on;
- a node in the device tier has its parent there too (or is a root's child): a path is device
  nodes, then host nodes;
- each tier's ``bytes_used`` is the sum of the segment bytes of its nodes and never exceeds its
  ``budget`` after an insert or lookup returns, except by nodes another lookup holds;
- nodes with ``lock_ref > 0`` (being restored) are never moved or evicted;
- a tier's ``evictable`` holds exactly its nodes with ``lock_ref`` 0 and no child in that tier;
- every root has a child: a namespace whose last node goes (evicted, or ``drop``) loses its root,
  so a tree that has seen many namespaces holds roots only for those with entries.

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

from agentspec.kv import Segments


def segment_bytes(seg: Segments) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in seg)


@dataclass(eq=False)
class Tier:
    """Where segments live (``device``), with its own byte budget and its eviction candidates.

    ``pinned``: a host tier for a CUDA device keeps page-locked memory, so the copies back to the
    device can run asynchronously.
    """

    name: str
    budget: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pinned: bool = False
    bytes_used: int = 0
    evictable: set[Node] = field(default_factory=set)  # lock_ref 0, no child in this tier

    def __post_init__(self):
        if self.budget < 0:
            raise ValueError(f"{self.name} budget must be >= 0, got {self.budget}")
        if self.pinned and not torch.cuda.is_available():
            raise ValueError(f"{self.name}: pinned memory needs CUDA")

    def take(self, seg: Segments) -> Segments:
        """``seg`` on this tier: the same tensors when they are on its device already (no copy)."""
        return [(self._take(k), self._take(v)) for k, v in seg]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies on this tier's device ("cuda" holds a tensor on "cuda:0")."""
        a, b = t.device, self.device
        return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        if self.holds(t):
            return t
        if self.pinned:  # device -> pinned host: blocking, so host-side slicing reads finished data
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        # host -> device: from pinned memory this is asynchronous; the stream orders later reads
        return t.to(self.device, non_blocking=True)

    def slice(self, seg: Segments, start: int, end: int) -> Segments:
        """Positions [start, end) of every layer, copied (a view would pin the whole parent storage)."""
        return [(self._slice(k, start, end), self._slice(v, start, end)) for k, v in seg]

    def _slice(self, t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        part = t[:, :, start:end]
        if self.pinned:
            return torch.empty(part.shape, dtype=part.dtype, pin_memory=True).copy_(part)
        return part.clone()


@dataclass(eq=False)
class Node:
    key: tuple[int, ...] = ()
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    kv: dict[str, Segments] = field(default_factory=dict)  # model name -> segments of `key`
    tier: Tier | None = None  # where kv lives (None: a root, which holds nothing)
    lock_ref: int = 0
    last_access: int = 0  # the tree's clock at the last lookup or insert through this node
    namespace: Hashable = None  # a root's key in ``RadixCache.roots`` (to remove it once empty)

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
    """The tree. ``budget_bytes``: the device tier's budget; ``host``: the host tier (None: none,
    evicted segments are dropped); ``device``: where the models run, to which host segments return.
    Segments inserted are kept on the device they come from."""

    def __init__(self, budget_bytes: int, host: Tier | None = None, device: torch.device | None = None):
        self.device = Tier("device", budget_bytes, torch.device("cpu") if device is None else device)
        self.host = Tier("host", 0) if host is None else host
        self.tiers = (self.device, self.host)
        self.roots: dict[Hashable, Node] = {}
        self.lock = threading.RLock()
        self.evictions = 0  # nodes dropped
        self.demotions = 0  # nodes moved from the device tier to the host tier
        self.load_backs = 0  # nodes moved from the host tier back to the device
        self.clock = itertools.count(1)  # LRU order: ticks of lookups and inserts

    @property
    def budget(self) -> int:
        return self.device.budget

    @property
    def bytes_used(self) -> int:
        """The device tier's bytes now, read without the lock: while another thread inserts, this
        may include segments its insert is about to evict (``within_budgets`` reads under it)."""
        return self.device.bytes_used

    # --- lookup -------------------------------------------------------------------------------
    def lookup(
        self, namespace: Hashable, ids: Sequence[int], models: Sequence[str]
    ) -> tuple[int, dict[str, Segments]]:
        """The longest prefix of ids held with KV for every model, and those KV segments (see
        ``_gather``: never to be written in place), on the device.

        Atomic: the path is locked while it is read, so no concurrent insert splits or evicts it.
        """
        with self.lock:
            match = self._match(namespace, ids, models)
            try:
                self._load_back(match.nodes)
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
                self._load_back(match.nodes)
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
                self._update_evictable(nd)
            return Match(length, path, namespace)

    def _release(self, match: Match) -> None:
        with self.lock:
            for nd in match.nodes:
                nd.lock_ref -= 1
                assert nd.lock_ref >= 0, f"{nd.lock_ref=}"
                self._update_evictable(nd)
            self._evict()  # what a load-back pushed over the device budget (the path is newest)

    def _load_back(self, path: list[Node]) -> None:
        """Move the host nodes of ``path`` (its tail, by the invariant) back to the device tier."""
        for nd in path:
            if nd.tier is self.host:
                self._move(nd, self.device)
                self.load_backs += 1

    def _move(self, node: Node, tier: Tier) -> None:
        assert node.tier is not None and node.tier is not tier, f"{node.tier=} {tier=}"
        nbytes = node.nbytes
        node.kv = {m: tier.take(seg) for m, seg in node.kv.items()}
        node.tier.bytes_used -= nbytes
        tier.bytes_used += nbytes
        node.tier = tier
        self._update_evictable(node)
        assert node.parent is not None
        self._update_evictable(node.parent)

    def _update_evictable(self, node: Node) -> None:
        for tier in self.tiers:
            tier.evictable.discard(node)
        if node.tier is None or node.lock_ref or node.parent is None:
            return
        if not any(c.tier is node.tier for c in node.children.values()):
            node.tier.evictable.add(node)

    def _gather(self, match: Match, model: str, length: int) -> Segments:
        """The first ``length`` (<= match.length) positions of ``model``'s KV along the match.

        Within one node, views of the tree's own tensors: the ``DynamicCache`` that adopts them
        never writes in place (``update`` concatenates, ``crop`` slices), so a restore costs no
        copy and the first pass's concatenation is the only one. Across nodes, one concatenation.
        """
        assert length <= match.length, f"{length=} {match.length=}"
        parts: list[Segments] = []
        taken = 0
        for nd in match.nodes:
            if taken >= length:
                break
            n = min(len(nd.key), length - taken)
            parts.append([(k[:, :, :n], v[:, :, :n]) for k, v in nd.kv[model]])
            taken += n
        if len(parts) <= 1:
            return parts[0] if parts else []
        return [
            (torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
            for i in range(len(parts[0]))
        ]

    # --- insertion ------------------------------------------------------------------------------
    def insert(self, namespace: Hashable, ids: Sequence[int], model: str, kv: Segments) -> int:
        """Record ``model``'s KV for the prefix ``ids`` (kv covers at least len(ids) positions).

        Only positions the tree does not hold yet are copied; host nodes on the path come back to
        the device (the call that saves them has just used them). Returns the number of new
        positions. Then evicts least recently used nodes until the budgets hold.
        """
        with self.lock:
            root = self.roots.get(namespace)
            if root is None:
                root = self.roots[namespace] = Node(namespace=namespace)
            node, pos, added = root, 0, 0
            tick = next(self.clock)
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:
                    if node is not root and model not in node.kv:
                        break  # invariant: a model's KV never starts below the root
                    child = Node(key=tuple(ids[pos:]), parent=node, tier=self.device)
                    node.children[ids[pos]] = child
                    self._update_evictable(child)
                    self._update_evictable(node)
                n = _shared(child.key, ids, pos)
                if n < len(child.key):
                    child = self._split(child, n)
                if child.tier is self.host:
                    self._load_back([child])
                if model not in child.kv:
                    child.kv[model] = self.device.slice(kv, pos, pos + n)
                    self.device.bytes_used += segment_bytes(child.kv[model])
                    added += n
                child.last_access = tick
                node, pos = child, pos + n
            self._evict()
            if not root.children:  # nothing inserted (no ids), or this namespace was evicted whole
                self._drop_root(root)
            return added

    def _split(self, node: Node, n: int) -> Node:
        """Split node's edge after n tokens; return the new upper node (holding the first n)."""
        assert node.tier is not None and node.parent is not None
        upper = Node(key=node.key[:n], parent=node.parent, tier=node.tier, last_access=node.last_access)
        upper.lock_ref = node.lock_ref
        for m, seg in node.kv.items():
            upper.kv[m] = node.tier.slice(seg, 0, n)
            node.kv[m] = node.tier.slice(seg, n, len(node.key))
        node.parent.children[node.key[0]] = upper
        node.key = node.key[n:]
        node.parent = upper
        upper.children[node.key[0]] = node
        self._update_evictable(upper)
        return upper

    # --- eviction -------------------------------------------------------------------------------
    def _evict(self) -> None:
        """Move least recently used device nodes to the host tier until the device budget holds,
        then drop least recently used host leaves until the host budget holds."""
        self._shrink(self.device, self._demote)
        self._shrink(self.host, self._remove)

    def _shrink(self, tier: Tier, out) -> None:
        """Apply ``out`` (demote or remove) to ``tier``'s least recently used evictable nodes until
        its budget holds.

        As SGLang's ``RadixCache.evict``: a heap of the evictable nodes by last access; a parent
        that becomes evictable joins it. Nothing else touches the tree meanwhile (the lock is held),
        so no entry goes stale. Accesses stamp one path at a time, and no two of a tier's
        evictable nodes lie on one path, so no two share a time: the order is by ``last_access``.
        """
        if tier.bytes_used <= tier.budget:
            return
        heap = [(nd.last_access, id(nd), nd) for nd in tier.evictable]
        heapq.heapify(heap)
        while tier.bytes_used > tier.budget and heap:
            _, _, victim = heapq.heappop(heap)
            parent = victim.parent
            out(victim)
            if parent is not None and parent in tier.evictable:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        # what is left over budget is in use: it goes when released, or when the next insert runs

    def _demote(self, node: Node) -> None:
        """Move a device node to the host tier; drop it when it is a leaf the host could not hold."""
        if not node.children and node.nbytes > self.host.budget:
            self._remove(node)
            return
        self._move(node, self.host)
        self.demotions += 1

    def _remove(self, node: Node) -> None:
        assert node.parent is not None and not node.children and node.tier is not None
        parent = node.parent
        del parent.children[node.key[0]]
        for tier in self.tiers:
            tier.evictable.discard(node)
        self._update_evictable(parent)
        node.tier.bytes_used -= node.nbytes
        self.evictions += 1
        node.kv.clear()
        if parent.parent is None and not parent.children:  # the namespace's last entry
            self._drop_root(parent)

    def _drop_root(self, root: Node) -> None:
        if self.roots.get(root.namespace) is root:
            del self.roots[root.namespace]

    def drop(self, namespace: Hashable) -> None:
        """Drop every unlocked entry of ``namespace`` (and its root, once it holds none)."""
        with self.lock:
            root = self.roots.get(namespace)
            if root is None:
                return
            stack, leaves = list(root.children.values()), []
            while stack:  # children before parents: each is a leaf when its turn comes
                nd = stack.pop()
                leaves.append(nd)
                stack.extend(nd.children.values())
            for nd in reversed(leaves):
                if nd.lock_ref == 0 and not nd.children:
                    self._remove(nd)

    def evict_all(self) -> None:
        """Drop every unlocked entry (e.g. to free memory before retrying after an OOM)."""
        with self.lock:
            budgets = self.device.budget, self.host.budget
            self.device.budget = self.host.budget = 0
            self._shrink(self.host, self._remove)  # first, so device leaves are dropped, not moved
            self._evict()
            self.device.budget, self.host.budget = budgets

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            nd = stack.pop()
            yield nd
            stack.extend(nd.children.values())

    def __len__(self) -> int:
        with self.lock:
            return sum(1 for _ in self._nodes())

    def within_budgets(self) -> bool:
        """Whether each tier's bytes are within its budget but for the nodes lookups hold now: the
        docstring's budget invariant, for a tree in use (``check`` asserts all of them on an idle one)."""
        with self.lock:
            held = {id(t): 0 for t in self.tiers}
            for nd in self._nodes():
                if nd.lock_ref:
                    held[id(nd.tier)] += nd.nbytes
            return all(t.bytes_used <= t.budget + held[id(t)] for t in self.tiers)

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        with self.lock:
            totals = {id(t): 0 for t in self.tiers}
            for ns, root in self.roots.items():
                assert root.children and root.namespace == ns, f"{ns=} {len(root.children)=}"
            for nd in self._nodes():
                assert nd.tier in self.tiers, f"{nd.tier=}"
                assert nd.parent is not None
                for m, seg in nd.kv.items():
                    for k, v in seg:
                        assert k.shape[2] == v.shape[2] == len(nd.key), f"{k.shape=} {len(nd.key)=}"
                        if nd.tier is self.host:  # the device tier keeps the models' own device
                            assert self.host.holds(k) and self.host.holds(v), f"{k.device=}"
                            assert k.is_pinned() == v.is_pinned() == self.host.pinned, f"{k.is_pinned()=}"
                    if nd.parent.parent is not None:  # parent is not a root
                        assert m in nd.parent.kv, f"model {m!r} KV starts below the root"
                if nd.tier is self.device and nd.parent.parent is not None:
                    assert nd.parent.tier is self.device, "a device node below a host node"
                assert nd.lock_ref >= 0
                totals[id(nd.tier)] += nd.nbytes
            for tier in self.tiers:
                total = totals[id(tier)]
                assert total == tier.bytes_used, f"{tier.name}: {total=} {tier.bytes_used=}"
                expect = {
                    nd
                    for nd in self._nodes()
                    if nd.tier is tier
                    and nd.lock_ref == 0
                    and not any(c.tier is tier for c in nd.children.values())
                }
                assert expect == tier.evictable, f"{tier.name}: {len(expect)=} {len(tier.evictable)=}"


def _shared(key: tuple[int, ...], ids: Sequence[int], pos: int) -> int:
    """How many tokens of key equal ids[pos:]."""
    n = min(len(key), len(ids) - pos)
    i = 0
    while i < n and key[i] == ids[pos + i]:
        i += 1
    return i
