"""Bad input fails fast with an error that names the parameter, and leaves the pair usable.

After each refused call the same valid calls (greedy, and sampled with a seed) must give exactly
the outputs they gave before any bad call.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

import agentspec
from agentspec import GenerationConfig, TokenizerMismatchError
from agentspec.cache import PrefixCache
from agentspec.models import check_tokenizers, load_pair

VOCAB = 64
MAX_POSITIONS = 128
PROMPT = [5, 9, 12, 5, 9, 40]
VALID = [
    {"drafter": "model", "max_new_tokens": 12},
    {"drafter": "prompt_lookup", "max_new_tokens": 12},
    {"drafter": "model", "max_new_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 3},
]

pytestmark = pytest.mark.usefixtures("one_thread")


def outputs(pair) -> list[tuple[list[int], str, str]]:
    out = []
    for options in VALID:
        r = agentspec.generate(pair, PROMPT, **options)
        out.append((r.token_ids, r.text, r.finish_reason))
    return out


@pytest.fixture(scope="module")
def before(pair):
    """The valid calls' outputs, taken before any bad call."""
    return outputs(pair)


BAD_PROMPTS = [
    pytest.param([], ValueError, id="empty"),
    pytest.param(torch.tensor([], dtype=torch.long), ValueError, id="empty-tensor"),
    pytest.param([1] * MAX_POSITIONS, ValueError, id="fills-the-context"),
    pytest.param([1] * (MAX_POSITIONS + 50), ValueError, id="longer-than-context"),
    pytest.param([3, -1, 4], ValueError, id="negative-id"),
    pytest.param([3, VOCAB, 4], ValueError, id="id-equal-to-vocab"),
    pytest.param([3, 10**12], ValueError, id="huge-id"),
    pytest.param([3, 1.5], ValueError, id="float-id"),
    pytest.param([3, True], ValueError, id="bool-id"),
    pytest.param([3, "a"], ValueError, id="str-id"),
    pytest.param("hello", TypeError, id="str"),
    pytest.param(None, TypeError, id="none"),
    pytest.param(42, TypeError, id="int"),
    pytest.param(torch.zeros(2, 3, dtype=torch.long), ValueError, id="batch-of-2"),
]


@pytest.mark.parametrize(("prompt", "error"), BAD_PROMPTS)
def test_bad_prompt(pair, before, prompt, error):
    with pytest.raises(error, match="prompt_ids"):
        agentspec.generate(pair, prompt, max_new_tokens=4)
    assert outputs(pair) == before


def test_prompt_too_long_says_so(pair):
    with pytest.raises(ValueError, match=r"prompt_ids.*context"):
        agentspec.generate(pair, [1] * (MAX_POSITIONS + 50), max_new_tokens=4)


def test_the_longest_valid_prompt(pair, hf_greedy):
    prompt = [7] * (MAX_POSITIONS - 1)  # one position left: exactly one token
    result = agentspec.generate(pair, prompt, max_new_tokens=10)
    assert result.token_ids == hf_greedy(pair.target, prompt, 1)
    assert result.finish_reason == "length"


def test_prompt_as_tensor(pair, before):
    assert agentspec.generate(pair, torch.tensor(PROMPT), **VALID[0]).token_ids == before[0][0]
    assert agentspec.generate(pair, torch.tensor([PROMPT]), **VALID[0]).token_ids == before[0][0]


BAD_OPTIONS = [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": -5}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": "10"}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": None}, TypeError, "max_new_tokens"),
    ({"temperature": math.nan}, ValueError, "temperature"),
    ({"temperature": -0.5}, ValueError, "temperature"),
    ({"temperature": math.inf}, ValueError, "temperature"),
    ({"temperature": -math.inf}, ValueError, "temperature"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"temperature": 0.7, "top_p": 0}, ValueError, "top_p"),
    ({"temperature": 0.7, "top_p": 1.5}, ValueError, "top_p"),
    ({"temperature": 0.7, "top_p": math.nan}, ValueError, "top_p"),
    ({"temperature": 0.7, "top_p": -0.1}, ValueError, "top_p"),
    ({"temperature": 0.7, "top_p": "0.9"}, TypeError, "top_p"),
    ({"temperature": 0.7, "top_k": 0}, ValueError, "top_k"),
    ({"temperature": 0.7, "top_k": -3}, ValueError, "top_k"),
    ({"temperature": 0.7, "top_k": 2.0}, TypeError, "top_k"),
    ({"stop": ""}, ValueError, "stop"),
    ({"stop": ["Observation:", ""]}, ValueError, "stop"),
    ({"stop": ["ok", 3]}, TypeError, "stop"),
    ({"num_draft_tokens": -1}, ValueError, "num_draft_tokens"),
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"drafter": "bogus"}, ValueError, "drafter"),
    ({"drafter": object()}, ValueError, "drafter"),
    ({"no_such_option": 1}, TypeError, "no_such_option"),
    ({"config": GenerationConfig(), "temperature": 0.5}, TypeError, "config"),
]


@pytest.mark.parametrize(("options", "error", "name"), BAD_OPTIONS, ids=lambda v: repr(v)[:40])
def test_bad_option(pair, before, options, error, name):
    with pytest.raises(error, match=re.escape(name)):
        agentspec.generate(pair, PROMPT, **options)
    assert outputs(pair) == before


