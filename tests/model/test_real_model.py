"""The real embedded model (SmolLM2-135M-Instruct): speculative output == plain transformers output.

The most important test in the project: greedy speculative decoding (prompt lookup, the default
pair's drafter) must give exactly the tokens of ``model.generate(do_sample=False)``, EOS included.
A failure names the first differing position and the target's logit margin (top1 - top2 of one
plain forward pass) there, so an argmax near-tie flipped by float rounding is told apart from a
real bug. Do not loosen the comparison: a small margin explains a flip, it does not excuse it.

Run: ``pytest -m model tests/test_real_model.py`` (loads the model once; ~1-2 min on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

import agentspec
from agentspec.models import default_dtype

pytestmark = pytest.mark.model

MAX_NEW = 32
DRAFT_LENGTHS = (2, 5)

_JSON = '{"city": "Oslo", "temp_c": 4, "sky": "overcast", "wind_kph": 18}'
PROMPTS: dict[str, list[dict[str, str]]] = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "colours": [{"role": "user", "content": "Name the three primary colours."}],
    "translate": [{"role": "user", "content": "Translate 'good morning, my friend' into Spanish."}],
    "arithmetic": [{"role": "user", "content": "What is 12 times 7? Show the working."}],
    "cats": [{"role": "user", "content": "Write two sentences about cats."}],
    "repeat_json": [{"role": "user", "content": f"The weather tool returned {_JSON}. Repeat it exactly."}],
    "reverse_list": [
        {"role": "user", "content": "Reverse this list: apples, bananas, cherries, dates, figs."}
    ],
    "code_rename": [
        {
            "role": "user",
            "content": "Rename x to count, return the code:\ndef bump(x):\n    x = x + 1\n    return x\n",
        }
    ],
    "summarise": [
        {
            "role": "user",
            "content": "Summarise in one line: The team meeting moved from Monday 10 am to Wednesday "
            "3 pm, in room 204, because the projector in room 101 is broken.",
        }
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a terse assistant. Answer in as few words as possible."},
        {"role": "user", "content": "What colour is the sky on a clear day?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And at sunset?"},
    ],
}


@pytest.fixture(scope="module")
def pair():
    return agentspec.load_pair()


@pytest.fixture(scope="module")
def reference(pair):
    """prompt name -> (prompt ids, transformers greedy output ids), each computed once."""
    cache: dict[str, tuple[list[int], list[int]]] = {}

    def get(name: str) -> tuple[list[int], list[int]]:
        if name not in cache:
            rendered = pair.tokenizer.apply_chat_template(
                PROMPTS[name], add_generation_prompt=True, return_dict=True
            )
            ids = list(rendered["input_ids"])
            x = torch.tensor([ids], device=pair.device)
            with torch.inference_mode():
                out = pair.target.generate(
                    x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW
                )
            cache[name] = (ids, out[0, len(ids) :].tolist())
        return cache[name]

    return get


@torch.inference_mode()
def _margin(model, seq: list[int]) -> tuple[float, int, int]:
    """The target's top1 - top2 logit margin for the token after seq, and those two tokens."""
    logits = model(input_ids=torch.tensor([seq], device=model.device), logits_to_keep=1).logits[0, -1]
    top = torch.topk(logits.float(), 2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def _mismatch(pair, prompt: list[int], ref: list[int], got: list[int]) -> str:
    """Where ``got`` first leaves ``ref``, and how close the target's choice was there."""
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    margin, top1, top2 = _margin(pair.target, prompt + ref[:i])
    tok = pair.tokenizer
    return (
        f"first difference at output position {i} (lengths {len(ref)=} {len(got)=}): "
        f"reference {ref[i : i + 1]} {tok.decode(ref[i : i + 1])!r} vs speculative {got[i : i + 1]} "
        f"{tok.decode(got[i : i + 1])!r} after {tok.decode(ref[max(0, i - 8) : i])!r}; target logit margin "
        f"top1 - top2 = {margin:.5f} (top1 {top1} {tok.decode([top1])!r}, "
        f"top2 {top2} {tok.decode([top2])!r})\n"
        f"reference:   {tok.decode(ref)!r}\nspeculative: {tok.decode(got)!r}"
    )


@pytest.mark.parametrize("k", DRAFT_LENGTHS)
@pytest.mark.parametrize("name", list(PROMPTS))
def test_speculative_equals_transformers_generate(pair, reference, name, k):
    prompt, ref = reference(name)
    result = agentspec.generate(pair, prompt, max_new_tokens=MAX_NEW, num_draft_tokens=k)
    assert result.stats.drafter == "auto"
    assert result.token_ids == ref, _mismatch(pair, prompt, ref, result.token_ids)
    expected_reason = "stop" if ref[-1] in pair.eos_token_ids else "length"
    assert result.finish_reason == expected_reason, f"{result.finish_reason=} {expected_reason=}"
    assert result.text == pair.tokenizer.decode([t for t in ref if t not in pair.eos_token_ids])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_the_default_distilled_draft_is_lossless(pair, reference, name):
    """The embedded pair's own draft (agentspec distill, committed) drafting on every pass."""
    from agentspec.models import DEFAULT_DRAFT

    assert pair.draft is not None and pair.draft_name == str(DEFAULT_DRAFT)
    prompt, ref = reference(name)
    result = agentspec.generate(pair, prompt, drafter="model", max_new_tokens=MAX_NEW)
    assert result.token_ids == ref, _mismatch(pair, prompt, ref, result.token_ids)
    assert result.stats.draft_tokens > 0


def test_no_draft_model_on_request():
    bare = agentspec.load_pair(draft_model=False)
    assert bare.draft is None and bare.draft_name is None


def test_prompt_lookup_drafts_are_accepted_where_the_answer_copies(pair, reference):
    """Not an equivalence check: a guard that the drafter actually drafts on a copying prompt."""
    prompt, ref = reference("repeat_json")
    result = agentspec.generate(pair, prompt, max_new_tokens=MAX_NEW, num_draft_tokens=5)
    assert result.token_ids == ref, _mismatch(pair, prompt, ref, result.token_ids)
    s = result.stats
    assert s.draft_tokens > 0 and s.accepted_tokens > 0, f"{s=}"
    assert s.verify_steps < len(ref), f"speculation saved no target pass: {s.verify_steps=} {len(ref)=}"


def test_stream_text_concatenates_to_generate_text(pair, reference):
    prompt, ref = reference("code_rename")
    steps = list(agentspec.stream(pair, prompt, max_new_tokens=MAX_NEW, num_draft_tokens=4))
    result = agentspec.generate(pair, prompt, max_new_tokens=MAX_NEW, num_draft_tokens=4)
    streamed_ids = [t for s in steps for t in s.tokens]
    assert streamed_ids == result.token_ids == ref, _mismatch(pair, prompt, ref, streamed_ids)
    assert "".join(s.text for s in steps) == result.text
    assert len(steps) > 1, "one step only: the text was never released piecewise"
    assert [s.finish_reason for s in steps[:-1]] == [None] * (len(steps) - 1)
    assert steps[-1].finish_reason == result.finish_reason


@pytest.mark.parametrize("speculative", [True, False])
def test_stop_string_cuts_text_before_it(pair, reference, speculative):
    prompt, ref = reference("summarise")
    full = pair.tokenizer.decode([t for t in ref if t not in pair.eos_token_ids])
    # a stop string that spans token boundaries, starting a few words into the answer
    words = full.split(" ")
    assert len(words) >= 6, f"reference answer too short for this test: {full!r}"
    stop = " ".join(words[3:5])
    expected = full[: full.index(stop)]
    steps = list(agentspec.stream(pair, prompt, max_new_tokens=MAX_NEW, stop=[stop], speculative=speculative))
    text = "".join(s.text for s in steps)
    assert text == expected, f"{stop=} {text=} {expected=}"
    assert stop not in text
    assert steps[-1].finish_reason == "stop"
    result = agentspec.generate(pair, prompt, max_new_tokens=MAX_NEW, stop=[stop], speculative=speculative)
    assert result.text == expected and result.finish_reason == "stop"
    # the ids kept are those of the reference up to the token that completed the stop string
    assert result.token_ids == ref[: len(result.token_ids)]
    assert stop in pair.tokenizer.decode(result.token_ids)


def test_the_default_pair_loads_in_the_default_dtype(pair):
    assert pair.dtype == default_dtype(pair.device)  # the suite's: float32 ($AGENTSPEC_DTYPE, conftest.py)


def test_incremental_text_is_the_tokenizers_decode(pair):
    # multi-byte characters split over byte-level tokens, spaces, and the chat template's specials
    from agentspec.text import TextTracker

    tok = pair.tokenizer
    text = "café ☃ 😀 naïve — «quoted» 東京 <|im_end|> 12 , . done"
    ids = tok(text * 3)["input_ids"] + [tok.eos_token_id]
    tracker = TextTracker(tok, (), pair.eos_token_ids)
    for n in range(1, len(ids) + 1, 3):
        assert tracker.text(ids[:n]) == tracker.decode(ids[:n]), f"{n=}"
        tracker.release(ids[:n], final=False)


@pytest.fixture(scope="module", params=["eagle3", "dspark"])
def head_folder(request, pair, tmp_path_factory):
    """A head in the speculators format for the real target (random weights: it drafts, seldom right)."""
    from heads import new_block_head, new_eagle3, save_head

    torch.manual_seed(0)
    target, layers = pair.target, [2, 15, 27]  # speculators' default ids for a 30-layer target
    if request.param == "eagle3":
        head = new_eagle3(target, layers, draft_ids=torch.arange(8192))
    else:
        head = new_block_head(target, "dspark", layers, block_size=4, mask_token_id=0, markov_rank=16)
    return save_head(head, tmp_path_factory.mktemp(request.param) / "head", verifier=target)


@pytest.mark.parametrize("name", ["capital", "repeat_json", "code_rename"])
def test_a_speculators_head_on_the_real_target_is_lossless(pair, reference, head_folder, name):
    """``ChatSpecDecode(draft_model=<a speculators folder>)`` through LangChain, and ``generate``."""
    from langchain_agentspec import ChatSpecDecode

    prompt, ref = reference(name)
    llm = ChatSpecDecode(
        draft_model=str(head_folder), drafter="model", max_tokens=MAX_NEW, prefix_cache=False
    )
    reply = llm.invoke(PROMPTS[name])
    assert reply.response_metadata["speculative"]["draft_tokens"] > 0
    head_pair = agentspec.load_pair(draft_model=head_folder, warm_up=False)
    result = agentspec.generate(
        head_pair, prompt, drafter="model", max_new_tokens=MAX_NEW, prefix_cache=False
    )
    assert result.token_ids == ref, _mismatch(pair, prompt, ref, result.token_ids)
    assert reply.content == pair.tokenizer.decode([t for t in ref if t not in pair.eos_token_ids])
