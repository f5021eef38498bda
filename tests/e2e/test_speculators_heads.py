"""Heads that speculators itself built and saved (EAGLE-3, DFlash, DSpark), loaded by agentspec
(``agentspec.head_folder``).

speculators pins a transformers below ours, so it runs in ``.venv-vllm`` (``make vllm`` installs it):
``speculators_reference.py`` builds a head there for a tiny target folder written here, saves it with
``save_pretrained`` and records its own module's logits. Here the same folder drafts for the same
target: the target's features for the head's layers are speculators' (same layer numbering), the
head's logits are its module's (EAGLE-3: the first step and a chained draft step; DFlash and DSpark:
a block, with DSpark's Markov bias and confidence), and decoding with it is token-identical to
plain decoding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import agentspec
from agentspec import ModelPair
from agentspec.drafters.eagle import EagleState
from agentspec.fleet.vllm import VLLM_PYTHON
from agentspec.head_folder import load_head
from agentspec.kv import ModelState
from agentspec.models import EAGLE3_HEAD

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON}: make vllm"),
    pytest.mark.usefixtures("one_thread"),
]

SCRIPT = Path(__file__).with_name("speculators_reference.py")
VOCAB = 96

# (target family, the head's options): each norm switch and a second decoder layer, on each family
# speculators builds heads for (Qwen2: its EAGLE-3 heads have Llama layers; DFlash and DSpark heads
# need Qwen3's or Llama's attention config)
CASES = {
    "llama": ("llama", {"aux": [0, 2, 3], "draft_vocab": 48}),
    "llama-2-layers-fc-norm": (
        "llama",
        {"aux": [1, 3], "layers": 2, "fc_norm": True, "norm_before_residual": False},
    ),
    "qwen3-norm-before-fc-output": (
        "qwen3",
        {"aux": [0, 1, 3], "draft_vocab": 40, "norm_before_fc": True, "norm_output": True},
    ),
    "qwen2-llama-layers": ("qwen2", {"aux": [0, 2, 3], "draft_vocab": 48, "layer_family": "llama"}),
    "dflash-llama": ("llama", {"kind": "dflash", "aux": [1, 2, 3], "block_size": 4, "mask_token_id": 5}),
    "dflash-qwen3-2-layers": (
        "qwen3",
        {
            "kind": "dflash",
            "aux": [0, 3],
            "layers": 2,
            "block_size": 5,
            "mask_token_id": 0,
            "draft_vocab": 40,
        },
    ),
    "dspark-llama": (
        "llama",
        {"kind": "dspark", "aux": [1, 2, 3], "block_size": 4, "mask_token_id": 5, "markov_rank": 8},
    ),
    "dspark-qwen3-gated-no-anchor": (
        "qwen3",
        {
            "kind": "dspark",
            "aux": [0, 2],
            "block_size": 4,
            "mask_token_id": 1,
            "markov_rank": 6,
            "markov_head_type": "gated",
            "sample_from_anchor": False,
            "draft_vocab": 48,
        },
    ),  # fmt: skip
}
BLOCK = ("dflash", "dspark")


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory, tiny_llama, tiny_qwen):
    family, options = CASES[request.param]
    target = (
        tiny_llama(7, vocab_size=VOCAB, layers=4, max_positions=256)
        if family == "llama"
        else tiny_qwen(family, 7, VOCAB, layers=4)
    )
    out = tmp_path_factory.mktemp(request.param)
    target.save_pretrained(out / "target")
    run = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT), str(out / "target"), str(out), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    reference = torch.load(out / "reference.pt")
    return target, load_head(out / "head", target), reference, options


def test_the_targets_features_are_speculators_layers(built):
    target, head, ref, options = built
    ids = ref["ids"].tolist()
    n = len(ref["features"])
    _, features = ModelState(target).forward(ids[:n], keep=1, features=tuple(options["aux"]))
    assert head.feature_layers == tuple(options["aux"])
    torch.testing.assert_close(features, ref["features"], atol=1e-5, rtol=1e-4)


def test_the_heads_logits_are_speculators_modules(built):
    """Step 0 (every token beside the previous position's features) and one chained draft step (the
    token beside the head's own output), over the draft vocabulary."""
    target, head, ref, options = built
    if options.get("kind") in BLOCK:
        return check_block(head, ref)
    ids, features = ref["ids"].tolist(), ref["features"]
    cols = head.draft_ids if head.draft_ids is not None else slice(None)
    n = len(ids) - 2  # speculators' second step has a true next token for all but the last position
    state = EagleState(head)
    state.observe(0, features[:n])
    with torch.no_grad():
        first = state.forward(ids[: n + 1], keep=n)  # x_1..x_n: x_0 has no feature before it
        chained = state.forward([ids[n + 1]], keep=1)  # past the features: the head's own output
    torch.testing.assert_close(first[:, cols], ref["logits"][0][:n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chained[0, cols], ref["logits"][1][n - 1], atol=1e-4, rtol=1e-4)


def check_block(head, ref):
    """The block anchored at ``ref["anchor"]`` after the features of the positions before it; DSpark's
    sequential step on the true previous tokens, and its confidence."""
    from agentspec.drafters.block import BlockState

    ids, features, anchor = ref["ids"].tolist(), ref["features"], ref["anchor"]
    cols = head.draft_ids if head.draft_ids is not None else slice(None)
    state = BlockState(head)
    with torch.no_grad():
        state.observe(0, features[:anchor])
        hid = head.block(ids[anchor], state.cache)
        if head.markov_type is None:
            logits = head.scores(hid)
            torch.testing.assert_close(logits[:, cols], ref["logits"], atol=1e-4, rtol=1e-4)
            return
        markov = None
        for slot, prev in enumerate(ref["prev"].tolist()):
            logits, survival, markov = head.step(hid[slot], prev, markov)
            torch.testing.assert_close(logits[cols], ref["logits"][slot], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(survival, torch.sigmoid(ref["confidence"][slot]), atol=1e-5, rtol=1e-4)


def test_decoding_with_speculators_head_is_lossless(built, fake_tokenizer):
    target, head, _, _ = built
    pair = ModelPair(target=target, draft=head, tokenizer=fake_tokenizer(VOCAB), name="speculators-head")
    for prompt in ([3, 17, 5, 42, 9, 11, 60], [4, 8, 15, 16, 23, 42] * 4):
        plain = agentspec.generate(pair, prompt, speculative=False, max_new_tokens=30, prefix_cache=False)
        for k in (1, 3):
            spec = agentspec.generate(pair, prompt, drafter="model", num_draft_tokens=k, max_new_tokens=30)
            assert spec.token_ids == plain.token_ids, k
            assert spec.stats.draft_tokens > 0


def test_agentspec_distill_writes_a_head_in_the_speculators_format(tiny_smol, tmp_path):
    """``agentspec distill --architecture eagle3`` end to end on a tiny target folder: the responses grown
    by the pair, speculators' trainer in .venv-vllm, a folder agentspec loads and decodes with losslessly."""
    from agentspec.distill.heads import distill_eagle3
    from agentspec.distill.responses import read

    folder = tmp_path / "target"
    tiny_smol.target.save_pretrained(folder)
    tiny_smol.tokenizer.save_pretrained(folder)
    responses, out = tmp_path / "responses.safetensors", tmp_path / "head"
    options = {"responses": responses, "draft_vocab": 512, "feature_layers": [0, 1], "concurrency": 3}
    distill_eagle3(folder, out, prompts=6, minutes=0.05, **options)
    assert len(read(responses)) == 6
    training = json.loads((out / "training.json").read_text())
    assert training["steps"] >= 1 and training["curve"][-1]["acceptance_length"] >= 1.0
    # the loss saw response rows only; stored in bfloat16, without the target's embedding table
    data, seen = training["data"], training["curve"][-1]["tokens"]
    assert 0 < seen <= (training["epochs"] + 1) * (data["train_response_tokens"] + data["train_examples"])
    weights = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in weights and weights["fc.weight"].dtype == torch.bfloat16
    head = load_head(out, tiny_smol.target)
    assert head.feature_layers == (0, 1) and head.draft_ids is not None and len(head.draft_ids) == 512
    pair = ModelPair(target=tiny_smol.target, draft=head, tokenizer=tiny_smol.tokenizer, name="distilled")
    prompt = read(responses)[0].prompt
    plain = agentspec.generate(pair, prompt, speculative=False, max_new_tokens=16, prefix_cache=False)
    spec = agentspec.generate(pair, prompt, drafter="model", max_new_tokens=16, prefix_cache=False)
    assert spec.token_ids == plain.token_ids and spec.stats.draft_tokens > 0


@pytest.mark.skipif(not EAGLE3_HEAD.exists(), reason="no trained EAGLE-3 head in this checkout")
def test_the_trained_head_accepts_as_in_vllm(tmp_path):
    """The committed EAGLE-3 head on the real target, greedy, 3 tokens a pass, in agentspec and in vLLM's
    engine on the same held-out prompts (``python -m benchmarks vllm --part heads``): the mean acceptance
    lengths within 10% of each other, every reply alike in both and equal to plain decoding."""
    out = tmp_path / "heads.json"
    options = ["--k", "3", "--prompts", "4", "--max-tokens", "32", "--dtypes", "float32", "--out", str(out)]
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "vllm",
        "--part",
        "heads",
        "--head",
        str(EAGLE3_HEAD),
        *options,
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=SCRIPT.parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    heads = json.loads(out.read_text())["heads"]
    ours, vllm = heads["agentspec"], heads["vllm"]
    assert isinstance(vllm, dict), vllm
    assert ours["drafts"] > 0 and ours["accepted"] > 0
    assert 0.9 <= ours["acceptance_length"] / vllm["acceptance_length"] <= 1.1
    assert ours["outputs"] == vllm["outputs"] and heads["same_as_plain"] == "4/4"


@pytest.mark.skipif(not EAGLE3_HEAD.exists(), reason="no trained EAGLE-3 head in this checkout")
def test_a_vllm_worker_drafts_with_the_shipped_head():
    """``vllm_worker(head=...)``, the benchmarks' ``vllm_eagle3`` system: vLLM's OpenAI server drafts
    with the committed head (its per-request metrics count accepted drafts), and its greedy replies to
    prompt token ids are agentspec's plain decoding's."""
    import openai

    from agentspec.distill.prompts import make_prompts, render
    from agentspec.fleet.process import free_port
    from agentspec.fleet.vllm import vllm_worker

    pair = agentspec.load_pair(draft_model=False)
    prompts = [render(pair.tokenizer, spec) for spec in make_prompts(40)[-3:]]
    with vllm_worker(free_port(), head=EAGLE3_HEAD, eager=True, startup_timeout_s=480.0) as worker:
        client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        accepted = 0
        for ids in prompts:
            r = client.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0)
            plain = agentspec.generate(pair, ids, speculative=False, max_new_tokens=24, prefix_cache=False)
            assert r.choices[0].text == plain.text, ids
            accepted += r.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]
    assert accepted > 0, "no draft token was accepted: the head did not draft"
