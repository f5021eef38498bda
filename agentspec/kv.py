"""A model's KV cache together with the token ids it covers.

Invariant (asserted): ``cache.get_seq_length() == len(ids) + unread``. Roll-back is one call to
``truncate``; ``sync`` crops to the longest common prefix with a new sequence, so a state that is
reused across steps (or calls) only ever re-reads the tokens that changed.

Host syncs: ids go to the device without the host waiting (``to_device``), and a pass may be fed
tokens that are still on the device (``PassIds``: a draft model's tokens, which the verification
reads back once, with its own result). Their positions are ``unread`` until ``settle`` names them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# A CPU pass over 2..FEW_ROWS new tokens computes its large float32 linears weight-first
# (``PassLinears``): those whose weight holds at least MIN_WEIGHT_BYTES (more than CPU caches hold).
FEW_ROWS = 64
MIN_WEIGHT_BYTES = 16 << 20
WEIGHT_FIRST_DTYPES = {torch.float32}
# bfloat16 CPU linears get a prepacked oneDNN copy of their weight while the copies take at most this
# share of the host's available memory at load (``PassLinears``)
PACKED_MEMORY_SHARE = 0.25
# float32 CPU linears get one too from this size: below it F.linear's kernel is as fast or faster at one
# row and the packed one no faster at a few (linears_by_size in benchmarks/results/verify_cost_packed.json);
# a 1.27 MiB projection packed made whole passes 3-5% faster (bench_pass's "packed from 2 MiB" variant)
MIN_PACKED_FLOAT32_BYTES = 1 << 20
# The most new rows a bfloat16 CPU pass computes each exactly as a one-row pass does (``PackedWeight``,
# ``attention.row_by_row``): a verify pass's (the last verified token and its drafts); a prefill,
# chunked or not, is not held to it
INVARIANT_ROWS = 32
# The row counts ``PackedWeight.fit`` tries padding a product to, before cutting the weight: a decode
# pass is bound by reading its weights, so a few more rows cost it little
PADS = (1, 2, 4, 8)
# A packed weight is cut along its inputs into pieces at least this wide (``PackedWeight.invariant``):
# narrower, the kernel's own blocking is not what orders the sums, and rows go one by one instead
MIN_PIECE = 256
# ``PackedWeight.fit`` checks a shape's way on a probe of at most this many outputs. How the kernel
# orders one output's sum depends on the number of outputs too (on an AMD EPYC, 1,536 inputs: 576 and
# 4,096 outputs summed differently), but not past a few thousand there (4,096 to 32,768, at every
# width measured, 576 to 3,584); a 49,152-output probe took 0.55 s of a 1 s load. Four times that,
# for CPUs whose caches are larger.
CHECK_OUTPUTS = 16384
# The probe's rows (``_order_probe``): a few distinct ones, repeated (the kernel's order follows the
# shapes, not the values), each holding a pair of terms this large that cancel within each piece
DISTINCT_ROWS = 4
PROBE_BIG = 2.0**20


def final_norm(model) -> torch.nn.Module:
    """The model's final norm: its output is the hidden state an EAGLE head reads."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ValueError(
            f"{type(model).__name__}: no final norm (model.norm) to read hidden states from; an EAGLE "
            "draft needs a decoder-only model with one"
        )
    return norm


@contextmanager
def final_hidden(model) -> Iterator[list[torch.Tensor]]:
    """Within the block, the model's passes append their final-norm output [B, T, H] to the list."""
    captured: list[torch.Tensor] = []
    hook = final_norm(model).register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        yield captured
    finally:
        hook.remove()


