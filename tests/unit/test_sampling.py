"""agentspec.sampling on hand-written logits: temperature, top-k, top-p, drawing a token."""

from __future__ import annotations

import math

import pytest
import torch

from agentspec.sampling import make_generator, probabilities, sample


def logits_of(*probs: float) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (normalised)."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


# --- temperature ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.3, 4.0])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 0.0, 1.0, -5.0]])  # [2, V]
    got = probabilities(logits, temperature)
    want = torch.softmax(logits / temperature, dim=-1)
    assert got.dtype == torch.float32
    assert got.shape == logits.shape
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got.sum(-1), torch.ones(2))


def test_lower_temperature_is_more_peaked():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cold, warm, hot = (probabilities(logits, t) for t in (0.5, 1.0, 2.0))
    assert cold[0] > warm[0] > hot[0]  # the favourite gains mass as temperature falls
    assert cold[3] < warm[3] < hot[3]


def test_half_precision_logits_come_back_float32():
    got = probabilities(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), 1.0)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_non_positive_temperature_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        probabilities(torch.zeros(4), temperature)


# --- top-k ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_the_k_largest_and_renormalises(k):
    logits = torch.tensor([0.1, 3.0, -2.0, 1.5, 0.7, 2.2])  # ranks: 1, 5, 3, 4, 0, 2
    full = probabilities(logits, 1.0)
    got = probabilities(logits, 1.0, top_k=k)
    assert kept(got) == set(torch.topk(logits, k).indices.tolist())
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))
    idx = sorted(kept(got))
    # ratios between kept tokens are those of the unfiltered distribution
    torch.testing.assert_close(got[idx] / got[idx].sum(), full[idx] / full[idx].sum())


def test_top_k_at_least_vocab_is_a_no_op():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(probabilities(logits, 0.9, top_k=7), probabilities(logits, 0.9))
    torch.testing.assert_close(probabilities(logits, 0.9, top_k=100), probabilities(logits, 0.9))


def test_top_k_works_row_by_row():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 4.0, 5.0]])
    got = probabilities(logits, 1.0, top_k=2)
    assert kept(got[0]) == {0, 1}
    assert kept(got[1]) == {2, 3}


# --- top-p ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_p", "want"),
    [
        (0.3, {0}),  # top-1 alone has 0.5 >= 0.3
        (0.5, {0}),  # exactly 0.5: the top-1 already reaches it
        (0.6, {0, 1}),  # 0.5 < 0.6 <= 0.75
        (0.74, {0, 1}),
        (0.75, {0, 1}),  # exactly reached (dyadic masses are exact in float32): nothing more kept
        (0.8, {0, 1, 2}),  # 0.75 < 0.8 <= 0.875
        (0.875, {0, 1, 2}),
        (0.95, {0, 1, 2, 3, 4}),  # 0.9375 < 0.95: both tokens of 0.0625 are needed
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, want):
    logits = logits_of(0.5, 0.25, 0.125, 0.0625, 0.0625)
    got = probabilities(logits, 1.0, top_p=top_p)
    assert kept(got) == want, f"{top_p=} {got=}"
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))


def test_top_p_keeps_one_of_two_tied_tokens_when_one_is_enough():
    logits = logits_of(0.5, 0.25, 0.125, 0.0625, 0.0625)
    got = kept(probabilities(logits, 1.0, top_p=0.9))  # 0.875 < 0.9 <= 0.9375: one tie is enough
    assert len(got) == 4 and {0, 1, 2} < got, f"{got=}"


def test_top_p_order_of_logits_does_not_matter():
    logits = logits_of(0.0625, 0.25, 0.5, 0.0625, 0.125)  # the same mass, shuffled
    assert kept(probabilities(logits, 1.0, top_p=0.8)) == {1, 2, 4}


