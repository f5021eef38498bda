"""The responses file a head trains on (``agentspec.distill.responses``): the pair's own replies as token
ids, grown run after run without answering a prompt twice."""

from __future__ import annotations

import agentspec
from agentspec.distill.prompts import make_prompts, render
from agentspec.distill.responses import grow, read


def test_a_responses_file_grows_and_holds_the_pairs_replies(tiny_smol, tmp_path):
    path = tmp_path / "responses.safetensors"
    first = grow(tiny_smol, path, 3, concurrency=2, max_new_tokens=6, log=lambda _: None)
    assert [e.index for e in first] == [0, 1, 2] and read(path) == first
    more = grow(tiny_smol, path, 5, concurrency=2, max_new_tokens=6, log=lambda _: None)
    assert [e.index for e in more] == [0, 1, 2, 3, 4] and more[:3] == first  # the first three kept
    specs = make_prompts(5)
    for example in more:
        assert example.prompt == render(tiny_smol.tokenizer, specs[example.index])
        assert example.kind == specs[example.index].kind and 0 < len(example.response) <= 6
        if example.greedy:  # the pair's greedy reply, as a call alone gives it
            alone = agentspec.generate(tiny_smol, example.prompt, "none", False, max_new_tokens=6)
            assert example.response == alone.token_ids
