"""Log-probabilities (``GenerationConfig.logprobs``): with speculation on, each output token's is the
target's own log-softmax at its position, as one uncached transformers forward over the prompt and
the output computes it, with the ``top`` most likely tokens; grammar-forced tokens included, also
those that end a call without a verify pass. Asking for them changes no token."""

from __future__ import annotations

import pytest
import torch

import agentspec
from agentspec import ModelPair
from agentspec import grammar as G
from agentspec.config import GenerationConfig
from agentspec.logprobs import FLOOR

pytestmark = pytest.mark.usefixtures("one_thread")

PIECES = ["[", "0", "1", "2", ",", "12", "[1", ",2", "20", "]", "a", "b", "ab", "c", "x", "<e>"]
EOS = 15
PROMPTS = [[1, 2, 3, 4], [20, 21, 22, 1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9, 9, 9, 9]]
TOP = 3


@pytest.fixture(scope="module")
def gpair(one_thread, tiny_llama, perturbed, fake_tokenizer) -> ModelPair:
    target = tiny_llama(3, logit_scale=4.0)
    draft = perturbed(target, seed=4, noise=0.1)
    pieces = PIECES + [f"q{i}" for i in range(64 - len(PIECES))]
    tokenizer = fake_tokenizer(pieces=pieces, eos_token_id=EOS)
    return ModelPair(target=target, draft=draft, tokenizer=tokenizer, name="g-eos")


@torch.inference_mode()
def reference(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The target's log-softmax [len(out), V] at each output position, one uncached forward."""
    logits = model(input_ids=torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(out)]


def check(model, prompt: list[int], steps: list) -> list[int]:
    """Each Step's logprobs against the reference; returns the output."""
    out = [t for s in steps for t in s.tokens]
    entries = [e for s in steps for e in s.logprobs]
    assert [e.token for e in entries] == out
    ref = reference(model, prompt, out)
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(max(ref[i, e.token].item(), FLOOR), abs=1e-4), i
        values, ids = ref[i].topk(TOP)
        assert [t for t, _ in e.top] == ids.tolist(), i
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4), i
    return out


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup", "suffix", "none"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_with_speculation(pair, drafter, temperature):
    for prompt in PROMPTS:
        options = dict(max_new_tokens=20, temperature=temperature, seed=7, num_draft_tokens=4)
        steps = list(agentspec.stream(pair, prompt, drafter, False, logprobs=TOP, **options))
        out = check(pair.target, prompt, steps)
        plain = agentspec.generate(pair, prompt, drafter, False, **options)
        assert out == plain.token_ids  # asking for them changes nothing
        assert any(s.drafted for s in steps) or drafter == "none"


def test_without_logprobs_none_are_computed(pair):
    steps = list(agentspec.stream(pair, PROMPTS[0], "model", False, max_new_tokens=8))
    assert all(s.logprobs is None for s in steps)


@pytest.mark.parametrize("drafter", ["model", "none"])
def test_forced_tokens_are_scored_to_the_grammars_end(gpair, drafter):
    """Jump-forward appends "]" and EOS without a model guess; the call asks for their rows too,
    and the last of them, which end the call, come from a pass that only scores them."""
    grammar = G.ebnf('root ::= "[" [0-2] "]" "abc" [0-2] "]"')
    for prompt in PROMPTS:
        steps = list(
            agentspec.stream(gpair, prompt, drafter, False, grammar, max_new_tokens=16, logprobs=TOP)
        )
        out = check(gpair.target, prompt, steps)
        assert out[-1] == EOS and steps[-1].finish_reason == "stop"
        if drafter == "none":  # a grammar-aware draft model drafts through the forced text instead
            assert sum(s.forced for s in steps) >= 2 and steps[-1].forced and steps[-1].drafted == 0
        plain = agentspec.generate(gpair, prompt, drafter, False, grammar, max_new_tokens=16)
        assert out == plain.token_ids


def test_top_zero_gives_the_token_alone_and_bad_values_are_refused(pair):
    steps = list(agentspec.stream(pair, PROMPTS[0], "model", False, max_new_tokens=6, logprobs=0))
    assert all(e.top == () for s in steps for e in s.logprobs)
    with pytest.raises(ValueError, match="at most 20"):
        GenerationConfig(logprobs=21)
    with pytest.raises(ValueError, match=">= 0"):
        GenerationConfig(logprobs=-1)


def test_openai_entries_name_each_token_and_leave_out_the_end_of_sequence(fake_tokenizer):
    from agentspec.chat.logprobs import LogprobFormat
    from agentspec.logprobs import TokenLogprob

    tokenizer = fake_tokenizer(pieces=PIECES + [f"q{i}" for i in range(64 - len(PIECES))], eos_token_id=EOS)
    form = LogprobFormat(tokenizer, {EOS})
    entries = [TokenLogprob(12, -0.25, ((12, -0.25), (0, -2.0))), TokenLogprob(EOS, -0.1, ((EOS, -0.1),))]
    assert form.content(entries) == [
        {
            "token": "ab",
            "logprob": -0.25,
            "bytes": [97, 98],
            "top_logprobs": [
                {"token": "ab", "logprob": -0.25, "bytes": [97, 98]},
                {"token": "[", "logprob": -2.0, "bytes": [91]},
            ],
        }
    ]
