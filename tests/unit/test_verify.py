"""agentspec.verify on hand-written tensors: what is accepted, and which token comes next.

Names as in the papers: p is the target's distribution, q the draft's, k the draft length. Both
functions return (n, token): the first n draft tokens are accepted and token follows them.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentspec.verify import greedy_verify, speculative_verify

V = 8


def argmax_rows(*choices: int) -> torch.Tensor:
    """Logits [len(choices), V] whose row i has its argmax at choices[i]."""
    logits = torch.zeros(len(choices), V)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def draft(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def one_hot(i: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


def dist(*probs: float) -> torch.Tensor:
    """A [V] distribution from its first few entries (the rest 0)."""
    row = torch.zeros(V)
    row[: len(probs)] = torch.tensor(probs)
    return row


# --- greedy --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "want"),
    [
        ((5, 7, 2), (3, 6)),  # all three agree: the bonus token from the last row
        ((5, 7, 3), (2, 2)),  # third differs: its correction is the target's own token 2
        ((1, 7, 2), (0, 5)),  # first differs: nothing accepted, the target's first token
        ((5, 0, 2), (1, 7)),  # a match after a mismatch does not count
        ((), (0, 5)),  # no draft: plain decoding, one token
    ],
)
def test_greedy_verify(tokens, want):
    logits = argmax_rows(5, 7, 2, 6)[: len(tokens) + 1]  # row i scores draft[i]; row k the bonus
    assert greedy_verify(draft(*tokens), logits) == want


def test_greedy_verify_uses_logits_not_order_of_rows():
    logits = torch.tensor([[0.1, 0.3, 0.2], [2.0, -1.0, 0.0]])  # argmax 1, then 0
    assert greedy_verify(draft(1), logits) == (1, 0)
    assert greedy_verify(draft(2), logits) == (0, 1)


# --- speculative sampling ------------------------------------------------------------------------


N = 5_000  # draws per empirical check: binomial standard error <= 0.0071


def runs(p, q, tokens, n_runs=N, seed=0):
    """(n, token) of n_runs independent verifications with one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return [speculative_verify(draft(*tokens), p, q, gen) for _ in range(n_runs)]


def frequencies(values, size=V) -> torch.Tensor:
    return torch.bincount(torch.tensor(values), minlength=size).double() / len(values)


def five_sigma(p: float, n: int) -> float:
    return 5 * math.sqrt(p * (1 - p) / n)


def assert_close_freq(got: torch.Tensor, want: torch.Tensor, n: int):
    # each frequency is a binomial proportion: 5 standard errors (plus a floor for p near 0 or 1)
    tol = 5 * torch.sqrt(want.double() * (1 - want.double()) / n) + 1e-3
    assert torch.all((got - want.double()).abs() <= tol), f"{got=} {want=}"


def test_q_none_one_hot_certain_token_is_always_accepted():
    p = torch.stack([one_hot(3), one_hot(4), dist(0.5, 0.5)])  # [k+1=3, V]
    for n, token in runs(p, None, (3, 4), n_runs=200):
        assert n == 2 and token in (0, 1)  # both accepted; the bonus comes from p[2]


def test_q_none_impossible_token_is_never_accepted():
    p = torch.stack([dist(0.6, 0.4), one_hot(2)])
    out = runs(p, None, (2,), n_runs=500)  # p(2) = 0
    assert {n for n, _ in out} == {0}
    assert {t for _, t in out} == {0, 1}  # p without token 2 is p itself


def test_q_none_accepts_with_probability_p_and_resamples_p_without_x():
    """One-hot rule: accept x with p(x), else draw from p with x removed; the output token is ~p."""
    p0 = dist(0.1, 0.3, 0.6)
    p = torch.stack([p0, one_hot(7)])
    x = 1  # the draft token
    out = runs(p, None, (x,))
    accepted = [n for n, _ in out]
    assert math.isclose(sum(accepted) / len(out), 0.3, abs_tol=five_sigma(0.3, len(out)))
    rejected = [token for n, token in out if n == 0]
    assert x not in rejected  # the rejected draft token is never the correction
    assert_close_freq(frequencies(rejected), dist(0.1 / 0.7, 0, 0.6 / 0.7), len(rejected))
    first = [x if n == 1 else token for n, token in out]  # the first output token, either way
    assert_close_freq(frequencies(first), p0, len(out))


