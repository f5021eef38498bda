"""``linears.PassLinears``: a lean forward's CPU passes compute float32 linears of at least
``linears.MIN_PACKED_FLOAT32_BYTES`` and bfloat16 ones (on a CPU with bf16 instructions) with a
prepacked oneDNN weight, and passes of a few rows compute large float32 linears left unpacked (past
the memory share) as ``W @ x.T``.

The product is the same (to float rounding); which linears take which path is decided once, when the
pair is built, as a product per linear that the lean forward binds; nothing is set on the modules, so
every other caller of the model gets ``F.linear``. That greedy decoding with it stays token-identical
to plain decoding is checked in test_equivalence.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import needs_bf16

from agentspec import kv, linears
from agentspec.models import ModelPair


def linear(n_out: int = 48, n_in: int = 16, bias: bool = True, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out, bias=bias).to(dtype)


def f_linear(lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, lin.weight, lin.bias)


@pytest.fixture
def every_weight_is_large(monkeypatch):
    monkeypatch.setattr(linears, "MIN_WEIGHT_BYTES", 0)


@pytest.fixture
def weight_first_calls(monkeypatch) -> list[int]:
    """The row counts of every weight-first product computed while the test runs (products bound after
    the fixture: a ``PassLinears`` built in the test)."""
    rows_seen: list[int] = []
    real = linears._weight_first
    monkeypatch.setattr(linears, "_weight_first", lambda m, x: rows_seen.append(x.shape[-2]) or real(m, x))
    return rows_seen


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (1, 3, 16), (1, 64, 16), (1, 65, 16), (2, 5, 16)])
def test_weight_first_computes_the_linear(shape, bias):
    lin = linear(bias=bias)
    x = torch.randn(shape)
    out = linears._weight_first(lin, x)
    assert out.shape == (*shape[:-1], 48) and out.is_contiguous()
    torch.testing.assert_close(out, f_linear(lin, x))


def test_large_linears_run_weight_first(monkeypatch, weight_first_calls):
    monkeypatch.setattr(linears, "MIN_WEIGHT_BYTES", 48 * 16 * 4)  # both weights hold 3,072 bytes
    monkeypatch.setattr(linears, "PACKED_MEMORY_SHARE", 0.0)  # nothing packed: weight-first past the share
    first, second = linear(), linear(16, 48)
    found = linears.PassLinears([first, second])
    x = torch.randn(4, 16)
    got = found.product(second)(found.product(first)(x))
    assert weight_first_calls == [4, 4]  # both linears
    torch.testing.assert_close(got, f_linear(second, f_linear(first, x)))
    assert torch.equal(first(x), f_linear(first, x)) and len(weight_first_calls) == 2  # the module: its own
    monkeypatch.setattr(linears, "MIN_WEIGHT_BYTES", 48 * 16 * 4 + 1)  # now neither is large
    small = linear()
    linears.PassLinears([small]).product(small)(x)
    assert len(weight_first_calls) == 2


@pytest.mark.parametrize("rows", [1, linears.FEW_ROWS + 1])
def test_one_row_passes_and_prefills_keep_f_linear(
    every_weight_is_large, weight_first_calls, monkeypatch, rows
):
    monkeypatch.setattr(linears, "PACKED_MEMORY_SHARE", 0.0)
    lin = linear()
    x = torch.randn(rows, 16)
    assert torch.equal(linears.PassLinears([lin]).product(lin)(x), f_linear(lin, x))
    assert weight_first_calls == [rows]  # asked, and it hands those row counts to F.linear


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 17, 100])
def test_bfloat16_linears_run_prepacked(rows):
    lin = linear(n_out=96, n_in=64, dtype=torch.bfloat16)
    found = linears.PassLinears([lin])
    assert found.packed(lin) is not None and found.packed_bytes == 96 * 64 * 2
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(found.product(lin)(x), f_linear(lin, x))  # another kernel, same product
    assert torch.equal(lin(x), f_linear(lin, x))  # the module: F.linear itself


@pytest.mark.parametrize("rows", [1, 5, 17, 100])
def test_float32_linears_from_their_size_run_prepacked(monkeypatch, weight_first_calls, rows):
    monkeypatch.setattr(linears, "MIN_PACKED_FLOAT32_BYTES", 96 * 64 * 4)
    monkeypatch.setattr(linears, "MIN_WEIGHT_BYTES", 0)  # packing comes first; weight-first is past the share
    lin, small = linear(n_out=96, n_in=64), linear(n_out=95, n_in=64)
    found = linears.PassLinears([lin, small])
    assert found.packed(lin) is not None and found.packed(small) is None
    assert found.packed_bytes == 96 * 64 * 4
    assert not found.row_invariant  # packed as it is: no float32 pass is held to one-row bits
    x = torch.randn(1, rows, 64)
    packed = found.product(lin)(x)
    found.product(small)(x)  # weight-first at 2..FEW_ROWS rows: below the packing size
    torch.testing.assert_close(packed, f_linear(lin, x))
    assert torch.equal(lin(x), f_linear(lin, x))  # the module: F.linear
    assert weight_first_calls == [rows]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_linears_are_not_packed_past_the_memory_share(monkeypatch, dtype):
    size = 96 * 64 * dtype.itemsize
    monkeypatch.setattr(linears, "_available_memory", lambda: 4 * size)  # a share of 1/4: one fits
    monkeypatch.setattr(linears, "MIN_PACKED_FLOAT32_BYTES", 0)
    first, second = linear(96, 64, dtype=dtype), linear(96, 64, dtype=dtype)
    found = linears.PassLinears([first, second])
    assert found.packed(first) is not None and found.packed(second) is None
    assert not found.row_invariant  # the second sums its rows in F.linear's order, whatever that is


@needs_bf16
@pytest.mark.parametrize("n_in", [64, 1536, 3000])
def test_a_fitted_weight_gives_every_row_a_one_row_products_bits(n_in):
    """What ``fit`` promises, checked apart from its own check: on this CPU, each row of a product of
    2..INVARIANT_ROWS rows has the bits that row gets alone (1,536 inputs: the embedded model's MLP
    down-projection, whose whole-weight product was not row-invariant on an AMD EPYC nor on an Intel Xeon)."""
    lin = linear(n_out=80, n_in=n_in, dtype=torch.bfloat16)
    packed = linears.PackedWeight.fit(lin.weight)
    rows = linears.INVARIANT_ROWS
    x = torch.randn(1, rows, n_in, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    alone = torch.cat([packed(x[:, i : i + 1], lin.bias) for i in range(rows)], dim=1)
    for m in (2, 3, 5, 9, 17, rows):
        way = f"{m=} {packed.way=}"
        assert torch.equal(packed(x[:, :m], lin.bias), alone[:, :m]), way
    torch.testing.assert_close(alone, f_linear(lin, x), atol=0.1, rtol=0.02)


@needs_bf16
@pytest.mark.parametrize("way", [(1, 1, False), (3, 1, False), (1, 4, False), (1, 1, True), (3, 1, True)])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (1, 3), (2, 3), (1, linears.INVARIANT_ROWS + 3)])
def test_each_way_of_a_packed_weight_computes_the_linear(way, shape):
    """Whole, cut into pieces, padded to 4 rows, row by row: the linear's product to bfloat16's
    rounding, for any leading dimensions (one row, a batch, a prefill)."""
    lin = linear(n_out=80, n_in=900, dtype=torch.bfloat16)
    packed = linears.PackedWeight(lin.weight, *way)
    assert len(packed.blocks) == way[0] and packed.way == way
    x = torch.randn(*shape, 900).to(torch.bfloat16)
    got = packed(x, lin.bias)
    assert got.shape == (*shape, 80)
    # bfloat16's tolerance: each piece's partial sum is rounded to bfloat16 once more
    torch.testing.assert_close(got, f_linear(lin, x), atol=0.1, rtol=0.02)


def test_bfloat16_linears_are_left_alone_without_bf16_instructions(monkeypatch):
    monkeypatch.setattr(linears, "cpu_has_bf16", lambda: False)
    lin = linear(dtype=torch.bfloat16)
    found = linears.PassLinears([lin])
    assert found.packed(lin) is None and not found.row_invariant


def test_a_pairs_passes_use_its_products(every_weight_is_large, tiny_llama, weight_first_calls, monkeypatch):
    monkeypatch.setattr(linears, "PACKED_MEMORY_SHARE", 0.0)  # weight-first, which the fixture counts
    pair = ModelPair(target=tiny_llama(0), tokenizer=None)
    state = kv.ModelState(pair.target_forward)
    state.forward([1, 2, 3], keep=1)
    n = len(weight_first_calls)
    assert set(weight_first_calls) == {3, 1}  # the layers' linears over 3 rows, the LM head over the one kept
    state.forward([4], keep=1)
    assert weight_first_calls[n:] == [1] * n  # each asked again, handing one row to F.linear


def test_the_lean_forwards_linears_are_decided_once(every_weight_is_large, tiny_llama):
    """Each linear the lean forward computes (its fused q/k/v and gate/up, o, down, the LM head) gets
    the product the pair's PassLinears decided for it, bound when the pair was built."""
    pair = ModelPair(target=tiny_llama(0), tokenizer=None)
    for product, lin in pair.target_forward.linears():
        assert (
            product is pair.pass_linears.product(lin) or product.func is pair.pass_linears.product(lin).func
        )


