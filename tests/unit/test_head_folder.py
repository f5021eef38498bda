"""Heads in the speculators format (``agentspec.head_folder``: EAGLE-3, DFlash, DSpark): what a
malformed folder is told, and decoding with each kind of head losslessly on every path.

The heads here are random (built for a tiny target, written by ``save_head``); tests/e2e/
test_speculators_heads.py holds them to folders speculators itself wrote and to its module's logits.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from heads import new_block_head, new_eagle3, save_head
from safetensors.torch import load_file, save_file

import agentspec
from agentspec import ModelPair
from agentspec.cache import PrefixCache
from agentspec.head_folder import HeadFolderError, is_head_folder, load_head

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(3, vocab_size=VOCAB, hidden=32, layers=4, max_positions=512, logit_scale=4.0)


@pytest.fixture(scope="module")
def folder(target, tmp_path_factory):
    torch.manual_seed(0)
    head = new_eagle3(target, [0, 2, 3], draft_ids=torch.arange(0, VOCAB, 2)).eval()
    return save_head(head, tmp_path_factory.mktemp("head") / "eagle3", verifier=target, with_embeddings=True)


HEADS = {
    "eagle3": None,  # the ``folder`` fixture's
    "dflash": {"kind": "dflash", "feature_layers": [1, 3], "block_size": 4, "mask_token_id": 9},
    "dspark": {
        "kind": "dspark",
        "feature_layers": [0, 2, 3],
        "block_size": 5,
        "mask_token_id": 2,
        "markov_head_type": "rnn",
        "draft_ids": torch.arange(0, VOCAB, 2),
    },  # fmt: skip
    "dspark-no-anchor": {
        "kind": "dspark",
        "feature_layers": [2],
        "block_size": 4,
        "mask_token_id": 2,
        "sample_from_anchor": False,
        "markov_head_type": "gated",
    },  # fmt: skip
}


@pytest.fixture(scope="module", params=list(HEADS))
def head_folder(request, target, folder, tmp_path_factory):
    """Each kind of head, written and read back as a folder."""
    spec = HEADS[request.param]
    if spec is None:
        return folder
    torch.manual_seed(1)
    spec = dict(spec)
    head = new_block_head(target, spec.pop("kind"), spec.pop("feature_layers"), **spec).eval()
    with torch.no_grad():  # the Markov factors large enough to matter
        for name, p in head.named_parameters():
            if "markov" in name:
                p.normal_(0, 0.3)
    return save_head(head, tmp_path_factory.mktemp(request.param) / "head", verifier=target)


@pytest.fixture()
def pair(target, head_folder, fake_tokenizer):
    head = load_head(head_folder, target)
    cache = PrefixCache(64 << 20)
    return ModelPair(
        target=target, draft=head, tokenizer=fake_tokenizer(VOCAB), name="tiny", prefix_cache=cache
    )


def altered(folder, tmp_path, config=None, tensors=None, raw: bytes | None = None):
    """A copy of ``folder`` with config.json fields, tensors or the weights' bytes replaced."""
    out = tmp_path / "altered"
    out.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in (config or {}).items():
        cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    if raw is not None:
        (out / "model.safetensors").write_bytes(raw)
    else:
        state = load_file(str(folder / "model.safetensors"))
        for key, value in (tensors or {}).items():
            if value is None:
                state.pop(key)
            else:
                state[key] = value
        save_file(state, str(out / "model.safetensors"))
    return out