def test_acceptance_probability_is_min_one_p_over_q():
    p = torch.stack([dist(0.2, 0.8), one_hot(5)])
    q = torch.stack([dist(0.8, 0.2)])
    out = runs(p, q, (0,))
    rate = sum(n for n, _ in out) / len(out)
    assert math.isclose(rate, 0.25, abs_tol=five_sigma(0.25, len(out)))  # p(0)/q(0) = 0.2/0.8
    # x = 1 has p >= q: always accepted, then the bonus token from p[1]
    assert all((n, t) == (1, 5) for n, t in runs(p, q, (1,), n_runs=300))


def test_rejection_samples_the_residual_and_is_lossless():
    """x ~ q, verify against p: the first output token is distributed as p (Leviathan, Thm 1)."""
    p0, q0 = dist(0.1, 0.2, 0.3, 0.4), dist(0.4, 0.3, 0.2, 0.05, 0.05)
    p = torch.stack([p0, one_hot(7)])
    q = q0[None]
    gen = torch.Generator().manual_seed(1)
    firsts, corrections = [], []
    for _ in range(N):
        x = int(torch.multinomial(q0, 1, generator=gen))
        n, token = speculative_verify(draft(x), p, q, gen)
        if n == 0:
            assert token != x  # residual max(0, p - q) is 0 wherever a rejection can happen
            corrections.append(token)
        firsts.append(x if n == 1 else token)
    residual = torch.clamp(p0 - q0, min=0)
    assert_close_freq(frequencies(corrections), residual / residual.sum(), len(corrections))
    assert_close_freq(frequencies(firsts), p0, len(firsts))


def test_rejection_stops_the_prefix():
    # position 0 is never accepted (p = 0); position 1 would always be: it must not count
    p = torch.stack([dist(0.5, 0.0, 0.5), one_hot(4), one_hot(6)])
    for n, token in runs(p, None, (1, 4), n_runs=300):
        assert n == 0 and token in (0, 2)
    # position 0 always accepted, position 1 never: n is exactly 1
    p = torch.stack([one_hot(3), dist(0.5, 0.5), one_hot(6)])
    for n, token in runs(p, None, (3, 2), n_runs=300):
        assert n == 1 and token in (0, 1)


def test_p_equal_to_q_accepts_every_draft_token():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, V, generator=gen), -1)  # [k+1=4, V]
    q = p[:3].clone()
    bonus = []
    for _ in range(2_000):
        x = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(3)]
        n, token = speculative_verify(draft(*x), p, q, gen)
        assert n == 3
        bonus.append(token)
    assert_close_freq(frequencies(bonus), p[3], len(bonus))


def test_p_equal_to_q_with_a_forced_rejection_falls_back_to_p(monkeypatch):
    """The residual max(0, p - q) is all zeros: sample p itself rather than divide 0 by 0."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda k, **kw: torch.ones(k))  # r = 1: reject everything
    p = torch.stack([dist(0.3, 0.7), one_hot(5)])
    q = p[:1].clone()
    gen = torch.Generator().manual_seed(0)
    tokens = {speculative_verify(draft(1), p, q, gen) for _ in range(200)}
    monkeypatch.setattr(torch, "rand", real_rand)
    assert tokens == {(0, 0), (0, 1)}  # a valid draw from p, never NaN or a zero-probability token


def test_no_draft_samples_the_bonus_from_p():
    p = dist(0.25, 0.75)[None]  # [1, V]
    out = runs(p, None, (), n_runs=4_000)
    assert all(n == 0 for n, _ in out)
    assert_close_freq(frequencies([t for _, t in out]), p[0], len(out))


def test_same_generator_seed_same_decisions():
    p = torch.stack([dist(0.3, 0.3, 0.4), dist(0.5, 0.5), dist(0.1, 0.9)])
    q = torch.stack([dist(0.5, 0.5), dist(0.2, 0.8)])
    assert runs(p, q, (0, 1), n_runs=100, seed=3) == runs(p, q, (0, 1), n_runs=100, seed=3)
    assert runs(p, q, (0, 1), n_runs=100, seed=3) != runs(p, q, (0, 1), n_runs=100, seed=4)