@pytest.mark.parametrize(("options", "error", "name"), BAD_OPTIONS[:6], ids=lambda v: repr(v)[:40])
def test_bad_option_through_stream(pair, before, options, error, name):
    with pytest.raises(error, match=re.escape(name)):
        next(agentspec.stream(pair, PROMPT, **options))
    assert outputs(pair) == before


def test_bad_calls_leave_a_prefix_cached_pair_intact(target, draft, tokenizer, before):
    """With the cross-call cache, a refused call must not save or restore anything wrong either."""
    cached = agentspec.ModelPair(
        target=target, draft=draft, tokenizer=tokenizer, prefix_cache=PrefixCache(1 << 26)
    )
    assert outputs(cached) == before  # first call fills the cache
    for case in BAD_PROMPTS:
        prompt, error = case.values
        with pytest.raises(error, match="prompt_ids"):
            agentspec.generate(cached, prompt, max_new_tokens=4)
    for options, error, name in BAD_OPTIONS:
        with pytest.raises(error, match=re.escape(name)):
            agentspec.generate(cached, PROMPT, **options)
    assert outputs(cached) == before


def test_prompt_as_numpy_array(pair, before):
    """Tokenizers called with return_tensors="np" give numpy ids: as good as a list or a tensor."""
    assert agentspec.generate(pair, np.array(PROMPT), **VALID[0]).token_ids == before[0][0]


def test_seed_too_large_for_the_generator_is_refused_by_name(pair, before):
    with pytest.raises(ValueError, match="seed"):
        agentspec.generate(pair, PROMPT, temperature=0.8, seed=2**64)
    assert outputs(pair) == before


@pytest.mark.parametrize("temperature", [1e-30, 1e-45])
def test_tiny_temperature_is_greedy_or_refused_by_name(pair, before, temperature):
    """A positive temperature the config accepts must not crash the sampler with NaNs."""
    try:
        result = agentspec.generate(pair, PROMPT, **{**VALID[0], "temperature": temperature, "seed": 0})
    except ValueError as exc:
        assert "temperature" in str(exc)
    else:
        assert result.token_ids == before[0][0]  # the limit of sampling as T -> 0 is greedy
    assert outputs(pair) == before


def test_no_model_draft_refused_by_name(target, tokenizer):
    pair = agentspec.ModelPair(target=target, tokenizer=tokenizer)  # no draft model
    with pytest.raises(ValueError, match="drafter"):
        agentspec.generate(pair, PROMPT, drafter="model")


def test_zero_temperature_is_greedy_and_ignores_the_seed(pair, before):
    for seed in (0, 1, 2):
        r = agentspec.generate(pair, PROMPT, temperature=0.0, seed=seed, **VALID[0])
        assert r.token_ids == before[0][0]


# --- tokenizers of target and draft must agree ---------------------------------------------------


def word_tokenizer(words: list[str], eos: str = "</s>") -> PreTrainedTokenizerFast:
    """A real (tiny) fast tokenizer: WordLevel over <unk>, <s>, </s> and ``words``."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token=eos)


WORDS = ["hello", "world", "tool", "call"]


def test_identical_tokenizers_pass():
    check_tokenizers(word_tokenizer(WORDS), word_tokenizer(WORDS))


@pytest.mark.parametrize(
    ("draft", "message"),
    [
        (word_tokenizer(WORDS, eos="<s>"), r"eos_token_id.*target 2.*draft 1"),
        (word_tokenizer([*WORDS, "extra"]), r"vocabulary sizes differ: target 7, draft 8"),
        (word_tokenizer(WORDS[:-1]), r"vocabulary sizes differ: target 7, draft 6"),
        (
            word_tokenizer(["world", "hello", "tool", "call"]),
            r"'(hello|world)' has id \d in the target but \d",
        ),
        (word_tokenizer(["hello", "world", "tool", "calls"]), r"'call' has id 6 in the target but None"),
    ],
    ids=["eos", "bigger", "smaller", "swapped-ids", "other-word"],
)
def test_mismatched_tokenizers_name_the_difference(draft, message):
    with pytest.raises(TokenizerMismatchError, match=message):
        check_tokenizers(word_tokenizer(WORDS), draft)
    assert issubclass(TokenizerMismatchError, ValueError)


def test_load_pair_refuses_a_draft_of_another_tokenizer(tmp_path, tiny_llama):
    """The check runs when a pair is loaded from folders, before any decoding."""
    for name, eos, seed in (("target", "</s>", 0), ("draft", "<s>", 1)):
        tiny_llama(seed, vocab_size=len(WORDS) + 3, hidden=16, layers=1).save_pretrained(tmp_path / name)
        word_tokenizer(WORDS, eos=eos).save_pretrained(tmp_path / name)
    with pytest.raises(TokenizerMismatchError, match="eos_token_id"):
        load_pair(tmp_path / "target", tmp_path / "draft", device="cpu")
    pair = load_pair(tmp_path / "target", tmp_path / "target", device="cpu")  # same tokenizer: fine
    assert pair.draft is not None
