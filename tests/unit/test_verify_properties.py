"""Property-based tests (hypothesis) of the acceptance functions in ``agentspec.verify``.

Deterministic properties hold for every draw of the random numbers, so they are checked on
arbitrary seeds: the accepted prefix is never longer than the draft, the output token always has
target probability > 0, a draft that *is* the target's distribution is always accepted in full, a
token the target gives probability 0 is never accepted, and a correction is only ever drawn where
p > q. One statistical property checks the theorem itself on small vocabularies: the first output
token is distributed as p, whatever q is (total variation within a 6-sigma bound).
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from agentspec.verify import greedy_verify, speculative_verify  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@st.composite
def distributions(draw, rows: int, vocab: int, zeros: bool = True):
    """[rows, vocab] float64 probability rows (some entries exactly 0 when ``zeros``)."""
    out = []
    for _ in range(rows):
        w = draw(st.lists(st.floats(0.0, 1.0), min_size=vocab, max_size=vocab))
        if not zeros:
            w = [x + 1e-3 for x in w]
        if sum(w) <= 0:
            w = [1.0] + [0.0] * (vocab - 1)
        out.append(w)
    t = torch.tensor(out, dtype=torch.float64)
    return t / t.sum(dim=-1, keepdim=True)


@st.composite
def cases(draw, zeros: bool = True):
    vocab = draw(st.integers(2, 6))
    k = draw(st.integers(0, 4))
    p = draw(distributions(k + 1, vocab, zeros))
    q = draw(distributions(k, vocab, zeros)) if k else torch.zeros((0, vocab), dtype=torch.float64)
    draft = torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k)), dtype=torch.long)
    seed = draw(st.integers(0, 2**32 - 1))
    return draft, p, q, seed


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@SETTINGS
@given(st.data())
def test_greedy_accepts_the_prefix_that_matches_the_argmax(data):
    vocab, k = data.draw(st.integers(2, 6)), data.draw(st.integers(0, 5))
    logits = torch.tensor(
        data.draw(st.lists(st.lists(st.floats(-5, 5), min_size=vocab, max_size=vocab), min_size=k + 1,
                           max_size=k + 1)), dtype=torch.float64)  # fmt: skip
    draft = torch.tensor(
        data.draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k)), dtype=torch.long
    )
    n, token = greedy_verify(draft, logits)
    want = 0
    while want < k and int(draft[want]) == int(logits[want].argmax()):
        want += 1
    assert n == want and token == int(logits[n].argmax())


@SETTINGS
@given(cases())
def test_speculative_verify_stays_inside_the_targets_support(case):
    draft, p, q, seed = case
    k = draft.shape[0]
    for q_or_none in (q, None):
        n, token = speculative_verify(draft, p, q_or_none, _gen(seed))
        assert 0 <= n <= k
        assert p[n, token] > 0, "the output token must be one the target can produce"
        assert all(p[i, draft[i]] > 0 for i in range(n)), "accepted a token the target never gives"


@SETTINGS
@given(cases())
def test_a_draft_sampled_from_p_itself_is_accepted_in_full(case):
    draft, p, _, seed = case
    k = draft.shape[0]
    draft = torch.stack([p[i].argmax() for i in range(k)]) if k else draft  # tokens with p > 0
    n, token = speculative_verify(draft, p, p[:k].clone(), _gen(seed))
    assert n == k and p[k, token] > 0


@SETTINGS
@given(cases(zeros=False))
def test_a_correction_is_drawn_only_where_p_exceeds_q(case):
    draft, p, q, seed = case
    k = draft.shape[0]
    n, token = speculative_verify(draft, p, q, _gen(seed))
    if n < k and (p[n] - q[n]).clamp(min=0).sum() > 1e-12:
        assert p[n, token] > q[n, token]
    n, token = speculative_verify(draft, p, None, _gen(seed))
    if n < k and p[n, draft[n]] < 1.0:  # a model-free draft rejected: never the same token again
        assert token != int(draft[n])


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.integers(2, 5).flatmap(lambda v: st.tuples(distributions(1, v), distributions(1, v))))
def test_the_first_token_is_distributed_as_p_whatever_q_is(pq):
    p, q = pq
    vocab, samples = p.shape[1], 4000
    gen = _gen(1234)
    counts = torch.zeros(vocab, dtype=torch.float64)
    p2 = torch.cat([p, p])  # the bonus row: unused by the first token's distribution
    for _ in range(samples):
        x = torch.multinomial(q[0], 1, generator=gen)  # the draft samples its token from q
        n, token = speculative_verify(x, p2, q, gen)
        counts[int(x) if n == 1 else token] += 1
    freq = counts / samples
    tv = 0.5 * (freq - p[0]).abs().sum().item()
    sigma = (0.25 * vocab / samples) ** 0.5  # a loose scale for TV of `vocab` frequencies
    assert tv < 6 * sigma, f"TV {tv:.4f} between the first token's frequencies and p; {p[0]=} {q[0]=}"
