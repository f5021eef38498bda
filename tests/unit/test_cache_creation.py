"""``DecodeStats.cache_creation_tokens``: the prompt tokens a call newly wrote into the prefix cache.

A real ``PrefixCache`` on tiny random models: the first call writes its whole prompt, the same call
again writes nothing, a longer prompt writes only what the tree did not hold yet (the last output
token of the call before is never stored: the saved state covers the verified tokens minus the last).
"""

from __future__ import annotations

import random

import pytest

import agentspec
from agentspec.cache import PrefixCache
from agentspec.models import ModelPair

VOCAB = 64
OPTS = dict(max_new_tokens=5, num_draft_tokens=3, eos_token_ids=frozenset())

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tiny_llama, fake_tokenizer):
    return tiny_llama(0, max_positions=512), tiny_llama(1, max_positions=512), fake_tokenizer(VOCAB, 1)


def _pair(models) -> ModelPair:
    target, draft, tokenizer = models
    cache = PrefixCache(1 << 26)
    return ModelPair(target=target, draft=draft, tokenizer=tokenizer, key=("t", "d"), prefix_cache=cache)


@pytest.mark.parametrize("drafter", ["none", "model"])
def test_cache_creation_counts_new_prompt_tokens(models, drafter):
    pair = _pair(models)
    rng = random.Random(7)
    prompt = [rng.randrange(2, VOCAB) for _ in range(30)]
    first = agentspec.generate(pair, prompt, drafter, **OPTS)
    assert first.stats.cache_creation_tokens == len(prompt), first.stats  # an empty cache: all of it
    again = agentspec.generate(pair, prompt, drafter, **OPTS)
    assert again.token_ids == first.token_ids
    assert again.stats.cache_creation_tokens == 0 and again.stats.cached_tokens == len(prompt) - 1
    longer = prompt + first.token_ids + [rng.randrange(2, VOCAB) for _ in range(7)]
    grown = agentspec.generate(pair, longer, drafter, **OPTS)
    held = len(prompt) + len(first.token_ids) - 1  # the first call's saved state: all but its last token
    assert grown.stats.cache_creation_tokens == len(longer) - held, (grown.stats, held)
    assert grown.stats.cached_tokens == held


def test_no_cache_writes_nothing(models):
    pair = _pair(models)
    result = agentspec.generate(pair, list(range(2, 22)), "none", prefix_cache=False, **OPTS)
    assert result.stats.cache_creation_tokens == 0 and pair.prefix_cache.bytes_used == 0


def test_a_stream_closed_early_counts_what_it_saved(models):
    pair = _pair(models)
    prompt = list(range(2, 26))
    run = agentspec.decode.run(pair, prompt, "none", **OPTS)
    step = next(iter(run))
    record = run.close()  # saves the verified state: the whole prompt is in it
    assert record.stats.cache_creation_tokens == len(prompt)
    assert step.stats.cache_creation_tokens == 0  # the Step's snapshot: taken before the call left


def test_a_steps_stats_stay_as_its_pass_left_them(models):
    """The loop runs ahead of its caller: each Step carries a snapshot, not the call's live stats."""
    pair = _pair(models)
    steps = list(agentspec.stream(pair, list(range(2, 26)), "model", prefix_cache=False, **OPTS))
    outputs = [s.stats.output_tokens for s in steps]
    assert outputs == sorted(outputs) and len(set(outputs)) == len(outputs), outputs
    assert [s.stats.verify_steps for s in steps] == list(range(1, len(steps) + 1))
