"""Seeds: the same seed gives the same sampled output; different seeds give different ones."""

from __future__ import annotations

import pytest

import agentspec

PROMPT = [11, 4, 11, 4, 30, 2, 11, 4]
DRAFTERS = ["none", "prompt_lookup", "model"]
OPTIONS = {"max_new_tokens": 20, "temperature": 1.0, "num_draft_tokens": 3}

pytestmark = pytest.mark.usefixtures("one_thread")


def run(pair, drafter, **options):
    r = agentspec.generate(pair, PROMPT, drafter=drafter, **{**OPTIONS, **options})
    return r.token_ids, r.text


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"top_k": 5, "temperature": 0.7}])
def test_same_seed_same_output(pair, drafter, extra):
    for seed in (0, 1, 12345):
        assert run(pair, drafter, seed=seed, **extra) == run(pair, drafter, seed=seed, **extra)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_different_seeds_differ(pair, drafter):
    outputs = {tuple(run(pair, drafter, seed=seed)[0]) for seed in range(10)}
    # 20 tokens from a nearly flat 64-token distribution: a repeat is vanishingly unlikely
    assert len(outputs) == 10


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_no_seed_is_random(pair, drafter):
    assert run(pair, drafter) != run(pair, drafter)


def test_seeded_stream_equals_seeded_generate(pair):
    ids = []
    for step in agentspec.stream(pair, PROMPT, drafter="model", seed=7, **OPTIONS):
        ids += step.tokens
    assert ids == run(pair, "model", seed=7)[0]


def test_a_seeded_call_is_not_disturbed_by_others(pair):
    """A call's output depends on its own seed only, not on what ran before it."""
    first = run(pair, "model", seed=5)
    run(pair, "prompt_lookup", seed=6)
    run(pair, "model")  # unseeded
    run(pair, "none", temperature=0.0)
    assert run(pair, "model", seed=5) == first


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.8}, {"top_k": 4, "temperature": 0.7}])
def test_a_reproducible_call_is_plain_seeded_sampling_whatever_drafts(pair, extra):
    """``reproducible``: each position's draw is keyed by (seed, position), so the output is plain
    sampling's with that seed, token for token, whichever drafter drafted and however much it got
    right, and each seed gives its own output."""
    outputs = set()
    for seed in (0, 7, 99):
        options = {**OPTIONS, **extra, "seed": seed, "reproducible": True}
        plain = agentspec.generate(pair, PROMPT, "none", False, **{**options, "speculative": False})
        for drafter in ("model", "prompt_lookup", "suffix"):
            r = agentspec.generate(pair, PROMPT, drafter, False, **options)
            assert r.token_ids == plain.token_ids, (seed, drafter)
        outputs.add(tuple(plain.token_ids))
    assert len(outputs) == 3


def test_a_reproducible_call_draws_the_same_from_a_warm_cache(pair):
    from agentspec.cache import PrefixCache

    cache = PrefixCache(16 << 20)
    options = {**OPTIONS, "seed": 3, "reproducible": True}
    cold = agentspec.generate(pair, PROMPT, "model", cache, **options)
    warm = agentspec.generate(pair, PROMPT, "model", cache, **options)
    assert warm.stats.cached_tokens > 0 and warm.token_ids == cold.token_ids
