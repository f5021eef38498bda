"""``kv.PassLinears``: CPU passes compute float32 linears of at least ``kv.MIN_PACKED_FLOAT32_BYTES``
and bfloat16 ones (on a CPU with bf16 instructions) with a prepacked oneDNN weight, and passes of a
few rows compute large float32 linears left unpacked (past the memory share) as ``W @ x.T``.

The product is the same (to float rounding); which linears take that path is decided once, when the
pair is built; only agentspec's own passes of 2..FEW_ROWS rows take it (also after a failed pass,
also with passes overlapping on threads), so every other caller of the model gets ``F.linear``;
only large float32 and bfloat16 CPU linears are touched. That greedy decoding with it stays token-identical to
plain decoding is checked in test_equivalence.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import needs_bf16

from agentspec import kv
from agentspec.models import ModelPair


def linear(n_out: int = 48, n_in: int = 16, bias: bool = True, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out, bias=bias).to(dtype)


def installed(module: torch.nn.Module) -> bool:
    return "forward" in vars(module)


@pytest.fixture
def every_weight_is_large(monkeypatch):
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 0)


@pytest.fixture
def weight_first_calls(monkeypatch) -> list[int]:
    """The row counts of every weight-first product computed while the test runs."""
    rows_seen: list[int] = []
    real = kv._weight_first
    monkeypatch.setattr(kv, "_weight_first", lambda m, x: rows_seen.append(x.shape[-2]) or real(m, x))
    return rows_seen


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (1, 3, 16), (1, 64, 16), (1, 65, 16), (2, 5, 16)])
def test_weight_first_computes_the_linear(shape, bias):
    lin = linear(bias=bias)
    x = torch.randn(shape)
    out = kv._weight_first(lin, x)
    assert out.shape == (*shape[:-1], 48) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_large_linears_run_weight_first_inside_a_pass_only(monkeypatch, weight_first_calls):
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 48 * 16 * 4)  # both weights hold 3,072 bytes
    model = torch.nn.Sequential(linear(), linear(16, 48))
    assert kv.PassLinears(model).linears == list(model) and all(installed(m) for m in model)
    x = torch.randn(4, 16)
    with kv.pass_rows(rows=4):
        got = model(x)
    assert weight_first_calls == [4, 4]  # both linears
    f = torch.nn.functional.linear
    torch.testing.assert_close(got, f(f(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias))
    model(x)  # outside a pass: F.linear
    assert len(weight_first_calls) == 2
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 48 * 16 * 4 + 1)  # now neither is large
    small = torch.nn.Sequential(linear(), linear(16, 48))
    assert not kv.PassLinears(small).linears and not any(installed(m) for m in small)


@pytest.mark.parametrize("rows", [0, 1, kv.FEW_ROWS + 1])
def test_one_row_passes_and_prefills_keep_f_linear(every_weight_is_large, weight_first_calls, rows):
    lin = linear()
    kv.PassLinears(lin)
    with kv.pass_rows(rows=rows):
        lin(torch.randn(4, 16))
    assert not weight_first_calls


def test_subclasses_are_left_alone(every_weight_is_large):
    class Scaled(torch.nn.Linear):
        pass

    sub = Scaled(16, 48)
    assert not kv.PassLinears(sub).linears and not installed(sub)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 17, 100])
def test_bfloat16_linears_run_prepacked_inside_a_pass(rows):
    lin = linear(n_out=96, n_in=64, dtype=torch.bfloat16)
    found = kv.PassLinears(lin)
    assert found.linears == [lin] and found.packed_bytes == 96 * 64 * 2
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    with kv.pass_rows(rows):
        packed = lin(x)
    torch.testing.assert_close(packed, plain)  # bfloat16's tolerance: another kernel, same product
    assert torch.equal(lin(x), plain)  # outside a pass: F.linear itself


@pytest.mark.parametrize("rows", [1, 5, 17, 100])
def test_float32_linears_from_their_size_run_prepacked_inside_a_pass(monkeypatch, weight_first_calls, rows):
    monkeypatch.setattr(kv, "MIN_PACKED_FLOAT32_BYTES", 96 * 64 * 4)
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 0)  # packing comes first; weight-first is past the share
    lin, small = linear(n_out=96, n_in=64), linear(n_out=95, n_in=64)
    found = kv.PassLinears(torch.nn.Sequential(lin, small))
    assert found.linears == [lin, small] and found.packed_bytes == 96 * 64 * 4
    assert not found.row_invariant  # packed as it is: no float32 pass is held to one-row bits
    x = torch.randn(1, rows, 64)
    with kv.pass_rows(rows):
        packed = lin(x)
        small(x)  # weight-first at 2..FEW_ROWS rows: below the packing size
    torch.testing.assert_close(packed, torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))  # outside: F.linear
    assert weight_first_calls == ([rows] if 2 <= rows <= kv.FEW_ROWS else [])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_linears_are_not_packed_past_the_memory_share(monkeypatch, dtype):
    size = 96 * 64 * dtype.itemsize
    monkeypatch.setattr(kv, "_available_memory", lambda: 4 * size)  # a share of 1/4: one fits
    monkeypatch.setattr(kv, "MIN_PACKED_FLOAT32_BYTES", 0)
    first, second = linear(96, 64, dtype=dtype), linear(96, 64, dtype=dtype)
    found = kv.PassLinears(torch.nn.Sequential(first, second))
    assert found.linears == [first]
    assert not installed(second)
    assert not found.row_invariant  # the second sums its rows in F.linear's order, whatever that is


@needs_bf16
@pytest.mark.parametrize("n_in", [64, 1536, 3000])
def test_a_fitted_weight_gives_every_row_a_one_row_products_bits(n_in):
    """What ``fit`` promises, checked apart from its own check: on this CPU, each row of a product of
    2..INVARIANT_ROWS rows has the bits that row gets alone (1,536 inputs: the embedded model's MLP
    down-projection, whose whole-weight product was not row-invariant on an AMD EPYC nor on an Intel Xeon)."""
    lin = linear(n_out=80, n_in=n_in, dtype=torch.bfloat16)
    packed = kv.PackedWeight.fit(lin.weight)
    x = torch.randn(1, kv.INVARIANT_ROWS, n_in, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    alone = torch.cat([packed(x[:, i : i + 1], lin.bias) for i in range(kv.INVARIANT_ROWS)], dim=1)
    for m in (2, 3, 5, 9, 17, kv.INVARIANT_ROWS):
        way = f"{m=} {packed.way=}"
        assert torch.equal(packed(x[:, :m], lin.bias), alone[:, :m]), way
    reference = torch.nn.functional.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(alone, reference, atol=0.1, rtol=0.02)


@needs_bf16
@pytest.mark.parametrize("way", [(1, 1, False), (3, 1, False), (1, 4, False), (1, 1, True), (3, 1, True)])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (1, 3), (2, 3), (1, kv.INVARIANT_ROWS + 3)])
def test_each_way_of_a_packed_weight_computes_the_linear(way, shape):
    """Whole, cut into pieces, padded to 4 rows, row by row: the linear's product to bfloat16's
    rounding, for any leading dimensions (one row, a batch, a prefill)."""
    lin = linear(n_out=80, n_in=900, dtype=torch.bfloat16)
    packed = kv.PackedWeight(lin.weight, *way)
    assert len(packed.blocks) == way[0] and packed.way == way
    x = torch.randn(*shape, 900).to(torch.bfloat16)
    got = packed(x, lin.bias)
    assert got.shape == (*shape, 80)
    # bfloat16's tolerance: each piece's partial sum is rounded to bfloat16 once more
    torch.testing.assert_close(got, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=0.1, rtol=0.02)


def test_bfloat16_linears_are_left_alone_without_bf16_instructions(monkeypatch):
    monkeypatch.setattr(kv, "cpu_has_bf16", lambda: False)
    lin = linear(dtype=torch.bfloat16)
    assert not kv.PassLinears(lin).linears and not installed(lin)


def test_someone_elses_forward_is_kept(every_weight_is_large):
    lin = linear()
    hooked = lambda x: torch.zeros(1)  # noqa: E731 (accelerate sets an instance forward like this)
    lin.forward = hooked
    assert not kv.PassLinears(lin).linears
    assert lin.forward is hooked


def test_a_failed_pass_leaves_f_linear_behind(every_weight_is_large, weight_first_calls):
    lin = linear()
    kv.PassLinears(lin)
    with pytest.raises(RuntimeError, match="boom"), kv.pass_rows(rows=4):
        raise RuntimeError("boom")
    lin(torch.randn(4, 16))
    assert not weight_first_calls


def test_a_pass_on_one_thread_leaves_another_threads_calls_alone(every_weight_is_large, weight_first_calls):
    lin = linear()
    kv.PassLinears(lin)
    x = torch.randn(3, 16)
    inside, leave = threading.Event(), threading.Event()

    def other_pass():
        with kv.pass_rows(rows=3):
            inside.set()
            leave.wait(10)
            lin(x)

    thread = threading.Thread(target=other_pass)
    thread.start()
    assert inside.wait(10)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))  # this thread: F.linear
    assert not weight_first_calls
    leave.set()
    thread.join(10)
    assert weight_first_calls == [3]  # the other thread's pass ran weight-first


def test_model_state_passes_use_it(every_weight_is_large, tiny_llama, weight_first_calls):
    model = tiny_llama(0)
    kv.PassLinears(model)
    state = kv.ModelState(model)
    state.forward([1, 2, 3], keep=1)
    state.forward([4], keep=1)
    rows_seen = weight_first_calls
    assert rows_seen and set(rows_seen) <= {3, 1}  # the 3-token pass; the 1-token pass never runs it
    n = len(rows_seen)
    state.forward([5], keep=1)
    assert len(rows_seen) == n


def test_the_large_linears_are_found_once_per_pair(every_weight_is_large, tiny_llama, monkeypatch):
    model = tiny_llama(0)
    walks = []
    real = model.modules
    monkeypatch.setattr(model, "modules", lambda: walks.append(1) or real())
    pair = ModelPair(target=model, tokenizer=None)
    assert len(walks) == 1 and pair.pass_linears.linears
    # the model's linears, its q/k/v and gate/up standing in the lean forward's fused ones (agentspec.lean)
    (lean,) = pair.lean
    own = {id(m) for m in real() if type(m) is torch.nn.Linear} - {id(m) for m in lean.replaced}
    assert {id(m) for m in pair.pass_linears.linears} == own | {id(m) for m in lean.fused}
    state = kv.ModelState(model)
    for ids in ([1, 2, 3], [4, 5], [6]):
        state.forward(ids, keep=len(ids))
    assert len(walks) == 1


def test_a_draft_sharing_the_targets_head_gets_it_once(every_weight_is_large, tiny_llama):
    target = tiny_llama(0)
    draft = copy.deepcopy(target)
    draft.lm_head = target.lm_head
    pair = ModelPair(target=target, draft=draft, tokenizer=None)
    ids = [id(m) for m in pair.pass_linears.linears]
    assert len(ids) == len(set(ids)) and id(target.lm_head) in ids


@torch.inference_mode()
def test_generate_on_the_pairs_model_is_unchanged(every_weight_is_large, tiny_llama, weight_first_calls):
    model, untouched = tiny_llama(0), tiny_llama(0)
    ModelPair(target=model, tokenizer=None)
    x = torch.tensor([[3, 17, 42, 5, 9]])
    assert torch.equal(model(x).logits, untouched(x).logits)  # bit-identical: F.linear
    kw = dict(do_sample=False, max_new_tokens=12, pad_token_id=0, attention_mask=torch.ones_like(x))
    assert torch.equal(model.generate(x, **kw), untouched.generate(x, **kw))
    assert not weight_first_calls