def _weight_first(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if not 2 <= rows.shape[0] <= FEW_ROWS:
        return torch.nn.functional.linear(x, linear.weight, linear.bias)
    out = (linear.weight @ rows.T).T.contiguous()
    if linear.bias is not None:
        out += linear.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Batcher(Protocol):
    """Runs the ``ModelState.forward`` calls of several threads together (``agentspec.packed.Rendezvous``)."""

    def forward(self, state: ModelState, new: PassIds, keep: int, hidden: bool) -> Any:
        """``state.forward_now(new, keep, hidden)``'s result, computed in one pass with the other
        threads' calls."""
        ...


# Set around a scheduler's drafting, in each drafting thread: that thread's ModelState passes go through it
_BATCHER: ContextVar[Batcher | None] = ContextVar("agentspec_batcher", default=None)


@contextmanager
def batching(batcher: Batcher) -> Iterator[None]:
    """Within the block, this thread's ``ModelState.forward`` calls run through ``batcher``."""
    token = _BATCHER.set(batcher)
    try:
        yield
    finally:
        _BATCHER.reset(token)


# The new rows of this thread's agentspec pass (set by ModelState.forward and the packed pass, in
# their own thread and task only); 0 outside one
_PASS_ROWS: ContextVar[int] = ContextVar("agentspec_pass_rows", default=0)


def _pass_forward(linear: torch.nn.Linear, packed: PackedWeight | None, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, except inside an agentspec pass (``PassLinears``)."""
    rows = _pass_rows()
    if rows and packed is not None:
        return packed(x, linear.bias)
    if 2 <= rows <= FEW_ROWS and packed is None:
        return _weight_first(linear, x)
    return torch.nn.functional.linear(x, linear.weight, linear.bias)


class PackedWeight:
    """A linear's weight in oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, as
    torch.compile's CPU backend packs frozen weights). In bfloat16, the product is computed so that
    each of up to INVARIANT_ROWS rows gets a one-row product's bits, on this CPU, checked when packed
    (``fit``); a float32 one is packed as it is (``PassLinears``: no float32 pass is held to that).

    Why: oneDNN's bf16 kernels accumulate in float32, but how they block the inputs' dimension
    depends on the row count, the output count and the CPU (its caches, its ISA): past some width
    (1,024 inputs on an Intel Xeon with AVX-512 BF16; 1,152 on an AMD EPYC) a several-row product
    sums in another order than a one-row one, and bfloat16's rounding turns that into other logits,
    so speculative decoding would leave plain decoding's tokens at near-ties. PyTorch has no switch
    for the order, so ``fit`` measures it and takes the first way that holds, cheapest first:

    - ``pad``: a product of fewer rows is computed padded with zero rows to ``pad`` rows, so that a
      one-row step runs the kernel that several rows run (on the AMD EPYC, 1 row sums in one order
      and 2 to 64 rows in another); a decode pass reads its weights once whatever its few rows, so
      this costs little (1 is the whole weight as it is);
    - ``pieces``: the weight cut along its inputs into pieces of equal width, each a product narrow
      enough to be row-invariant, chained by the kernel's own add post-op (each piece's sum is added
      in float32 to the previous pieces' bfloat16 result: one more rounding a piece; a one-row product
      costs about twice the whole weight's);
    - ``rowwise``: each row its own one-row product.
    """

    def __init__(self, weight: torch.Tensor, pieces: int = 1, pad: int = 1, rowwise: bool = False):
        self.way = (pieces, pad, rowwise)  # what ``fit`` found, to pack another weight of the shape so
        self.pad, self.rowwise = pad, rowwise
        self.bounds = _pieces(weight.shape[1], pieces)
        with torch.no_grad():
            self.blocks = [
                torch.ops.mkldnn._reorder_linear_weight(weight.detach()[:, a:b].contiguous(), max(pad, 1))
                for a, b in self.bounds
            ]  # the rows the kernel is packed for: a one-row pass's

    @classmethod
    def fit(cls, weight: torch.Tensor) -> PackedWeight:
        """The first way (see the class doc) whose rows this CPU computes as one-row products."""
        n, k = weight.shape
        ways = [(1, pad, False) for pad in PADS]
        ways += [(pieces, 1, False) for pieces in range(2, k // MIN_PIECE + 1)]
        for way in ways:
            probe, rows = _order_probe(min(n, CHECK_OUTPUTS), _pieces(k, way[0]))
            if cls(probe, *way).invariant(rows):
                return cls(weight, *way)
        return cls(weight, rowwise=True)

    def invariant(self, rows: torch.Tensor) -> bool:
        """Whether every product of 2..INVARIANT_ROWS rows gives each row a one-row product's bits, on
        ``rows`` ([DISTINCT_ROWS, in]) repeated (row i is ``rows[i % DISTINCT_ROWS]``)."""
        one = torch.cat([self(rows[i : i + 1], None) for i in range(len(rows))])
        reps = -(-INVARIANT_ROWS // len(rows))
        x, expected = rows.repeat(reps, 1), one.repeat(reps, 1)
        return all(torch.equal(self(x[:m], None), expected[:m]) for m in range(2, INVARIANT_ROWS + 1))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # oneDNN's rows: every leading dimension's
        rows = len(flat)
        if self.rowwise and 1 < rows <= INVARIANT_ROWS:
            y = torch.cat([self._product(flat[i : i + 1], bias) for i in range(rows)])
        elif rows < self.pad:
            y = self._product(torch.nn.functional.pad(flat, (0, 0, 0, self.pad - rows)), bias)[:rows]
        else:
            y = self._product(flat, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def one_call(self, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A float32 product as one kernel call over any leading dimensions: ``__call__``'s result
        without its checks and reshapes, for a caller that is only ever inside a pass
        (``lean.LeanForward.bind``). None for a bfloat16 one: its rows keep the path ``fit`` checked."""
        if self.blocks[0].dtype != torch.float32 or self.way != (1, 1, False):  # one whole block
            return None
        return partial(_packed_linear, weight=self.blocks[0], bias=bias)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(self.blocks) == 1:
            return _packed_linear(x, self.blocks[0], bias)
        (a, b), first = self.bounds[0], self.blocks[0]
        y = torch.ops.mkldnn._linear_pointwise(x[..., a:b].contiguous(), first, bias, "none", [], "")
        for (a, b), block in zip(self.bounds[1:], self.blocks[1:], strict=True):
            y = torch.ops.mkldnn._linear_pointwise.binary(x[..., a:b].contiguous(), y, block, None, "add")
        return y


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x``'s product with a packed ``weight`` over all of its leading dimensions (the kernel folds them)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pieces(k: int, pieces: int) -> list[tuple[int, int]]:
    """The bounds of ``pieces`` equal slices of ``k`` inputs (the last one shorter)."""
    width = -(-k // pieces)
    return [(a, min(a + width, k)) for a in range(0, k, width)]


def _order_probe(n: int, bounds: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [n, in] and DISTINCT_ROWS rows [DISTINCT_ROWS, in], bfloat16, whose products show
    any change in the order of a piece's sums (``PackedWeight.invariant``).

    Random ones rarely do: two orders' float32 sums differ in their last bits, which the bfloat16
    output mostly rounds away (on random rows a 576-output, 2-row product showed none of the orders
    the embedded model's runs told apart). So each piece opens with PROBE_BIG against a weight of 1
    and closes with PROBE_BIG against -1: the two cancel, while every term between them is added to
    a sum of PROBE_BIG's size and rounded at its float32 spacing (1/8). Another grouping rounds
    other sums there, which moves the result, of the small terms' size (~sqrt(in)), by more than
    its bfloat16 spacing; the same order gives the same bits.
    """
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, bounds[-1][1], generator=gen)
    rows = torch.randn(DISTINCT_ROWS, bounds[-1][1], generator=gen)
    for a, b in bounds:
        weight[:, a], weight[:, b - 1] = 1.0, -1.0
        rows[:, a] = rows[:, b - 1] = PROBE_BIG
    return weight.to(torch.bfloat16), rows.to(torch.bfloat16)


class PassLinears:
    """The CPU linears of a pair's models, computed in agentspec's own passes the way this CPU runs
    them fastest; every other caller gets ``F.linear``, exactly ``nn.Linear``'s own.

    - **float32, weight-first**: ``F.linear`` computes ``x @ W.T``. On a CPU, for a few rows against
      a weight larger than the caches (an LM head; every projection of a 7B model), that kernel runs
      2-4x slower than for one row, while ``W @ x.T`` costs little more than one row
      (``benchmarks/bench_verify_cost.py``). A verify pass has 2-17 rows, so this is much of its extra
      cost. Same product, another summation order; one-row passes (plain decoding) and prefills keep
      ``F.linear``. Linears whose weight holds at least MIN_WEIGHT_BYTES.
    - **bfloat16, prepacked**: ``F.linear`` in bfloat16 hands oneDNN the weight in its plain layout on
      every call; oneDNN's own blocked layout, made once here (``mkldnn._reorder_linear_weight``, as
      torch.compile's CPU backend does when it freezes weights), computes the same product with the
      CPU's bf16 instructions at 1.1-1.6x the speed over 1-17 rows (``benchmarks/bench_pass.py``).
      The packed copy doubles those weights' memory, so it is made only while the copies fit in
      PACKED_MEMORY_SHARE of the host's available memory (a 7B model's 14 GB mostly would not).
      Each shape is packed the way that gives a verify pass's rows one-row products' bits on this
      CPU (``PackedWeight.fit``); ``row_invariant`` says whether every linear of the models is.
    - **float32, prepacked**: the same layout reads a float32 weight past the caches 1.3-2x faster than
      ``F.linear`` at 1-17 rows, and faster than weight-first at 2-17; so float32 linears of at least
      MIN_PACKED_FLOAT32_BYTES pack too, within the same memory share, as they are (a pass's rows sum in
      another order than a one-row pass's, as weight-first's do). Weight-first is what a large float32
      linear gets past the share.

    Decided once, when the pair is built: each plain ``nn.Linear`` taking a path gets an instance
    ``forward`` that is ``F.linear`` unless its thread is inside an agentspec pass (``pass_rows``). So
    any other caller (transformers' ``generate()``, another thread, a user's own code) gets the numbers
    it got before, even while a pass runs on the same model; what is left in a model passed in is that
    instance attribute. PyTorch has no switch for the product order or layout, and a
    ``TorchFunctionMode`` doing this costs more in Python dispatch than it saves. A module with an
    instance ``forward`` already (accelerate's hooks, or this one from an earlier pair of the same
    model) keeps it; a linear put into a model later keeps ``F.linear`` (only speed is lost).
    """

    def __init__(self, *models: torch.nn.Module, skip: Iterable[torch.nn.Module] = ()):
        self.linears: list[torch.nn.Linear] = []  # those given the forward here
        self.packed_bytes = 0  # held by the prepacked copies
        # whether every linear the models' passes compute is a PackedWeight, whose rows are one-row
        # products' bits (``row_invariant``)
        self.row_invariant = True
        self._fits: dict[tuple[int, int], tuple[int, int, bool]] = {}  # (out, in): PackedWeight.way
        budget = _available_memory() * PACKED_MEMORY_SHARE
        skipped = {id(m) for m in skip}  # never called in a pass (``lean.LeanForward.replaced``)
        for model in models:
            for m in model.modules():
                if not isinstance(m, torch.nn.Linear) or id(m) in skipped:
                    continue
                if type(m) is not torch.nn.Linear or "forward" in vars(m):
                    self.row_invariant &= _packed_here(m)  # else its own forward: not ours to make invariant
                    continue
                packed = _packable(m) and self.packed_bytes + _nbytes(m.weight) <= budget
                # F.linear, weight-first and an unfitted float32 pack sum rows in the kernel's order
                self.row_invariant &= packed and m.weight.dtype != torch.float32
                if packed:
                    m.forward = partial(_pass_forward, m, self._packed(m.weight))
                    self.packed_bytes += _nbytes(m.weight)
                elif _large(m):
                    m.forward = partial(_pass_forward, m, None)
                else:
                    continue
                self.linears.append(m)

    def product(self, linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        """What an agentspec pass computes for ``linear``, for a caller only ever inside one (the lean
        forward): its packed weight's kernel, called directly where that is one call
        (``PackedWeight.one_call``), else ``through_forward``."""
        packed = _pass_weight(linear)
        call = packed.one_call(linear.bias) if packed is not None else None
        return call if call is not None else through_forward(linear)

    def _packed(self, weight: torch.Tensor) -> PackedWeight:
        """``weight`` packed the way ``PackedWeight.fit`` found for its shape (checked once a shape)."""
        if weight.dtype == torch.float32:
            return PackedWeight(weight)
        shape = (weight.shape[0], weight.shape[1])
        if shape in self._fits:
            return PackedWeight(weight, *self._fits[shape])
        fitted = PackedWeight.fit(weight)
        self._fits[shape] = fitted.way
        return fitted


def through_forward(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """``linear`` computed through its forward as it is at each call: the path a pair's PassLinears
    gives it, a later pair's on a copy of the model too."""
    return partial(_forward, linear)


def _forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear.forward(x)


def _pass_weight(linear: torch.nn.Linear) -> PackedWeight | None:
    """The PackedWeight ``linear`` runs in passes (given by ``PassLinears``, here or for an earlier pair
    on its model), or None."""
    forward = vars(linear).get("forward")
    return forward.args[1] if isinstance(forward, partial) and forward.func is _pass_forward else None


def _packed_here(linear: torch.nn.Linear) -> bool:
    """Whether ``linear`` runs a PackedWeight in passes (given one by an earlier pair on its model)."""
    return _pass_weight(linear) is not None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _large(linear: torch.nn.Linear) -> bool:
    w = linear.weight
    return _nbytes(w) >= MIN_WEIGHT_BYTES and w.device.type == "cpu" and w.dtype in WEIGHT_FIRST_DTYPES


def _packable(linear: torch.nn.Linear) -> bool:
    """A bfloat16 CPU linear, on a CPU with bf16 instructions (oneDNN would emulate them elsewhere),
    or a float32 one of at least MIN_PACKED_FLOAT32_BYTES."""
    w = linear.weight
    if w.device.type != "cpu":
        return False
    if w.dtype == torch.float32:
        return _nbytes(w) >= MIN_PACKED_FLOAT32_BYTES
    return w.dtype == torch.bfloat16 and cpu_has_bf16()


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX-512 BF16; AMX CPUs have them too). torch
    exposes it only privately, as torch.compile's CPU backend reads it."""
    return torch.cpu._is_avx512_bf16_supported()


def _available_memory() -> int:
    """Bytes of host memory available now (Linux's MemAvailable; total physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _pass_rows() -> int:
    """The new rows of this thread's agentspec pass (``pass_rows``); 0 outside one, and in a compiled
    step (``agentspec.static_kv``), which keeps F.linear: a ContextVar read breaks its graph."""
    return 0 if torch.compiler.is_compiling() else _PASS_ROWS.get()


def in_pass() -> bool:
    """Whether this thread is inside an agentspec pass (``pass_rows``)."""
    return _pass_rows() > 0


@contextmanager
def pass_rows(rows: int) -> Iterator[None]:
    """Within the block, this thread runs an agentspec pass over ``rows`` new tokens: its
    ``PassLinears`` take their pass paths."""
    token = _PASS_ROWS.set(rows)
    try:
        yield
    finally:
        _PASS_ROWS.reset(token)


def common_prefix_len(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, given that their first ``start``
    entries are known to agree (only the rest is compared: O(new tokens), not O(context))."""
    n = min(len(a), len(b))
    i = min(start, n)
    if a[i:n] == b[i:n]:  # the usual case, compared in C
        return n
    while i < n and a[i] == b[i]:
        i += 1
    return i


def to_device(ids: list[int], device: torch.device) -> torch.Tensor:
    """ids [n] as a long tensor on ``device``, copied without making the host wait.

    On CUDA the ids are staged in pinned host memory and copied with ``non_blocking=True`` (a copy
    from pageable memory blocks until it is done); PyTorch's pinned allocator keeps the staging
    buffer until the copy has run. Elsewhere a plain tensor.
    """
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long, device=device)
    staged = torch.tensor(ids, dtype=torch.long).pin_memory()
    return staged.to(device, non_blocking=True)


@dataclass(frozen=True)
class PassIds:
    """A pass's new tokens: ``host`` ids, then ``device`` ids [k] still on the model's device.

    A draft model's tokens stay on the device while it drafts and while the target verifies them;
    their values come back with the verification's one read. ``list + PassIds`` prepends host ids
    (a retried pass feeds the covered ids again before the same new tokens).
    """

    host: list[int]
    device: torch.Tensor | None = None  # [k] long

    def __len__(self) -> int:
        return len(self.host) + (0 if self.device is None else self.device.shape[0])

    def __radd__(self, ids: list[int]) -> PassIds:
        return PassIds(ids + self.host, self.device)

    def tensor(self, device: torch.device) -> torch.Tensor:
        """All the ids as one [1, n] long tensor on ``device``."""
        parts = [to_device(self.host, device)] if self.host else []
        if self.device is not None:
            parts.append(self.device.to(device=device, dtype=torch.long).reshape(-1))
        return (parts[0] if len(parts) == 1 else torch.cat(parts))[None]


Segments = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, n, D]


def cache_segments(cache: Any, length: int) -> Segments:
    """The first ``length`` positions' keys and values of each layer of a transformers cache (views)."""
    return [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in cache.layers]


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` with its keys and values in buffers it grows: a pass writes its
    rows in place, where ``DynamicLayer.update`` copies the whole layer with ``torch.cat`` (15% of a
    float32 one-row step after 400 tokens on a CPU, issue 28), and a roll-back moves the length.

    ``keys``/``values`` stay views of the first ``length`` rows, so every reader of a
    ``DynamicLayer`` (transformers, ``cache_segments``, the prefix cache, which copies what it saves)
    reads them as before. Adopted tensors (``adopt``: a prefix-cache restore's, the tree's own) are
    never written: the first update copies them into a buffer of the layer's own. Buffers grow by
    half again what is needed, so a call's appends copy its cache a logarithmic number of times, and
    hold whole key blocks (``blocks``), their memory untouched until written or read.
    """

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None  # [B, H, capacity, D], the layer's own
        self._v: torch.Tensor | None = None
        self._clean = 0  # the buffers' positions before this hold values: written, or zeroed (``blocks``)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys``/``values`` (not copied; never written) as the cached positions."""
        self.lazy_initialization(keys, values)
        self.keys, self.values, self._k, self._v = keys, values, None, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        need = held + key_states.shape[-2]
        if self._k is None or need > self._k.shape[-2]:
            self._grow(need, key_states, value_states)
        self._k[:, :, held:need] = key_states
        self._v[:, :, held:need] = value_states
        self._clean = max(self._clean, need)
        self.keys, self.values = self._k[:, :, :need], self._v[:, :, :need]
        return self.keys, self.values

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, n, D] through the end of the ``KEY_BLOCK`` that holds the last cached
        position (``attention.blocked_attention``). Past the cached length they hold what a pass wrote
        before a roll-back, or zeros: finite values, which a mask hides (never the buffer's unwritten
        memory: a NaN there would survive the mask, as 0 x NaN is NaN). Only after an update."""
        end = round_up(self.get_seq_length(), KEY_BLOCK)
        if end > self._clean:  # zeroed here, not when allocated: only the blocked path reads past the length
            self._k[:, :, self._clean : end].zero_()
            self._v[:, :, self._clean : end].zero_()
            self._clean = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def _grow(self, need: int, k: torch.Tensor, v: torch.Tensor) -> None:
        capacity = round_up(need + need // 2, KEY_BLOCK)
        held = self.get_seq_length()
        new_k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
        new_v = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
        if held:
            new_k[:, :, :held] = self.keys
            new_v[:, :, :held] = self.values
        self._k, self._v, self._clean = new_k, new_v, held
        self.keys, self.values = new_k[:, :, :held], new_v[:, :, :held]

    def reset(self) -> None:
        self._k = self._v = None
        self._clean = 0
        super().reset()


# A layer's buffer holds whole blocks of this many keys: the block SDPA's CPU kernel splits keys
# into, over which ``attention.blocked_attention`` attends (``GrowingLayer.blocks``)
KEY_BLOCK = 512


def round_up(n: int, block: int) -> int:
    """``n`` rounded up to a whole number of ``block``s."""
    return -(-n // block) * block


def growing_cache(config: Any) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``config``, its plain layers ``GrowingLayer``s (a sliding
    window's or any other kind stay transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class KVState(Protocol):
    """A model's KV state as the prefix cache reads it (``ModelState``, ``static_kv.StaticState``)."""

    model: Any
    ids: list[int]  # the ids whose keys and values it holds

    @property
    def reusable(self) -> bool:
        """Every layer keeps every position of ``ids`` as plain keys and values: a prefix of it can
        be saved and restored (a sliding window, a linear-attention state or a quantized form cannot)."""
        ...

    def segments(self, length: int) -> Segments:
        """The first ``length`` positions' keys and values, per layer (views, not copies)."""
        ...


class ModelState:
    """One model's DynamicCache and the ids whose keys and values it holds.

    The last ``unread`` cached positions were fed from the device (``PassIds.device``): their ids
    are not in ``ids`` until ``settle`` gives them; ``truncate`` and ``sync`` roll them back.
    """

    def __init__(self, model, cache: DynamicCache | None = None, ids: list[int] | None = None):
        self.model = model
        self.cache = cache if cache is not None else growing_cache(model.config)
        self.ids: list[int] = list(ids or [])
        self.unread = 0  # cached positions after ``ids`` whose ids are still on the device
        self.check()

    def check(self) -> None:
        n_cache = self.cache.get_seq_length()
        assert n_cache == len(self.ids) + self.unread, (
            f"KV cache out of step: {n_cache=} {len(self.ids)=} {self.unread=}"
        )

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens of ``ids`` (roll back the rest, unread ones too)."""
        length = min(length, len(self.ids))
        extra = len(self.ids) + self.unread - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.x: a negative count removes that many
            del self.ids[length:]
            self.unread = 0
        self.check()

    def settle(self, ids: list[int]) -> None:
        """The first unread positions hold ``ids`` (read back after the pass): they join ``ids``;
        the unread positions after them are rolled back."""
        assert len(ids) <= self.unread, f"{len(ids)=} {self.unread=}"
        extra = self.unread - len(ids)
        if extra:
            self.cache.crop(-extra)
        self.ids.extend(ids)
        self.unread = 0
        self.check()

    def sync(self, seq: list[int], start: int = 0, end: int | None = None) -> list[int]:
        """Roll back to the longest common prefix with ``seq[:end]``; return the ids still to feed.

        ``start``: how many leading ids the caller knows already agree with ``seq`` (a drafter's
        count of verified ones: the verified sequence only grows within a call), so a pass
        compares only the tokens after them.
        """
        end = len(seq) if end is None else end
        self.truncate(min(common_prefix_len(self.ids, seq, start), end))
        return seq[len(self.ids) : end]

    def forward(self, new_ids: list[int] | PassIds, keep: int, hidden: bool = False):
        """Feed ``new_ids`` after the cached ones; return the last ``keep`` logits rows [keep, V].

        ``PassIds`` with device ids: those positions are ``unread`` after the pass (no host read).
        With ``hidden``, return (logits, the final norm's output for ``new_ids`` [len(new_ids), H]):
        the features an EAGLE head drafts from (``agentspec.drafters.eagle``). In a thread that a
        scheduler drafts in (``batching``), the pass is shared with the other drafting threads'.
        """
        new = new_ids if isinstance(new_ids, PassIds) else PassIds(new_ids)
        batcher = _BATCHER.get()
        if batcher is not None:
            return batcher.forward(self, new, keep, hidden)
        return self.forward_now(new, keep, hidden)

    @torch.inference_mode()
    def forward_now(self, new: PassIds, keep: int, hidden: bool = False):
        """``forward``, in a pass of its own."""
        assert len(new), "forward needs at least one new token"
        assert not (self.unread and new.host), "host ids cannot follow unread positions: settle first"
        x = new.tensor(self.model.device)
        held = len(self.ids) + self.unread
        try:
            with ExitStack() as stack:
                stack.enter_context(pass_rows(len(new)))
                captured = stack.enter_context(final_hidden(self.model)) if hidden else None
                out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep)
        except BaseException:
            self._roll_back(held)
            raise
        self.advance(new)
        if captured is not None:
            return out.logits[0, -keep:], captured[-1][0, -len(new) :]
        return out.logits[0, -keep:]

    def advance(self, new: PassIds) -> None:
        """A pass fed ``new`` after the cached positions (this state's own, or a packed one): its
        host ids join ``ids``, its device ids are ``unread``."""
        self.ids.extend(new.host)
        self.unread += len(new) - len(new.host)
        self.check()

    @property
    def reusable(self) -> bool:
        # transformers declares no "keeps every position" capability: DynamicLayer itself is the
        # layer that does (and ours, growing in place); its other subclasses keep a window, an
        # indexer or a quantized form
        layers = self.cache.layers
        return bool(layers) and all(type(layer) in (DynamicLayer, GrowingLayer) for layer in layers)

    def segments(self, length: int) -> Segments:
        return cache_segments(self.cache, length)

    def take(self, state: ModelState) -> ModelState:
        """The state to continue from after a prefix-cache restore gave ``state``: that one itself
        (a preallocated ``StaticState`` copies it into its own buffers instead)."""
        return state

    def _roll_back(self, held: int) -> None:
        """Undo a failed pass, which may have extended some layers only: each layer is cropped back to
        the ``held`` positions it had, so a retry feeds only that pass's tokens again (on an
        out-of-memory error, ``agentspec.memory``). A cache that cannot be cropped starts clean."""
        try:
            for layer in self.cache.layers:
                extra = layer.get_seq_length() - held  # the tensor's shape: no read of its values
                if extra > 0:
                    layer.crop(-extra)  # transformers 5.x: a negative count removes that many
            self.check()
        except Exception:
            self.reset()

    def reset(self) -> None:
        self.cache = growing_cache(self.model.config)
        self.ids = []
        self.unread = 0
