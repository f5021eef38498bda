"""A drafter that keeps failing sits out a cool-down of calls; answers never change.

``DraftHealth`` as pure bookkeeping, then on a tiny pair whose draft model raises on every forward
pass out of memory (a failure of the pair's draft model, so the pair's record:
``pair.tenants.shared``; a namespace's own failures are ``test_tenants.py``'s): every call still
returns plain decoding's tokens, the first three record the failure, the next eight decode with the
target alone and say so (``stats.draft_cooldown``, the span attribute ``agentspec.draft_cooldown``),
the retry after them fails again and doubles the rest, and once the draft works again one call
clears the record.
"""

from __future__ import annotations

import pytest
from conftest import noisy_copy

import agentspec
from agentspec.drafters.health import DraftHealth
from agentspec.models import ModelPair
from agentspec.telemetry.attributes import DRAFT_COOLDOWN, speculation_attributes

pytestmark = pytest.mark.usefixtures("one_thread")


def test_health_rests_a_drafter_after_failing_calls_in_a_row():
    h = DraftHealth(threshold=3, cooldown=2, max_cooldown=8)
    h.record("model", failed=True)
    h.record("model", failed=False)  # a good call forgets the failures
    for _ in range(2):
        h.record("model", failed=True)
    assert h.allow("model") and h.allow("suffix")
    h.record("model", failed=True)  # third in a row: rest for 2 calls
    assert [h.allow("model") for _ in range(3)] == [False, False, True]
    assert h.allow("suffix")  # per name
    h.record("model", failed=True)  # failed right after the rest: twice as long
    assert [h.allow("model") for _ in range(5)] == [False] * 4 + [True]
    for _ in range(3):  # the rest doubles up to max_cooldown
        h.record("model", failed=True)
        while not h.allow("model"):
            pass
    assert h.interval["model"] == 8
    h.record("model", failed=False)
    assert h.failing == {} and h.interval == {} and h.allow("model")


class Boom(RuntimeError):
    pass


def test_a_draft_model_that_keeps_failing_sits_out_a_cool_down(target, tokenizer):
    broken = noisy_copy(target, seed=1, noise=0.07)

    def forward(*args, **kwargs):
        raise Boom("CUDA out of memory (simulated)")

    broken.forward = forward
    pair = ModelPair(target=target, draft=broken, tokenizer=tokenizer, name="tiny-broken-draft")
    prompt = [3, 17, 5, 42, 9, 11, 7]
    opts = dict(max_new_tokens=12, prefix_cache=False)
    plain = agentspec.generate(pair, prompt, speculative=False, **opts).token_ids

    def call():
        r = agentspec.generate(pair, prompt, drafter="model", **opts)
        assert r.token_ids == plain
        return r.stats.draft_failures, r.stats.draft_cooldown

    assert [call() for _ in range(3)] == [(1, None)] * 3
    rested = [agentspec.generate(pair, prompt, drafter="model", **opts) for _ in range(8)]
    assert all(r.token_ids == plain for r in rested)
    assert {(r.stats.draft_failures, r.stats.draft_cooldown, r.stats.drafter) for r in rested} == {
        (0, "model", None)
    }
    assert speculation_attributes(rested[0].stats)[DRAFT_COOLDOWN] == "model"
    assert call() == (1, None)  # tried again after the rest: still failing, so 16 calls now
    assert pair.tenants.shared.resting["model"] == 16  # out of memory: the pair's record
    assert call() == (0, "model")
    # other drafters are not held back by the draft model's record
    assert agentspec.generate(pair, prompt, drafter="suffix", **opts).stats.draft_cooldown is None

    del broken.forward  # the draft works again: after its rest, one call clears the record
    pair.tenants.shared.resting["model"] = 0
    r = agentspec.generate(pair, prompt, drafter="model", **opts)
    assert r.token_ids == plain and r.stats.draft_failures == 0 and r.stats.draft_tokens > 0
    assert "model" not in pair.tenants.shared.failing
    assert DRAFT_COOLDOWN not in speculation_attributes(r.stats)
