"""The replay drafter of the device check (``agentspec.bench.replay``): a draft of known acceptance
that pays a real draft step per token, and stays lossless."""

from __future__ import annotations

import pytest

import agentspec
from agentspec.bench.replay import ReplayDrafter, corrupted_positions, expected_tokens_per_pass
from agentspec.kv import common_prefix_len


def test_corruption_is_seeded_and_near_its_rate():
    wrong = corrupted_positions(4000, 0.8, seed=3)
    assert wrong == corrupted_positions(4000, 0.8, seed=3)
    assert wrong != corrupted_positions(4000, 0.8, seed=4)
    assert 0.17 < sum(wrong) / len(wrong) < 0.23
    assert not any(corrupted_positions(100, 1.0, seed=0))


def test_expected_tokens_per_pass():
    assert expected_tokens_per_pass(0.0, 4) == 1.0  # the bonus token alone
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_replay_output_is_the_reference_and_passes_match_the_corruption(pair, hf_greedy, acceptance):
    prompt, n, k = [3, 7, 1, 9, 4, 4, 2], 24, 4
    ref = hf_greedy(pair.target, prompt, n)
    drafter = ReplayDrafter(pair.draft, prompt + ref, acceptance, seed=5, k=k, width=64)
    steps = list(agentspec.stream(pair, prompt, drafter, prefix_cache=False, max_new_tokens=n))
    assert [t for s in steps for t in s.tokens] == ref
    wrong = drafter.wrong
    pos = len(prompt)
    for s in steps:  # each pass accepts up to the first wrong position it drafted
        expected = next((j for j in range(s.drafted) if wrong[pos + j]), s.drafted)
        assert s.accepted == expected, f"{pos=} {s.drafted=} {s.accepted=} {expected=}"
        pos += len(s.tokens)
    # its draft model's cache is in step with its ids, and they follow the verified sequence
    assert drafter.state.cache.get_seq_length() == len(drafter.state.ids)
    assert common_prefix_len(drafter.state.ids, prompt + ref) >= len(prompt) + n // 2