@pytest.mark.parametrize("top_p", [1e-9, 0.01])
def test_top_p_always_keeps_the_most_likely_token(top_p):
    logits = torch.tensor([0.0, 0.1, 0.05, -0.2])  # nearly flat: top-1 has only ~27%
    got = probabilities(logits, 1.0, top_p=top_p)
    assert kept(got) == {1}
    assert got[1] == 1.0


def test_top_p_matches_a_brute_force_reference():
    """Random rows: the kept set is the shortest sorted prefix whose mass reaches top_p."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(300):
        logits = torch.randn(12, generator=gen) * 2
        top_p = float(torch.rand((), generator=gen)) * 0.98 + 0.01
        p = torch.softmax(logits.double(), -1)
        order = torch.argsort(p, descending=True)
        cum = torch.cumsum(p[order], 0)
        if (cum - top_p).abs().min() < 1e-5:
            continue  # too close to a boundary for float32 to decide: skip, not a test of rounding
        n = int((cum < top_p).sum()) + 1  # shortest prefix with mass >= top_p
        want = set(order[:n].tolist())
        got = probabilities(logits, 1.0, top_p=top_p)
        assert kept(got) == want, f"{top_p=} {p=}"
        torch.testing.assert_close(got[order[:n]], (p[order[:n]] / p[order[:n]].sum()).float())
        checked += 1
    assert checked > 250


def test_top_k_then_top_p():
    # after top-k=3: masses 0.5/0.875, 0.25/0.875, 0.125/0.875 = 0.571, 0.286, 0.143
    logits = logits_of(0.5, 0.25, 0.125, 0.0625, 0.0625)
    assert kept(probabilities(logits, 1.0, top_k=3, top_p=0.8)) == {0, 1}  # 0.571 < 0.8 <= 0.857
    assert kept(probabilities(logits, 1.0, top_k=3, top_p=0.9)) == {0, 1, 2}


def test_temperature_applies_before_top_p():
    logits = logits_of(0.5, 0.25, 0.125, 0.0625, 0.0625)
    # at temperature 0.5 the masses are ~0.76, 0.19, ...: the top-1 alone reaches 0.7
    assert kept(probabilities(logits, 0.5, top_p=0.7)) == {0}
    assert kept(probabilities(logits, 1.0, top_p=0.7)) == {0, 1}


# --- drawing -------------------------------------------------------------------------------------


def test_sample_is_reproducible_with_a_seed():
    probs = probabilities(torch.randn(50, generator=torch.Generator().manual_seed(1)), 1.0)

    def draws(seed):
        gen = make_generator(seed, probs.device)
        return [sample(probs, gen) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert all(0 <= t < 50 for t in draws(7))


def test_sample_never_draws_a_zero_probability_token():
    probs = probabilities(logits_of(0.5, 0.25, 0.125, 0.0625, 0.0625), 1.0, top_p=0.6)  # {0, 1}
    gen = make_generator(0, probs.device)
    draws = {sample(probs, gen) for _ in range(500)}
    assert draws == {0, 1}


def test_sample_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    gen = make_generator(0, probs.device)
    n = 20_000
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(n)]), minlength=3)
    # binomial standard error of 0.7 at n=20,000 is 0.0032: 5 sigma is 0.016
    for got, want in zip((counts / n).tolist(), probs.tolist()):
        assert math.isclose(got, want, abs_tol=0.016), f"{got=} {want=}"


def test_unseeded_generators_differ():
    probs = torch.full((1000,), 1e-3)
    a = [sample(probs, make_generator(None, probs.device)) for _ in range(5)]
    b = [sample(probs, make_generator(None, probs.device)) for _ in range(5)]
    assert a != b  # 1000^-5 chance of a false failure


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 1e-45])
def test_tiny_temperature_is_a_one_hot_argmax_not_nan(temperature):
    """logits / T overflows float32 below T ~ 1e-38: the result must still be a distribution."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    got = probabilities(logits, temperature)
    assert not torch.isnan(got).any(), f"{temperature=} {got=}"
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, 0.0, 0.0]))
