"""Host syncs per verify pass: about one for unconstrained greedy calls, whatever the drafter.

A read of a device value (``.item()``, ``.tolist()``, ``bool(t)``...) stalls a GPU's queue, so the
loop reads once per pass: the accept count, the token and the draft's ids together. ``HostSyncs``
counts those reads on this CPU exactly as they would happen on a GPU. The models are tiny random
ones; the count does not depend on their size. The outputs are checked too: a cheaper loop that
changed a token would be worthless.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from heads import new_block_head, new_eagle3

import agentspec
from agentspec import Draft, ModelPair
from agentspec.bench.syncs import HostSyncs
from agentspec.cache import PrefixCache
from agentspec.distill.student import build_eagle
from agentspec.drafters import Drafter
from agentspec.drafters.prompt_lookup import NgramIndex, lookup
from agentspec.drafters.registry import build_drafter
from agentspec.kv import ModelState, PassIds

pytestmark = pytest.mark.usefixtures("one_thread")

N_NEW = 32
# per verify pass: one read; on a CPU the confidence schedule reads a block's confidences too, to stop
# its draft early (at most two blocks in a usual draft); elsewhere it reads none of its own (below)
BUDGET = {"model": 1.0, "prompt_lookup": 1.0, "suffix": 1.0, "model_scheduled": 3.0, "auto": 3.0}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(7)
    pattern = [rng.randrange(64) for _ in range(6)]
    return [rng.randrange(64) for _ in range(10)] + pattern * 3  # something for the lookups to find


def _syncs_per_pass(pair, prompt, drafter, prefix_cache) -> tuple[float, list[int]]:
    agentspec.generate(pair, prompt, drafter=drafter, prefix_cache=prefix_cache, max_new_tokens=4)
    with HostSyncs(pair) as syncs:
        steps = list(
            agentspec.stream(pair, prompt, drafter=drafter, prefix_cache=prefix_cache, max_new_tokens=N_NEW)
        )
    passes = sum(step.target_pass for step in steps)
    return syncs.count / passes, [t for step in steps for t in step.tokens]


@pytest.mark.parametrize("drafter", list(BUDGET))
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prefix-cache"])
def test_greedy_passes_read_the_device_about_once(pair, prompt, drafter, cached, hf_greedy, target):
    cache = PrefixCache(64 << 20) if cached else False
    per_pass, tokens = _syncs_per_pass(pair, prompt, drafter, cache)
    assert per_pass <= BUDGET[drafter], f"{drafter=} {per_pass=}"
    assert tokens == hf_greedy(target, prompt, N_NEW)


@pytest.mark.parametrize("name", ["model_scheduled", "auto"])
@pytest.mark.parametrize("k", [1, 8], ids=["K1", "K8"])
def test_a_scheduled_draft_reads_nothing_of_its_own_where_a_read_stalls(
    pair, prompt, name, k, hf_greedy, target
):
    """On a GPU (``early_stop`` off, as on any device but a CPU) a scheduled draft model plans its
    length before drafting and its confidences come back with the verification's one read: one read
    a pass, alone or with 7 other calls, every reply transformers' greedy one; the calibration
    learns from the confidences read."""
    drafters = [build_drafter(pair, name, pair.tenants.memory(f"planned-{name}-{k}")) for _ in range(k)]
    models = [d.model if name == "auto" else d for d in drafters]
    for model in models:
        model.early_stop = False
    calibration = models[0].schedule.shared_calibration
    prompts = [prompt[i:] for i in range(k)]
    passes = pair.scheduler.stats.passes
    with HostSyncs(pair) as syncs, ThreadPoolExecutor(k) as pool:
        runs = list(pool.map(lambda i: _streamed(pair, prompts[i], drafters[i]), range(k)))
    passes = pair.scheduler.stats.passes - passes
    assert sum(s.drafted for steps in runs for s in steps) > 0, "nothing drafted: nothing measured"
    assert syncs.count <= passes, f"{syncs.count=} {passes=} {syncs.where}"
    assert calibration.total[1] > 0  # the confidences read with the verdicts taught it
    for p, steps in zip(prompts, runs):
        assert [t for s in steps for t in s.tokens] == hf_greedy(target, p, N_NEW)


def _streamed(pair, prompt: list[int], drafter) -> list:
    return list(agentspec.stream(pair, prompt, drafter=drafter, prefix_cache=False, max_new_tokens=N_NEW))


def _head(kind: str, target) -> torch.nn.Module:
    """An untrained head of ``kind`` over ``target`` (the speculators format's, for the block heads)."""
    torch.manual_seed(0)
    if kind == "eagle":
        return build_eagle(target, 1).eval()
    if kind == "eagle3":
        return new_eagle3(target, [0, 1]).eval()
    if kind == "dflash":
        return new_block_head(target, "dflash", [0, 1], block_size=4, mask_token_id=4).eval()
    head = new_block_head(target, "dspark", [1], block_size=4, mask_token_id=4)
    with torch.no_grad():
        for p in head.markov_head.parameters():
            p.normal_(0, 0.5)
    return head.eval()


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash", "dspark"])
def test_a_head_drafts_on_the_device_too(kind, tiny_llama, fake_tokenizer, prompt, hf_greedy):
    """EAGLE-1 and EAGLE-3 heads chain their drafts on the device; a DFlash block's slots are drawn
    at once and a DSpark block's slot by slot, its Markov step indexed by the previous token on the
    device: none reads a draft token, the verification reads them with its result."""
    etarget = tiny_llama(3, vocab_size=64, hidden=32, layers=2, max_positions=512, logit_scale=4.0)
    epair = ModelPair(target=etarget, draft=_head(kind, etarget), tokenizer=fake_tokenizer(64))
    stats, tokens = [], []
    with HostSyncs(epair) as syncs:
        for seed in range(3):  # sampled as well: drawn on the device too
            options = {"temperature": 0.9, "seed": seed} if seed else {}
            steps = list(agentspec.stream(epair, prompt, "model", False, max_new_tokens=N_NEW, **options))
            tokens.append([t for step in steps for t in step.tokens])
            stats.append(steps[-1].stats)
    assert tokens[0] == hf_greedy(etarget, prompt, N_NEW)
    passes = sum(s.verify_steps for s in stats)
    assert syncs.count <= passes, (syncs.count, passes, syncs.where)
    assert all(s.draft_tokens > 0 and s.draft_failures == 0 for s in stats), stats


@pytest.mark.parametrize("kind", ["eagle", "dspark"])
def test_heads_of_eight_calls_read_the_device_at_most_twice_a_pass(
    kind, tiny_llama, fake_tokenizer, prompt, hf_greedy
):
    """Eight calls drafting with a head at once: the verdicts in one read, and a DSpark head's
    survival estimates (for the pass's verify lengths) in one more for the whole pass, not one per
    call; every reply transformers' greedy one."""
    etarget = tiny_llama(3, vocab_size=64, hidden=32, layers=2, max_positions=512, logit_scale=4.0)
    epair = ModelPair(target=etarget, draft=_head(kind, etarget), tokenizer=fake_tokenizer(64))
    prompts = [prompt[i:] for i in range(8)]
    passes = epair.scheduler.stats.passes
    with HostSyncs(epair) as syncs, ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda p: _streamed(epair, p, "model"), prompts))
    passes = epair.scheduler.stats.passes - passes
    assert sum(s.drafted for steps in runs for s in steps) > 0
    assert syncs.count <= 2 * passes, (syncs.count, passes, syncs.where)
    for p, steps in zip(prompts, runs):
        assert [t for s in steps for t in s.tokens] == hf_greedy(etarget, p, N_NEW)


