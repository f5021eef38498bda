"""Lossless in the dtype a user runs: agentspec's greedy decoding against transformers' ``generate()``
in the same dtype, on the real embedded model (SmolLM2-135M-Instruct), with each drafter.

float32: token for token. bfloat16: two correct bfloat16 computations of the model may pick different
tokens where its top two logits tie to within bfloat16's rounding (agentspec's verify pass over k rows,
its prefill chunks and kernels sum in other orders than ``generate()``'s one-row steps), so where
agentspec parts from bfloat16 ``generate()`` the divergence is printed with the bfloat16 target's logit
margin at the first divergent position (top1 - top2, one transformers forward over the common prefix:
``agentspec.bench.divergence``, as ``benchmarks/gpu_check.py`` reports it) and with the float32
target's margin there, and it must be a near-tie: a divergence with a larger margin is a bug and fails.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_bf16
from test_real_model import PROMPTS

import agentspec
from agentspec import linears
from agentspec.bench.divergence import first_diff, logit_margin

pytestmark = pytest.mark.model

MAX_NEW = 32
# a few of the equivalence prompts: two whose bfloat16 top two logits tied exactly within their first
# dozen tokens in some runs (arithmetic, summarise), and one whose answer copies its prompt (drafts accepted)
NAMES = ("arithmetic", "summarise", "repeat_json")
DRAFTERS = ("auto", "model", "none")  # generate()'s default, the pair's distilled draft, no drafts
# SmolLM2-135M's top logit is ~7 to ~40 on these prompts. bfloat16 keeps 8 significant bits: it spaces
# numbers in [32, 64) 0.25 apart and in [16, 32) 0.125 apart. Two bfloat16 computations that sum in
# different orders land a few such spacings apart, so a margin of at most 0.5 (two spacings at the top
# of the range, four below 32) is a tie that rounding may break either way; a bug flips tokens whatever
# their margin (a flip by a real bug in the loop is a logit or more, as in float32, where none is allowed).
BF16_NEAR_TIE = 0.5


def reference(pair, name: str) -> tuple[list[int], list[int]]:
    """The prompt's ids and transformers' greedy ``generate()`` output, in the pair's dtype."""
    rendered = pair.tokenizer.apply_chat_template(PROMPTS[name], add_generation_prompt=True, return_dict=True)
    ids = list(rendered["input_ids"])
    x = torch.tensor([ids], device=pair.device)
    with torch.inference_mode():
        out = pair.target.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW
        )
    return ids, out[0, len(ids) :].tolist()


def loaded(dtype: str):
    pair = agentspec.load_pair(dtype=dtype)
    assert pair.dtype == getattr(torch, dtype), f"{pair.dtype=} {dtype=}"
    return pair, {name: reference(pair, name) for name in NAMES}


@pytest.fixture(scope="module")
def float32():
    return loaded("float32")


@pytest.fixture(scope="module")
def bfloat16():
    return loaded("bfloat16")


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_float32_is_token_identical_to_generate(float32, drafter):
    pair, refs = float32
    for name, (ids, ref) in refs.items():
        got = agentspec.generate(pair, ids, drafter=drafter, max_new_tokens=MAX_NEW).token_ids
        i = first_diff(ref, got)
        margin = logit_margin(pair.target, ids + ref[:i]) if i is not None and i < len(ref) else None
        assert i is None, f"{name}: first difference at {i}, target margin {margin}; {ref=} {got=}"


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_bfloat16_parts_from_generate_only_on_near_ties(bfloat16, float32, drafter):
    pair, refs = bfloat16
    divergences = []
    for name, (ids, ref) in refs.items():
        got = agentspec.generate(pair, ids, drafter=drafter, max_new_tokens=MAX_NEW).token_ids
        i = first_diff(ref, got)
        if i is None:
            continue
        within = i < len(ref)  # past generate()'s end there is no position of its to weigh
        divergences.append(
            {
                "prompt": name,
                "position": i,
                "generate": ref[i] if within else None,
                "agentspec": got[i] if i < len(got) else None,
                "margin": logit_margin(pair.target, ids + ref[:i]) if within else None,
                "float32_margin": logit_margin(float32[0].target, ids + ref[:i]) if within else None,
            }
        )
    print(f"bfloat16, drafter {drafter}: {len(divergences)} of {len(refs)} replies part from generate()")
    for d in divergences:
        print(f"  {d}")
    far = [d for d in divergences if d["margin"] is None or d["margin"] > BF16_NEAR_TIE]
    assert not far, f"divergences that are no near-tie (margin > {BF16_NEAR_TIE}): {far}"


@needs_bf16
@pytest.mark.parametrize("drafter", ("auto", "model", "suffix"))
def test_bfloat16_speculation_is_token_identical_to_plain_decoding(bfloat16, drafter):
    """In bfloat16 on a CPU a verify pass's rows are bit-identical to one-row steps (prepacked linears,
    ``attention.rows_apart``), so every drafter's output is plain decoding's own, token for token."""
    pair, refs = bfloat16
    assert pair.invariant_rows == linears.INVARIANT_ROWS, "every linear fitted (linears.PackedWeight.fit)"
    drafted = []
    for name, (ids, _) in refs.items():
        plain = agentspec.generate(pair, ids, max_new_tokens=MAX_NEW, speculative=False, prefix_cache=False)
        got = agentspec.generate(pair, ids, drafter=drafter, max_new_tokens=MAX_NEW, prefix_cache=False)
        assert got.token_ids == plain.token_ids, f"{name}: {first_diff(plain.token_ids, got.token_ids)=}"
        drafted.append(got.stats.draft_tokens)
    assert sum(drafted) > 0  # drafts were verified in multi-row passes, not only one-row steps
