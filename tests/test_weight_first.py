"""``kv.few_rows_linears``: CPU passes of a few rows compute large linears as ``W @ x.T``.

The product is the same (to float rounding), the swap is undone after every pass (also a failed one,
also with passes overlapping on threads), and only large float32 CPU linears are touched. That
greedy decoding with it stays token-identical to plain decoding is checked in test_equivalence.
"""

from __future__ import annotations

import threading

import pytest
import torch

from agentspec import kv


def linear(n_out: int = 48, n_in: int = 16, bias: bool = True, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out, bias=bias).to(dtype)


def swapped(module: torch.nn.Module) -> bool:
    return "forward" in vars(module)


@pytest.fixture
def every_weight_is_large(monkeypatch):
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (1, 3, 16), (1, 64, 16), (1, 65, 16), (2, 5, 16)])
def test_weight_first_computes_the_linear(shape, bias):
    lin = linear(bias=bias)
    x = torch.randn(shape)
    out = kv._weight_first(lin, x)
    assert out.shape == (*shape[:-1], 48) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_large_linears_are_swapped_inside_the_block_only(monkeypatch):
    model = torch.nn.Sequential(linear(), linear(16, 48))
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 48 * 16 * 4)  # both weights hold 3,072 bytes
    with kv.few_rows_linears(model, rows=4):
        assert all(swapped(m) for m in model)
        x = torch.randn(4, 16)
        torch.testing.assert_close(model(x), model[1](model[0](x)))
    assert not any(swapped(m) for m in model)
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 48 * 16 * 4 + 1)  # now neither is large
    with kv.few_rows_linears(model, rows=4):
        assert not any(swapped(m) for m in model)


@pytest.mark.parametrize("rows", [0, 1, kv.FEW_ROWS + 1])
def test_one_row_passes_and_prefills_keep_f_linear(every_weight_is_large, rows):
    lin = linear()
    with kv.few_rows_linears(lin, rows=rows):
        assert not swapped(lin)


def test_bfloat16_and_subclasses_are_left_alone(every_weight_is_large):
    class Scaled(torch.nn.Linear):
        pass

    half, sub = linear(dtype=torch.bfloat16), Scaled(16, 48)
    with kv.few_rows_linears(torch.nn.Sequential(half, sub), rows=4):
        assert not swapped(half) and not swapped(sub)


def test_someone_elses_forward_is_kept(every_weight_is_large):
    lin = linear()
    hooked = lambda x: torch.zeros(1)  # noqa: E731 (accelerate sets an instance forward like this)
    lin.forward = hooked
    with kv.few_rows_linears(lin, rows=4):
        assert lin.forward is hooked
    assert lin.forward is hooked


def test_a_failed_pass_restores_the_module(every_weight_is_large):
    lin = linear()
    with pytest.raises(RuntimeError, match="boom"), kv.few_rows_linears(lin, rows=4):
        assert swapped(lin)
        raise RuntimeError("boom")
    assert not swapped(lin) and not kv._LINEAR_USERS


def test_overlapping_passes_on_threads_share_the_swap(every_weight_is_large):
    lin = linear()
    inside, leave = threading.Event(), threading.Event()

    def other_pass():
        with kv.few_rows_linears(lin, rows=3):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other_pass)
    with kv.few_rows_linears(lin, rows=2):
        thread.start()
        assert inside.wait(10)
    assert swapped(lin)  # the other pass is still inside
    leave.set()
    thread.join(10)
    assert not swapped(lin) and not kv._LINEAR_USERS


def test_model_state_passes_use_it(every_weight_is_large, tiny_llama, monkeypatch):
    rows_seen = []
    real = kv._weight_first
    monkeypatch.setattr(kv, "_weight_first", lambda m, x: rows_seen.append(x.shape[-2]) or real(m, x))
    state = kv.ModelState(tiny_llama(0))
    state.forward([1, 2, 3], keep=1)
    state.forward([4], keep=1)
    assert rows_seen and set(rows_seen) <= {3, 1}  # the 3-token pass; the 1-token pass never swaps
    n = len(rows_seen)
    state.forward([5], keep=1)
    assert len(rows_seen) == n


def test_the_large_linears_are_found_once_per_model(every_weight_is_large, monkeypatch):
    model = torch.nn.Sequential(linear())
    walks = []
    real = model.modules
    monkeypatch.setattr(model, "modules", lambda: walks.append(1) or real())
    for _ in range(3):
        with kv.few_rows_linears(model, rows=4):
            assert swapped(model[0])
    assert len(walks) == 1
    monkeypatch.setattr(kv, "MIN_WEIGHT_BYTES", 1 << 30)  # another threshold: found again, none large
    with kv.few_rows_linears(model, rows=4):
        assert not swapped(model[0])
    assert len(walks) == 2