def test_sampled_verification_reads_once_per_pass(pair, prompt):
    options = {"temperature": 0.8, "seed": 3, "max_new_tokens": N_NEW, "prefix_cache": False}
    with HostSyncs(pair) as syncs:
        steps = list(agentspec.stream(pair, prompt, drafter="prompt_lookup", **options))
    assert syncs.count == sum(step.target_pass for step in steps), syncs.where


class DeviceIds(Drafter):
    """Proposes device ids, one outside the vocabulary: the guard clamps them, flags the drafter."""

    name = "device-ids"

    def propose(self, seq, k, config, generator) -> Draft:
        return Draft(torch.tensor([5, 64 + 3, 7][:k]))


def test_device_ids_outside_the_vocabulary_are_a_drafter_failure(pair, prompt, hf_greedy, target):
    result = agentspec.generate(pair, prompt, drafter=DeviceIds(), prefix_cache=False, max_new_tokens=8)
    assert result.stats.draft_failures == 1
    assert result.token_ids == hf_greedy(target, prompt, 8)


def test_device_ids_are_unread_until_settled(target):
    ids = [3, 17, 5, 42]
    state, reference = ModelState(target), ModelState(target)
    state.forward(PassIds(ids[:2], torch.tensor(ids[2:])), keep=1)
    assert state.ids == ids[:2] and state.unread == 2
    state.settle([5])  # the first unread position was accepted, the other rolled back
    assert state.ids == ids[:3] and state.unread == 0
    want = reference.forward(ids[:3] + [9], keep=1)
    assert torch.allclose(state.forward([9], keep=1), want, atol=1e-5)
    state.forward(PassIds([], torch.tensor([1, 2])), keep=1)
    state.truncate(2)  # a roll-back drops unread positions with the rest
    assert state.ids == ids[:2] and state.unread == 0
    state.check()


@pytest.mark.parametrize("seed", range(20))
def test_the_ngram_index_finds_what_a_scan_finds(seed):
    """Grown token by token and rolled back at random, the index answers as a scan of the whole
    sequence does (``lookup`` builds one from scratch; the scan here is written out)."""
    rng = random.Random(seed)
    seq: list[int] = []
    index = NgramIndex(3, 1)
    for _ in range(200):
        if seq and rng.random() < 0.2:
            del seq[rng.randrange(len(seq)) :]
        else:
            seq.append(rng.randrange(5))
        index.sync(seq)
        assert index.lookup(4) == _scan(seq, 4) == lookup(seq, 4)


def _scan(seq: list[int], k: int, max_n: int = 3) -> list[int]:
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        for start in range(len(seq) - 1 - n, -1, -1):
            if seq[start : start + n] == seq[-n:]:
                return seq[start + n : start + n + k]
    return []


def test_sync_compares_only_past_what_the_caller_knows_verified(target):
    state = ModelState(target)
    state.forward([1, 2, 3], keep=1)
    assert state.sync([1, 2, 3, 4], start=3) == [4]
    assert state.sync([9, 2, 3, 4], start=1) == [4]  # the first id is the caller's word, not compared
    assert state.sync([1, 2, 7, 4], start=1, end=3) == [7]  # rolled back to the common prefix
    assert state.ids == [1, 2]


def test_suffix_speculation_starts_from_the_latest_occurrences_only():
    from agentspec.drafters.suffix import SuffixIndex

    index = SuffixIndex()
    index.extend(0, [1, 2] * 600 + [1, 3, 1])  # "1" went on with "2" 600 times, then once with "3"
    context = index.seqs[0]
    assert index.speculate(context, 1).tokens == [2]
    assert index.speculate(context, 1, max_matches=2).tokens == [3]  # the context's own end, and "1 3"