def test_a_saved_head_reloads_with_the_same_logits(target, folder):
    head = load_head(folder, target)
    again = load_head(folder, target)
    g, ids = torch.randn(1, 5, 32), torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        a = head.scores(head.hidden(g, ids, head.new_cache()))
        b = again.scores(again.hidden(g, ids, again.new_cache()))
    assert torch.equal(a, b) and a.shape == (1, 5, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[head.draft_ids] = False
    assert (a[..., outside] < -1e3).all()  # ids outside the draft vocabulary: q = 0
    assert is_head_folder(folder) and head.feature_layers == (0, 2, 3)
    assert "embed_tokens.weight" not in head.state_dict()  # the target's embeddings, not a copy


def test_load_pair_takes_a_head_folder(target, head_folder, fake_tokenizer):
    pair = agentspec.load_pair(
        target, draft_model=head_folder, tokenizer=fake_tokenizer(VOCAB), warm_up=False
    )
    kind = json.loads((head_folder / "config.json").read_text())["speculators_model_type"]
    assert pair.draft.architecture == kind and pair.draft_head is pair.draft


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"config": {"speculators_model_type": "medusa"}},
            "speculators_model_type 'medusa' is an unknown type",
        ),
        ({"config": {"speculators_model_type": "mtp"}}, "does not load yet"),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [0, 2]}}, "fc.weight has shape"),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}, "[4] out of range"),
        ({"config": {"eagle_aux_hidden_state_layer_ids": "2"}}, "must be a list of layer ids"),
        ({"config": {"target_hidden_size": 64}}, "target_hidden_size 64"),
        ({"config": {"draft_vocab_size": 30}}, "d2t has shape [32], not [draft_vocab_size=30]"),
        ({"tensors": {"d2t": torch.full((32,), 40)}}, "outside the target vocabulary"),
        ({"tensors": {"t2d": torch.ones(60, dtype=torch.bool)}}, "t2d has shape [60]"),
        ({"tensors": {"d2t": None}}, "needs d2t and t2d"),
        ({"tensors": {"fc.weight": None}}, "missing=['fc.weight']"),
        ({"tensors": {"embed_tokens.weight": torch.zeros(VOCAB + 1, 32)}}, "embed_tokens has shape"),
        ({"raw": b"\x08\x00\x00\x00\x00\x00\x00\x00{}"}, "not a readable safetensors file"),
    ],
)
def test_a_malformed_folder_names_its_field(target, folder, tmp_path, change, message):
    bad = altered(folder, tmp_path, **change)
    with pytest.raises(HeadFolderError) as info:
        load_head(bad, target)
    assert message in str(info.value)


def test_a_truncated_weights_file_and_another_targets_width(target, folder, tmp_path, tiny_llama):
    data = (folder / "model.safetensors").read_bytes()
    with pytest.raises(HeadFolderError, match="corrupt or truncated"):
        load_head(altered(folder, tmp_path, raw=data[: len(data) // 2]), target)
    wider = tiny_llama(3, vocab_size=VOCAB, hidden=64, layers=4)
    with pytest.raises(HeadFolderError, match="hidden_size 32 is not the target's 64"):
        load_head(folder, wider)
    other_vocab = tiny_llama(3, vocab_size=VOCAB + 8, hidden=32, layers=4)
    with pytest.raises(HeadFolderError, match="vocab_size 64 is not the target's 72"):
        load_head(folder, other_vocab)


def test_another_verifier_is_a_warning(target, folder, tmp_path, caplog, monkeypatch):
    cfg = json.loads((folder / "config.json").read_text())
    verifier = {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "/somewhere/Qwen3-8B"}
    bad = altered(
        folder, tmp_path, config={"speculators_config": {**cfg["speculators_config"], "verifier": verifier}}
    )
    monkeypatch.setattr(target.config, "name_or_path", "/models/tiny-llama")
    monkeypatch.setattr(target.config, "architectures", ["LlamaForCausalLM"])
    with caplog.at_level(logging.WARNING, logger="agentspec.head_folder"):
        load_head(bad, target)
    assert "trained for 'Qwen3-8B'" in caplog.text and "['Qwen3ForCausalLM']" in caplog.text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 1}, "block_size must be an integer of at least 2"),
        ({"mask_token_id": VOCAB}, "mask_token_id must be a token id in [0, 64)"),
        ({"mask_token_id": None}, "mask_token_id must be a token id"),
        ({"markov_rank": 0}, "markov_rank must be a positive integer"),
        ({"markov_head_type": "lstm"}, "markov_head_type 'lstm' is unknown"),
        ({"aux_hidden_state_layer_ids": [9]}, "aux_hidden_state_layer_ids [9] out of range"),
    ],
)
def test_a_malformed_block_folder_names_its_field(target, tmp_path, change, message):
    head = new_block_head(target, "dspark", [1, 3])
    folder = save_head(head, tmp_path / "dspark", verifier=target)
    bad = altered(folder, tmp_path, config=change)
    with pytest.raises(HeadFolderError) as info:
        load_head(bad, target)
    assert message in str(info.value)


def test_a_block_heads_sliding_window_layers_are_refused(target, tmp_path):
    folder = save_head(new_block_head(target, "dflash", [1]), tmp_path / "d", verifier=target)
    layers = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    layers.update(
        layer_types=["sliding_attention"], use_sliding_window=True, sliding_window=4, max_window_layers=0
    )
    with pytest.raises(HeadFolderError, match="sliding-window layers are not supported"):
        load_head(altered(folder, tmp_path, config={"transformer_layer_config": layers}), target)


