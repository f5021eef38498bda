"""The linears of agentspec's own forward (``agentspec.lean``), computed the way this CPU runs them fastest.

``PassLinears`` decides, once per pair, what computes each linear the lean forward runs: a prepacked
oneDNN weight (``PackedWeight``), a weight-first product, or ``F.linear``. The decision is data (a
product per linear, ``PassLinears.product``) that the forward binds when it is built: no module of
the model is changed, so ``generate()``, a user's own calls, ``copy.deepcopy`` and
``save_pretrained`` see the model as transformers built it. A model transformers' forward runs (a
family ``agentspec.lean`` does not cover) computes ``F.linear`` everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F

# A CPU pass over 2..FEW_ROWS new tokens computes its large float32 linears weight-first
# (``PassLinears``): those whose weight holds at least MIN_WEIGHT_BYTES (more than CPU caches hold).
FEW_ROWS = 64
MIN_WEIGHT_BYTES = 16 << 20
WEIGHT_FIRST_DTYPES = {torch.float32}
# bfloat16 CPU linears get a prepacked oneDNN copy of their weight while the copies take at most this
# share of the host's available memory at load (``PassLinears``)
PACKED_MEMORY_SHARE = 0.25
# float32 CPU linears get one too from this size: below it F.linear's kernel is as fast or faster at one
# row and the packed one no faster at a few, while packed projections from about a mebibyte made whole
# passes faster (docs/benchmarks.md, "Design probes": verify_cost; the pass suite's "packed from 2 MiB"
# variant)
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


def _weight_first(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if not 2 <= rows.shape[0] <= FEW_ROWS:
        return F.linear(x, linear.weight, linear.bias)
    out = (linear.weight @ rows.T).T.contiguous()
    if linear.bias is not None:
        out += linear.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


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
    """What agentspec's passes compute for each linear of a lean forward: the way this CPU runs it
    fastest, decided once when the pair is built (``product``).

    - **float32, weight-first**: ``F.linear`` computes ``x @ W.T``. On a CPU, for a few rows against
      a weight larger than the caches (an LM head; every projection of a 7B model), that kernel runs
      2-4x slower than for one row, while ``W @ x.T`` costs little more than one row
      (docs/benchmarks.md, "Design probes"). A verify pass has 2-17 rows, so this is much of its extra
      cost. Same product, another summation order; one-row passes (plain decoding) and prefills keep
      ``F.linear``. Linears whose weight holds at least MIN_WEIGHT_BYTES.
    - **bfloat16, prepacked**: ``F.linear`` in bfloat16 hands oneDNN the weight in its plain layout on
      every call; oneDNN's own blocked layout, made once here (``mkldnn._reorder_linear_weight``, as
      torch.compile's CPU backend does when it freezes weights), computes the same product with the
      CPU's bf16 instructions at 1.1-1.6x the speed over 1-17 rows (``python -m benchmarks pass``).
      The packed copy doubles those weights' memory, so it is made only while the copies fit in
      PACKED_MEMORY_SHARE of the host's available memory (a 7B model's 14 GB mostly would not).
      Each shape is packed the way that gives a verify pass's rows one-row products' bits on this
      CPU (``PackedWeight.fit``); ``row_invariant`` says whether every linear given here is.
    - **float32, prepacked**: the same layout reads a float32 weight past the caches 1.3-2x faster than
      ``F.linear`` at 1-17 rows, and faster than weight-first at 2-17; so float32 linears of at least
      MIN_PACKED_FLOAT32_BYTES pack too, within the same memory share, as they are (a pass's rows sum in
      another order than a one-row pass's, as weight-first's do). Weight-first is what a large float32
      linear gets past the share.

    PyTorch has no switch for the product order or layout, so the products are ours; the packed
    copies live here, owned by the pair, never on the model's modules.
    """

    def __init__(self, linears: Iterable[torch.nn.Linear]):
        self.packed_bytes = 0  # held by the prepacked copies
        # whether every linear given is a fitted PackedWeight, whose rows are one-row products' bits
        self.row_invariant = True
        self._fits: dict[tuple[int, int], tuple[int, int, bool]] = {}  # (out, in): PackedWeight.way
        self._products: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}  # by id(linear)
        self._packs: dict[int, PackedWeight] = {}  # by id(linear)
        budget = _available_memory() * PACKED_MEMORY_SHARE
        seen: set[int] = set()
        for m in linears:
            if id(m) in seen:  # a module two models share (a draft's head the target's)
                continue
            seen.add(id(m))
            packed = _packable(m) and self.packed_bytes + _nbytes(m.weight) <= budget
            # F.linear, weight-first and an unfitted float32 pack sum rows in the kernel's order
            self.row_invariant &= packed and m.weight.dtype != torch.float32
            if packed:
                weight = self._packed(m.weight)
                self._packs[id(m)] = weight
                self.packed_bytes += _nbytes(m.weight)
                self._products[id(m)] = weight.one_call(m.bias) or partial(weight, bias=m.bias)
            elif _large(m):
                self._products[id(m)] = partial(_weight_first, m)

    def product(self, linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        """What a pass computes for ``linear`` (x [..., in] -> [..., out]): its packed weight's kernel,
        called directly where that is one call (``PackedWeight.one_call``), weight-first for a large
        float32 one past the packed share, else ``F.linear`` (``plain``)."""
        return self._products.get(id(linear)) or plain(linear)

    def packed(self, linear: torch.nn.Linear) -> PackedWeight | None:
        """The packed copy ``linear`` runs in passes, or None."""
        return self._packs.get(id(linear))

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


def plain(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """``linear``'s own product, ``F.linear``: what ``nn.Linear.forward`` computes, without a module call."""
    return partial(_plain, linear)


def _plain(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, linear.weight, linear.bias)


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