def test_a_draft_sharing_the_targets_head_gets_it_once(monkeypatch, tiny_llama):
    monkeypatch.setattr(linears, "MIN_PACKED_FLOAT32_BYTES", 0)
    target = tiny_llama(0)
    draft = copy.deepcopy(target)
    draft.lm_head = target.lm_head
    alone = ModelPair(target=tiny_llama(0), tokenizer=None).pass_linears.packed_bytes
    pair = ModelPair(target=target, draft=draft, tokenizer=None)
    head = target.lm_head.weight
    assert pair.pass_linears.packed_bytes == 2 * alone - head.numel() * head.element_size()


@torch.inference_mode()
def test_generate_on_the_pairs_model_is_unchanged(every_weight_is_large, tiny_llama, weight_first_calls):
    model, untouched = tiny_llama(0), tiny_llama(0)
    ModelPair(target=model, tokenizer=None)
    x = torch.tensor([[3, 17, 42, 5, 9]])
    assert torch.equal(model(x).logits, untouched(x).logits)  # bit-identical: F.linear
    kw = dict(do_sample=False, max_new_tokens=12, pad_token_id=0, attention_mask=torch.ones_like(x))
    assert torch.equal(model.generate(x, **kw), untouched.generate(x, **kw))
    assert not weight_first_calls