def test_a_dspark_draft_carries_its_survival_estimates(target, fake_tokenizer):
    from agentspec.config import GenerationConfig
    from agentspec.drafters.block import BlockDrafter

    head = new_block_head(target, "dspark", [1, 3], block_size=4).eval()
    drafter = BlockDrafter(head, VOCAB)
    ids = [5, 9, 2, 33, 7, 41]
    assert drafter.propose(ids, 4, GenerationConfig(), None).tokens == []  # no features yet
    _, feats = agentspec.kv.ModelState(target).forward(ids[:-1], 1, features=(1, 3))
    drafter.observe_features(0, feats)
    draft = drafter.propose(ids, 3, GenerationConfig(), None)
    assert len(draft.tokens) == 3 and draft.survival.shape == (3,)
    assert ((draft.survival > 0) & (draft.survival < 1)).all()


@pytest.mark.parametrize("drafter", ["model", "model_scheduled", "auto"])
def test_greedy_decoding_with_a_head_is_lossless(pair, head_folder, drafter):
    if drafter == "model_scheduled" and pair.draft.architecture != "eagle3":
        with pytest.raises(ValueError, match="use 'model'"):
            agentspec.generate(pair, [1, 2, 3], drafter=drafter, max_new_tokens=4)
        return
    accepted = 0
    for prompt in ([1, 5, 9, 2, 33, 7], [4, 4, 4, 8, 8, 8, 15, 16, 23, 42] * 3):
        plain = agentspec.generate(pair, prompt, speculative=False, max_new_tokens=40, prefix_cache=False)
        for k in (1, 4):
            spec = agentspec.generate(
                pair, prompt, drafter=drafter, num_draft_tokens=k, max_new_tokens=40, prefix_cache=False
            )
            assert spec.token_ids == plain.token_ids, (drafter, k)
            accepted += spec.stats.accepted_tokens
    if drafter == "model" and not head_folder.parent.name.startswith("dspark-no-anchor"):
        assert accepted > 0  # drafts accepted as well as rejected (this random one accepts none)


def test_through_the_prefix_cache(pair):
    """A later call restores the prefix but for the head's ``context_rows``, computed again for their
    features: the head drafts from its first pass on."""
    prompt = [7, 3, 11, 2, 9, 30, 31, 5, 8, 13] * 12
    plain = agentspec.generate(pair, prompt, speculative=False, max_new_tokens=30, prefix_cache=False)
    cold = agentspec.generate(pair, prompt, drafter="model", max_new_tokens=30)
    warm = agentspec.generate(pair, prompt + plain.token_ids[:5], drafter="model", max_new_tokens=25)
    assert cold.token_ids == plain.token_ids
    assert warm.token_ids == plain.token_ids[5:]
    assert warm.stats.cached_tokens == len(prompt) + 5 - 1 - pair.draft.context_rows
    # it drafts on as many passes as a cold call: all but its first (the prompt's) and any at the budget
    assert warm.stats.draft_tokens > 0
    assert warm.stats.source_steps.get("none", 0) <= cold.stats.source_steps.get("none", 0)


def test_beside_other_calls_in_packed_passes(pair):
    """Calls at once on one pair share the target's passes (the features tapped for the head's calls)."""
    prompts = [[1, 5, 9, 2], [33, 7, 12, 40, 41], [4, 8, 15, 16, 23], [9, 9, 9, 2]]
    drafters = ["model", "suffix", "model", "none"]
    plain = [
        agentspec.generate(pair, p, speculative=False, max_new_tokens=24, prefix_cache=False).token_ids
        for p in prompts
    ]
    got: dict[int, list[int]] = {}

    def run(i):
        got[i] = agentspec.generate(
            pair, prompts[i], drafter=drafters[i], max_new_tokens=24, prefix_cache=False
        ).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(len(prompts))] == plain


def test_a_failing_head_leaves_the_call_and_the_pair_usable(pair, monkeypatch):
    """A head that raises mid-call: the call finishes with the target alone, and the next call drafts."""
    from agentspec.drafters.block import BlockHead
    from agentspec.drafters.eagle import EagleState

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = agentspec.generate(pair, prompt, speculative=False, max_new_tokens=16, prefix_cache=False)

    def broken(*args, **kwargs):
        raise RuntimeError("head exploded")

    with monkeypatch.context() as patch:
        if isinstance(pair.draft, BlockHead):
            patch.setattr(BlockHead, "block", broken)
        else:
            patch.setattr(EagleState, "observe", broken)
        failed = agentspec.generate(pair, prompt, drafter="model", max_new_tokens=16, prefix_cache=False)
    assert failed.token_ids == plain.token_ids
    again = agentspec.generate(pair, prompt, drafter="model", max_new_tokens=16, prefix_cache=False)
    assert again.token_ids == plain.token_ids and again.stats.draft_tokens > 0
