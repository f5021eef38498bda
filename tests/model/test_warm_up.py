"""``load_pair`` warms the pair up (``agentspec.warm``): each kind of pass runs once at load, in
throwaway states, so a call sees the same pair, caches and counts as without it."""

from __future__ import annotations

import agentspec
from agentspec import warm
from agentspec.drafters.eagle import is_eagle


def test_warm_up_runs_every_kind_of_pass_and_leaves_nothing_a_call_sees(monkeypatch):
    rows_fed: list[int] = []
    real = warm._target_passes
    monkeypatch.setattr(
        warm,
        "_target_passes",
        lambda model, ids, hidden: rows_fed.append(len(ids)) or real(model, ids, hidden),
    )
    pair = agentspec.load_pair()
    assert is_eagle(pair.draft)  # the embedded pair's default: its head steps too (``_eagle_passes``)
    # the target, once: the EAGLE head reads its features
    assert rows_fed == [warm.PREFILL_ROWS + sum(warm.VERIFY_ROWS)]
    assert pair.prefix_cache.bytes_used == 0
    assert pair.scheduler.stats.passes == 0 and len(pair.tenants) == 0
    assert not pair.cost.times.observed and not pair.cost.verify.draft_times


def test_a_warmed_pair_decodes_as_a_cold_one():
    prompt = agentspec.load_pair(warm_up=False).tokenizer.encode("List three prime numbers:")
    outputs = []
    for warm_up in (False, True):
        pair = agentspec.load_pair(dtype="float32", warm_up=warm_up)
        outputs.append(agentspec.generate(pair, prompt, max_new_tokens=16, prefix_cache=False).token_ids)
    assert outputs[0] == outputs[1]
