"""The most important test: greedy speculative output is token-identical to plain greedy decoding.

The reference is transformers' own ``model.generate(do_sample=False)`` on the target alone. Every
drafter (a draft model, prompt lookup, none, a drafter that is always right, one that is always
wrong, one that crashes) and every draft length must give exactly its tokens; the drafter may only
change how many target passes it takes.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

import agentspec
from agentspec import Draft, ModelPair
from agentspec.drafters import Drafter, ModelDrafter

VOCAB = 64  # the conftest models' vocabulary
MAX_POSITIONS = 128  # and their context
N_PROMPTS = 50
N_NEW = 16  # tokens generated per prompt
KS = (1, 3, 8)  # draft lengths

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cases(one_thread, target, greedy_cases) -> list[tuple[list[int], list[int]]]:
    """(prompt, the target's greedy continuation) for N_PROMPTS random prompts of 1-40 tokens.

    Every fifth prompt repeats a short pattern, so prompt lookup has something to find.
    """
    return greedy_cases(target, N_PROMPTS, N_NEW, every=5, seed=0)


class ScriptedDrafter(Drafter):
    """Proposes the target's own greedy continuation (always right), or that plus one (always wrong).

    The continuation is computed beforehand with ``model.generate``; a wrong drafter's first token
    can never be the target's choice, so nothing it proposes is ever accepted.
    """

    name = "scripted"

    def __init__(self, prompt: list[int], script: list[int], wrong: bool = False):
        self.prompt_len, self.script, self.wrong = len(prompt), script, wrong

    def propose(self, seq, k, config, generator) -> Draft:
        assert len(seq) >= self.prompt_len, f"{len(seq)=} {self.prompt_len=}"
        done = len(seq) - self.prompt_len  # tokens verified so far
        tokens = self.script[done : done + k]
        if self.wrong:
            tokens = [(t + 1) % VOCAB for t in tokens]
        return Draft(tokens)

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        pass

    def reset(self) -> None:
        pass


def check_stats(result, k: int) -> None:
    """Invariants of one call's statistics (stats.py states the conventions)."""
    s = result.stats
    assert s.output_tokens == len(result.token_ids), f"{s=}"
    assert sum(s.acceptance_histogram) == s.verify_steps, f"{s=}"
    # by position: a token accepted only after every one before it, and only where one was drafted
    accepted, drafted = s.accepted_per_position, s.drafted_per_position
    assert (sum(accepted), sum(drafted)) == (s.accepted_tokens, s.draft_tokens), f"{s=}"
    assert accepted == sorted(accepted, reverse=True) and len(accepted) <= len(drafted), f"{s=}"
    assert all(a <= d for a, d in zip(accepted, drafted)), f"{s=}"
    assert s.accepted_tokens <= s.draft_tokens <= k * s.verify_steps, f"{s=}"
    assert s.draft_failures == 0, f"{s=}"
    if result.finish_reason == "length":  # nothing trimmed: every pass adds accepted + 1 tokens
        assert s.accepted_tokens + s.verify_steps == s.output_tokens, f"{s=}"


def run_all(pair, cases, drafter, k, **options) -> list[int]:
    """Generate for every case and compare with the reference; return the summed histogram."""
    histogram = [0] * (k + 1)  # verify passes that accepted exactly i draft tokens
    for prompt, ref in cases:
        result = agentspec.generate(
            pair, prompt, drafter=drafter, max_new_tokens=N_NEW, num_draft_tokens=k, **options
        )
        assert result.token_ids == ref, f"{prompt=}\n{result.token_ids=}\n{ref=}"
        assert result.finish_reason == "length"
        check_stats(result, k)
        for i, count in enumerate(result.stats.acceptance_histogram):
            histogram[i] += count
    return histogram


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_speculative_greedy_equals_generate(pair, cases, drafter, k):
    histogram = run_all(pair, cases, drafter, k)
    # every path ran: rejection at the first token, partial accepts, and (draft model) full accepts,
    # after which the draft's cache must catch up on its own last token and the bonus token
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, f"{histogram=}"
    if drafter == "model":
        assert histogram[k] > 0 and (k == 1 or sum(histogram[1:k]) > 0), f"{histogram=}"


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_speculative_greedy_with_weight_first_linears_equals_generate(pair, cases, drafter, monkeypatch):
    # on a CPU, verify passes of 2-64 rows compute large float32 linears as W @ x.T (linears.py); the
    # conftest models' weights are small, so every weight counts as large for a pair of copies
    # built here (the linears are chosen when a pair is built)
    from agentspec import linears

    calls = []
    real = linears._weight_first
    monkeypatch.setattr(linears, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(linears, "_weight_first", lambda m, x: calls.append(m) or real(m, x))
    target, draft = copy.deepcopy(pair.target), copy.deepcopy(pair.draft)
    pair = ModelPair(target=target, draft=draft, tokenizer=pair.tokenizer)
    histogram = run_all(pair, cases, drafter, 3)
    assert calls and histogram[0] > 0 and sum(histogram[1:]) > 0, f"{histogram=}"


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_speculative_greedy_with_packed_float32_linears_equals_generate(pair, cases, drafter, monkeypatch):
    # on a CPU, float32 linears of at least linears.MIN_PACKED_FLOAT32_BYTES run prepacked for oneDNN in
    # every pass, one-row ones too: another kernel than generate()'s F.linear, another summation
    # order; the conftest models' weights are small, so every one packs for a pair of copies built here
    from agentspec import linears

    monkeypatch.setattr(linears, "MIN_PACKED_FLOAT32_BYTES", 0)
    target, draft = copy.deepcopy(pair.target), copy.deepcopy(pair.draft)
    pair = ModelPair(target=target, draft=draft, tokenizer=pair.tokenizer)
    assert pair.pass_linears.packed_bytes and pair.dtype == torch.float32
    histogram = run_all(pair, cases, drafter, 3)
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, f"{histogram=}"


@pytest.mark.parametrize(
    ("options", "n_cases"),
    [({"drafter": "none"}, N_PROMPTS), ({"speculative": False}, 10), ({"num_draft_tokens": 0}, 10)],
)
def test_plain_greedy_equals_generate(pair, cases, options, n_cases):
    """The loop without a draft (the honest baseline), reached three ways."""
    options = {"drafter": "model", "num_draft_tokens": 4, **options}
    for prompt, ref in cases[:n_cases]:
        result = agentspec.generate(pair, prompt, max_new_tokens=N_NEW, **options)
        assert result.token_ids == ref, f"{prompt=}"
        assert result.stats.draft_tokens == 0
        assert result.stats.verify_steps == N_NEW


@pytest.mark.parametrize("k", KS)
def test_always_right_drafter(pair, cases, k):
    for prompt, ref in cases:
        result = agentspec.generate(
            pair, prompt, drafter=ScriptedDrafter(prompt, ref), max_new_tokens=N_NEW, num_draft_tokens=k
        )
        assert result.token_ids == ref, f"{prompt=}"
        s = result.stats
        assert s.accepted_tokens == s.draft_tokens  # everything accepted...
        assert s.verify_steps == math.ceil(N_NEW / (k + 1))  # ...so each pass yields k + 1 tokens
        check_stats(result, k)


@pytest.mark.parametrize(("k", "n_cases"), [(1, N_PROMPTS // 2), (8, N_PROMPTS)])
def test_always_wrong_drafter(pair, cases, k, n_cases):
    for prompt, ref in cases[:n_cases]:
        result = agentspec.generate(
            pair,
            prompt,
            drafter=ScriptedDrafter(prompt, ref, wrong=True),
            max_new_tokens=N_NEW,
            num_draft_tokens=k,
        )
        assert result.token_ids == ref, f"{prompt=}"
        s = result.stats
        assert s.accepted_tokens == 0 and s.draft_tokens > 0
        assert s.verify_steps == N_NEW  # one token per pass, as without a draft
        check_stats(result, k)


def test_draft_with_a_wider_embedding(tiny_llama, target, tokenizer, cases):
    """A draft whose logits are wider than the target's (padded embedding rows) is cut to fit.

    (A narrower draft is only valid when ids past its embedding never occur; here they do, and the
    drafter fails and is dropped, which the drafter-failure tests cover.)
    """
    pair = ModelPair(target=target, draft=tiny_llama(5, vocab_size=VOCAB + 8), tokenizer=tokenizer)
    run_all(pair, cases[:10], "model", 3)


# --- EOS, max_new_tokens and the end of the context ----------------------------------------------

EOS_DRAFTERS = [("none", 1), ("prompt_lookup", 3), ("model", 3), ("model", 8), ("right", 8), ("wrong", 3)]


def make_drafter(name, prompt, ref):
    if name == "right":
        return ScriptedDrafter(prompt, ref)  # drafts the EOS and the tokens past it in one pass
    if name == "wrong":
        return ScriptedDrafter(prompt, ref, wrong=True)
    return name


def generate_with(pair, name, prompt, ref, k, max_new_tokens=N_NEW, **options):
    """``agentspec.generate`` with the drafter ``make_drafter`` builds for ``name``."""
    drafter = make_drafter(name, prompt, ref)
    return agentspec.generate(
        pair, prompt, drafter=drafter, max_new_tokens=max_new_tokens, num_draft_tokens=k, **options
    )


@pytest.mark.parametrize(("drafter", "k"), EOS_DRAFTERS)
@pytest.mark.parametrize("where", ["first", "middle"])
def test_eos_ends_generation_like_generate(pair, cases, hf_greedy, tokenizer, drafter, k, where):
    for prompt, ref in cases[:10]:
        eos = ref[0] if where == "first" else ref[N_NEW // 3]  # a token the target does generate
        want = hf_greedy(pair.target, prompt, N_NEW, eos_token_id=eos)
        assert want[-1] == eos and len(want) == ref.index(eos) + 1  # generate keeps the EOS
        result = generate_with(pair, drafter, prompt, ref, k, eos_token_ids=frozenset({eos}))
        assert result.token_ids == want, f"{prompt=} {eos=}"
        assert result.finish_reason == "stop"
        assert result.text == tokenizer.decode(want[:-1])  # the EOS is never text
        check_stats(result, k)


@pytest.mark.parametrize(("drafter", "k"), [("model", 3), ("right", 8)])
def test_eos_from_the_tokenizer(target, draft, cases, hf_greedy, fake_tokenizer, drafter, k):
    """With no eos_token_ids, the pair's own EOS (the tokenizer's) ends generation."""
    for prompt, ref in cases[:10]:
        eos = ref[N_NEW // 2]
        pair = ModelPair(target=target, draft=draft, tokenizer=fake_tokenizer(eos_token_id=eos))
        want = hf_greedy(target, prompt, N_NEW, eos_token_id=eos)
        drafter_ = make_drafter(drafter, prompt, ref)
        result = agentspec.generate(pair, prompt, drafter=drafter_, max_new_tokens=N_NEW, num_draft_tokens=k)
        assert result.token_ids == want and result.finish_reason == "stop", f"{prompt=} {eos=}"


@pytest.mark.parametrize(("drafter", "k"), [("none", 1), ("model", 8), ("prompt_lookup", 8), ("right", 8)])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9])  # 9 = one full 8-token draft + bonus
def test_max_new_tokens(pair, cases, hf_greedy, drafter, k, max_new_tokens):
    for prompt, ref in cases[:8]:
        want = hf_greedy(pair.target, prompt, max_new_tokens)
        assert want == ref[:max_new_tokens]
        result = generate_with(pair, drafter, prompt, ref, k, max_new_tokens)
        assert result.token_ids == want, f"{prompt=}"
        assert result.finish_reason == "length"
        check_stats(result, k)


@pytest.mark.parametrize(("drafter", "k"), [("none", 1), ("model", 8), ("prompt_lookup", 8), ("right", 8)])
@pytest.mark.parametrize("room", [1, 2, 5])
def test_generation_stops_at_the_end_of_the_context(pair, hf_greedy, drafter, k, room):
    """A prompt ``room`` tokens short of max_position_embeddings gets exactly ``room`` tokens."""
    rng = random.Random(room)
    pattern = [rng.randrange(VOCAB) for _ in range(7)]
    prompt = (pattern * 20)[: MAX_POSITIONS - room]
    want = hf_greedy(pair.target, prompt, room)
    result = generate_with(pair, drafter, prompt, want, k, max_new_tokens=30)
    assert result.token_ids == want
    assert result.finish_reason == "length"


# --- a drafter that fails ------------------------------------------------------------------------


class FlakyDrafter(Drafter):
    """Wraps a drafter and raises on its ``fail_at``-th proposal (1 = the first)."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.name = f"flaky-{inner.name}"

    def propose(self, seq, k, config, generator):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter crashed")
        return self.inner.propose(seq, k, config, generator)

    def feedback(self, seq, n_accepted, n_drafted):
        self.inner.feedback(seq, n_accepted, n_drafted)

    def reset(self):
        self.inner.reset()


@pytest.mark.parametrize("fail_at", [1, 3])
@pytest.mark.parametrize("inner", ["model", "right"])
def test_drafter_that_raises_mid_call(pair, cases, inner, fail_at):
    for prompt, ref in cases[:10]:
        base = ModelDrafter(pair.draft, VOCAB) if inner == "model" else ScriptedDrafter(prompt, ref)
        flaky = FlakyDrafter(base, fail_at)
        result = agentspec.generate(pair, prompt, drafter=flaky, max_new_tokens=N_NEW, num_draft_tokens=3)
        assert result.token_ids == ref, f"{prompt=}"
        assert result.finish_reason == "length"
        assert result.stats.draft_failures == 1
        assert flaky.calls >= fail_at


class FeedbackRaises(ScriptedDrafter):
    def feedback(self, seq, n_accepted, n_drafted) -> None:
        raise RuntimeError("feedback crashed")


def test_drafter_whose_feedback_raises(pair, cases):
    """feedback() is drafter code too: its failure must cost speed, never the call."""
    prompt, ref = cases[0]
    result = agentspec.generate(pair, prompt, drafter=FeedbackRaises(prompt, ref), max_new_tokens=N_NEW)
    assert result.token_ids == ref
    assert result.stats.draft_failures == 1


class Malformed(ScriptedDrafter):
    """Returns a draft the target cannot verify: ids outside the vocabulary, or a q of the wrong form."""

    def __init__(self, prompt, script, token: int = 5, q: str | None = None):
        super().__init__(prompt, script)
        self.token, self.q = token, q

    def propose(self, seq, k, config, generator):
        q = None
        if self.q == "narrow":
            q = torch.full((k, VOCAB - 4), 1.0 / (VOCAB - 4))
        elif self.q == "nan":
            q = torch.full((k, VOCAB), float("nan"))
        return Draft([self.token] * k, q)


@pytest.mark.parametrize(
    ("token", "q", "temperature"),
    [(-1, None, 0.0), (VOCAB, None, 0.0), (10**9, None, 0.0), (5, "narrow", 1.0), (5, "nan", 1.0)],
    ids=["id--1", "id-vocab", "id-huge", "q-narrow", "q-nan"],
)
def test_malformed_draft_is_a_drafter_failure(pair, cases, token, q, temperature):
    """A draft the target cannot verify costs speed, never the call (and never a CUDA assert)."""
    prompt, ref = cases[0]
    drafter = Malformed(prompt, ref, token, q)
    options = {"max_new_tokens": N_NEW, "temperature": temperature, "seed": 0}
    result = agentspec.generate(pair, prompt, drafter=drafter, **options)
    assert result.stats.draft_failures == 1
    assert len(result.token_ids) == N_NEW
    if temperature == 0:
        assert result.token_ids == ref
    # the pair still works afterwards
    assert agentspec.generate(pair, prompt, drafter="model", max_new_tokens=N_NEW).token_ids == ref


def test_drafter_returning_more_than_k_tokens_is_cut(pair, cases):
    class Greedy(ScriptedDrafter):
        def propose(self, seq, k, config, generator):
            done = len(seq) - self.prompt_len
            return Draft(self.script[done:])  # everything it knows, ignoring k

    for prompt, ref in cases[:10]:
        result = agentspec.generate(
            pair, prompt, drafter=Greedy(prompt, ref), max_new_tokens=N_NEW, num_draft_tokens=3
        )
        assert result.token_ids == ref
        assert max(len(result.stats.acceptance_histogram) - 1, 0) <= 3
        check_stats(result, 3)
