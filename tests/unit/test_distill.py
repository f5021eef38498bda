"""``agentspec distill`` end to end on a tiny random target, plus the pure parts by hand.

The target is a random 3-layer Llama over a byte-level tokenizer with a ChatML template, both built
here (no downloads), so the real path runs: built-in prompts rendered with the chat template,
left-padded batched ``generate``, shards, training, checkpoints, the draft folder, ``load_pair`` and
lossless decoding with the result. CI never trains a real draft; this checks the pipeline.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import agentspec
from agentspec.distill import DistillConfig, distill
from agentspec.distill.data import Example, load_examples
from agentspec.distill.prompts import KINDS, PromptSpec, is_heldout, make_prompts, render
from agentspec.distill.student import build_student, draft_vocab
from agentspec.distill.train import accepted_run, collate, distill_loss, lr_at, make_batches
from agentspec.draft_folder import MARKER, VOCAB_KEY, SubsetHead, is_draft_folder, load_draft
from agentspec.drafters.eagle import OUTSIDE_LOGIT

pytestmark = pytest.mark.usefixtures("one_thread")

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# small and fast: a few prompts, short responses, a handful of steps; time_budget_s=None (steps)
TINY = dict(
    n_prompts=14,
    max_new_tokens=8,
    heldout_fraction=0.25,
    shard_prompts=4,
    gen_batch_size=4,
    batch_tokens=4096,
    checkpoint_every=2,
    time_budget_s=None,
    progress=False,
)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE without merges (259 ids: 256 bytes + 3 specials) and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # sorted: alphabet() comes in set order, which changes with each process's hash seed, and with
    # it every id, so a random target's output (once an immediate EOS in CI) changed from run to run
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=CHATML)
    tok.add_special_tokens(
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>"}
    )
    return tok


@pytest.fixture(scope="module")
def tiny_target(tiny_llama, byte_tokenizer):
    # a long context: byte-level prompts with tool schemas run to ~2,000 tokens
    return tiny_llama(
        0, vocab_size=len(byte_tokenizer), hidden=32, layers=3, max_positions=4096, logit_scale=3.0
    )


@pytest.fixture(scope="module")
def distilled(tiny_target, byte_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    # draft_vocab=64 of 259 ids: the draft's head is a SubsetHead (the default recipe's 8,192 of 49k)
    distill(tiny_target, out, tokenizer=byte_tokenizer, steps=4, n_layers=2, draft_vocab=64,
            architecture="layers", **TINY)  # fmt: skip
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def assert_lossless(pair, tokenizer, drafters) -> None:
    """Greedy decoding with each drafter equals plain decoding, and ``model`` drafts."""
    # no EOS: a random target may end at once, and an EAGLE head drafts from the second pass on
    options = dict(max_new_tokens=24, eos_token_ids=frozenset())
    for text in ("What is 7 times 8?", "Write a Python function that reverses a list."):
        ids = chat_ids(tokenizer, text)
        plain = agentspec.generate(pair, ids, speculative=False, **options)
        assert len(plain.token_ids) == 24
        for drafter in drafters:
            spec = agentspec.generate(pair, ids, drafter=drafter, **options)
            assert spec.token_ids == plain.token_ids, f"{drafter=}"
            # the schedule may bench a draft that does not pay (timing-dependent); "model" always drafts
            assert drafter != "model" or spec.stats.draft_tokens > 0


# ----------------------------------------------------------------------------- pure functions
def test_loss_is_zero_when_the_student_is_the_teacher_on_its_support():
    # teacher top-2 over a 5-token vocabulary: p = (0.75, 0.25) on ids (3, 1)
    ids = torch.tensor([[3, 1]])
    logp = torch.log(torch.tensor([[0.75, 0.25]]))
    same = torch.full((1, 5), -1e9)
    same[0, 3], same[0, 1] = math.log(0.75), math.log(0.25)
    assert distill_loss(same, ids, logp).item() == pytest.approx(0.0, abs=1e-6)
    # uniform student: KL = sum p (log p - log 1/5)
    want = 0.75 * (math.log(0.75) + math.log(5)) + 0.25 * (math.log(0.25) + math.log(5))
    assert distill_loss(torch.zeros(1, 5), ids, logp).item() == pytest.approx(want, rel=1e-5)
    # the teacher's top-k is renormalised: scaling its log-probs by a constant changes nothing
    assert distill_loss(torch.zeros(1, 5), ids, logp - 1.0).item() == pytest.approx(want, rel=1e-5)
    # + CE on the argmax (id 3): -log(1/5)
    got = distill_loss(torch.zeros(1, 5), ids, logp, ce_weight=0.5).item()
    assert got == pytest.approx(want + 0.5 * math.log(5), rel=1e-5)
    # weights: a weighted mean over positions
    two = distill_loss(
        torch.stack([same[0], torch.zeros(5)]), ids.repeat(2, 1), logp.repeat(2, 1), torch.tensor([1.0, 3.0])
    )
    assert two.item() == pytest.approx(3 * want / 4, rel=1e-5)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = DistillConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, steps=110, time_budget_s=None)
    assert lr_at(0, 110, cfg) == pytest.approx(1e-4)
    assert lr_at(9, 110, cfg) == pytest.approx(1e-3)
    assert lr_at(60, 110, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(110, 110, cfg) == pytest.approx(1e-4)
    assert lr_at(50, None, cfg) == pytest.approx(1e-3)  # total not known yet: the peak


def test_batches_cover_every_example_once_within_the_token_budget():
    lengths = [5, 300, 40, 41, 7, 900, 12, 12, 100, 64] * 13
    batches = make_batches(lengths, batch_tokens=512, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 512, f"{b=}"
    assert batches == make_batches(lengths, 512, seed=3) != make_batches(lengths, 512, seed=4)


def test_generation_batches_group_by_mode_and_length_within_the_budgets():
    from agentspec.distill.data import PromptItem, generation_batches

    lengths = [40, 600, 35, 300, 90, 45, 310, 50]
    items = [PromptItem([0] * n, "chat", greedy=i % 4 != 3) for i, n in enumerate(lengths)]
    batches = generation_batches(items, max_prompts=3, max_tokens=700)
    # greedy first, each call one mode, sorted by length, <= 3 prompts and <= 700 padded tokens
    assert batches == [[2, 0, 5], [4, 6], [1], [7, 3]]


def test_collate_maps_teacher_rows_to_the_positions_that_predict_them():
    k = 2
    resp = Example(torch.tensor([5, 6, 7, 8]), start=2, first=2, topk_ids=torch.tensor([[7, 0], [8, 0]]),
                   topk_logp=torch.zeros(2, k), kind="chat", greedy=True)  # fmt: skip
    full = Example(torch.tensor([1, 2, 3]), start=2, first=1, topk_ids=torch.tensor([[2, 0], [3, 0]]),
                   topk_logp=torch.zeros(2, k), kind="chat", greedy=True)  # fmt: skip
    b = collate([resp, full], pad_id=0, prompt_weight=0.5)
    # row 0 (width 4): positions 1, 2 predict ids 7, 8; row 1: position 0 predicts 2 (prompt), 1 predicts 3
    assert b.positions.tolist() == [1, 2, 4, 5]
    assert b.weights.tolist() == [1.0, 1.0, 0.5, 1.0]
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 0]]
    b0 = collate([resp, full], pad_id=0, prompt_weight=0.0)
    assert b0.positions.tolist() == [1, 2, 5]  # prompt rows dropped


def test_accepted_run_counts_agreements_in_a_row():
    agree = torch.tensor([True, True, False, True, True, True, True, True])
    assert accepted_run(agree, 4).tolist() == [2, 1, 0, 4, 4, 3, 2, 1]


def test_bad_config_raises_a_clear_value_error():
    with pytest.raises(ValueError, match="n_layers"):
        DistillConfig(n_layers=0)
    with pytest.raises(ValueError, match="init_layers"):
        DistillConfig(n_layers=2, init_layers=(0, 5, 9), architecture="layers")
    with pytest.raises(ValueError, match="one layer"):
        DistillConfig(init_layers=(0, 5))  # an EAGLE head (the default) has one layer
    with pytest.raises(ValueError, match="architecture"):
        DistillConfig(architecture="medusa")
    with pytest.raises(ValueError, match="greedy_fraction"):
        DistillConfig(greedy_fraction=1.5)
    with pytest.raises(ValueError, match="lr"):
        DistillConfig(lr=0)
    with pytest.raises(ValueError, match="steps"):
        DistillConfig(time_budget_s=None)  # nothing would end training
    with pytest.raises(ValueError, match="time_budget_s"):
        DistillConfig(time_budget_s=-5)
    with pytest.raises(TypeError):
        DistillConfig(layers=2)  # not a field


def test_init_layers_out_of_range_names_the_option(tiny_target):
    with pytest.raises(ValueError, match=r"init_layers: \[7\] out of range"):
        build_student(tiny_target, 2, (0, 7))


def test_cli_rejects_a_bad_option_before_loading_anything(tmp_path, capsys):
    from agentspec.cli import main

    assert main(["distill", "--out", str(tmp_path / "d"), "--layers", "0"]) == 2
    assert "n_layers" in capsys.readouterr().err


def test_cli_options_reach_the_config(tmp_path, monkeypatch):
    import agentspec.distill
    from agentspec.cli import main

    seen = {}
    monkeypatch.setattr(
        agentspec.distill, "distill", lambda target, out, config: seen.update(locals()) or out
    )
    argv = [
        "distill",
        "--out",
        str(tmp_path),
        "--architecture",
        "layers",
        "--init-layers",
        "0,29",
        "--time-budget-s",
        "0",
        "--steps",
        "5",
    ]
    assert main([*argv, "--no-resume", "--target", "some/model"]) == 0
    cfg = seen["config"]
    assert (seen["target"], cfg.architecture, cfg.init_layers, cfg.time_budget_s, cfg.steps, cfg.resume) == (
        "some/model", "layers", (0, 29), None, 5, False)  # fmt: skip
    assert (cfg.n_layers, cfg.n_prompts) == (DistillConfig().n_layers, DistillConfig().n_prompts)


# ------------------------------------------------------------------------------------- prompts
def test_prompts_are_deterministic_varied_and_prefix_stable(byte_tokenizer):
    a, b = make_prompts(200, seed=0), make_prompts(200, seed=0)
    assert [p.key() for p in a] == [p.key() for p in b]
    assert [p.key() for p in make_prompts(50, seed=0)] == [p.key() for p in a[:50]]
    assert [p.key() for p in make_prompts(50, seed=1)] != [p.key() for p in a[:50]]
    assert len({p.key() for p in a}) == 200
    assert {p.kind for p in a} == set(KINDS)
    held = [is_heldout(p.key(), 0.1) for p in a]
    assert 5 <= sum(held) <= 40, f"{sum(held)=}"
    # rendered the way the LangChain chat model renders tools for a template without tool support
    tool_result = next(p for p in a if p.kind == "tool_result")
    text = byte_tokenizer.decode(render(byte_tokenizer, tool_result))
    assert "<tools>" in text and "<tool_call>\n{" in text and "<tool_response>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    forced = next(p for p in a if p.kind == "tool_call" and p.tool_choice == "any" and len(p.tools) > 1)
    assert byte_tokenizer.decode(render(byte_tokenizer, forced)).endswith(
        'assistant\n<tool_call>\n{"name": "'
    )


@pytest.mark.model
def test_prompts_render_as_the_chat_model_renders_them():
    """On SmolLM2's tokenizer, every kind renders to the ids ``langchain_agentspec`` gives."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from transformers import AutoTokenizer

    from agentspec.models import ensure_default_model
    from langchain_agentspec.messages import render as lc_render

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))

    def to_langchain(spec: PromptSpec):
        out = []
        for i, m in enumerate(spec.messages):
            if m["role"] == "system":
                out.append(SystemMessage(m["content"]))
            elif m["role"] == "user":
                out.append(HumanMessage(m["content"]))
            elif m["role"] == "assistant":
                calls = [{"name": c["function"]["name"], "args": c["function"]["arguments"], "id": f"c{i}"}
                         for c in m.get("tool_calls", [])]  # fmt: skip
                out.append(AIMessage(m["content"], tool_calls=calls))
            else:
                out.append(ToolMessage(m["content"], tool_call_id=f"c{i - 1}", name=m["name"]))
        return out

    for spec in make_prompts(120, seed=0):
        want = lc_render(tok, to_langchain(spec), tools=spec.tools, tool_choice=spec.tool_choice).ids
        assert render(tok, spec) == want, f"{spec.kind=} {spec.tool_choice=}"


# --------------------------------------------------------------------------------- the pipeline
def test_stored_distributions_are_the_targets_teacher_forced_ones(distilled, tiny_target):
    examples = load_examples(distilled / "data", "train")
    assert len(examples) >= 8 and any(not e.greedy for e in examples) and any(e.greedy for e in examples)
    for e in examples:
        # the default recipe weights prompt positions too (prompt_weight > 0): stored from token 1
        assert e.first == 1 and len(e.topk_ids) == len(e.ids) - 1 and e.start < len(e.ids)
        with torch.no_grad():
            logp = torch.log_softmax(tiny_target(e.ids[None]).logits[0].float(), dim=-1)
        rows = logp[e.first - 1 : -1]  # position i predicts token i + 1
        ref = rows.gather(-1, e.topk_ids.long())
        err = (ref - e.topk_logp.float()).abs().max().item()
        assert err < 2e-2, f"{err=}"  # float16 storage
        assert torch.equal(rows.argmax(-1).int(), e.topk_ids[:, 0])
        if e.greedy:  # a greedy response is the teacher's argmax, token after token
            assert e.ids[e.start :].tolist() == e.topk_ids[e.start - e.first :, 0].tolist()


def heldout_responses(folder) -> list[int]:
    """Each held-out example's response length: the positions where evaluation compares argmaxes."""
    return [len(e.ids) - e.start for e in load_examples(folder / "data", "eval")]


def assert_agreement_over_heldout(held: dict, folder) -> None:
    """The reported agreement counts agreeing positions over exactly the held-out responses."""
    n = sum(heldout_responses(folder))
    assert held["positions"] == n > 0, (held, n)
    agreed = held["top1_agreement"] * n
    assert agreed == pytest.approx(round(agreed), abs=1e-6), (held, n)


def test_a_draft_that_is_the_whole_target_agrees_everywhere_before_training(
    tiny_target, byte_tokenizer, tmp_path
):
    """The evaluation on a case whose answer is known: a draft of all the target's layers and its
    full LM head is the target, so before training its argmax is the teacher's at every held-out
    position, and a k-token draft from a position is accepted to the response's end or to k."""
    out = distill(tiny_target, tmp_path / "d", tokenizer=byte_tokenizer, steps=1, n_layers=3,
                  init_layers=(0, 1, 2), draft_vocab=None, architecture="layers", **TINY)  # fmt: skip
    before = json.loads((out / "metrics.json").read_text())["heldout_before"]
    lengths = heldout_responses(out)
    accepted = sum(min(n - i, 4) for n in lengths for i in range(n))
    assert before["positions"] == sum(lengths) and before["top1_agreement"] == 1.0, before
    assert before["mean_accepted_k4"] == pytest.approx(accepted / sum(lengths)), before


def test_draft_folder_stores_only_its_own_weights(distilled, tiny_target):
    from safetensors import safe_open

    assert is_draft_folder(distilled)
    names = {"config.json", "model.safetensors", MARKER, "README.md", "metrics.json", "tokenizer.json"}
    assert names <= set(os.listdir(distilled))
    assert sorted(os.listdir(distilled / "checkpoints")) == ["step-0000002.pt", "step-0000004.pt"]
    assert any(name.startswith("train-") for name in os.listdir(distilled / "data"))
    with safe_open(str(distilled / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in keys - {VOCAB_KEY}}
        vocab = f.get_tensor(VOCAB_KEY)
    assert keys and not any("embed_tokens" in k or k.startswith("lm_head") for k in keys), keys
    assert dtypes == {torch.float16}, dtypes  # half the bytes; upcast when loaded
    assert vocab.numel() == 64 and vocab.unique().numel() == 64 and int(vocab.min()) >= 0
    marker = json.loads((distilled / MARKER).read_text())
    assert marker["embedding_shape"] == list(tiny_target.get_input_embeddings().weight.shape)
    metrics = json.loads((distilled / "metrics.json").read_text())
    assert metrics["steps"] == 4
    assert_agreement_over_heldout(metrics["heldout"], distilled)
    assert "top-1 agreement" in (distilled / "README.md").read_text()


def test_loaded_draft_shares_the_targets_tensors(distilled, tiny_target):
    draft = load_draft(distilled, tiny_target)
    assert draft.get_input_embeddings() is tiny_target.get_input_embeddings()
    assert draft.config.num_hidden_layers == 2 and draft.dtype == tiny_target.dtype
    head, full = draft.get_output_embeddings(), tiny_target.get_output_embeddings()
    assert isinstance(head, SubsetHead) and head.ids.numel() == 64
    assert torch.equal(head.weight, full.weight[head.ids])
    assert tiny_target.get_output_embeddings() is full  # the target keeps its own head


def test_subset_head_scores_its_ids_and_fills_the_rest():
    weight = torch.randn(10, 4)
    head = SubsetHead(weight, torch.tensor([1, 4, 7]))
    hidden = torch.randn(2, 3, 4)
    out = head(hidden)
    full = hidden @ weight.T
    assert out.shape == (2, 3, 10)
    assert torch.allclose(out[..., [1, 4, 7]], full[..., [1, 4, 7]])
    rest = [0, 2, 3, 5, 6, 8, 9]
    assert (out[..., rest] == OUTSIDE_LOGIT).all()
    # a grammar mask leaving only ids outside the head still gives a distribution (no NaN)
    masked = torch.full_like(out, float("-inf"))
    masked[..., [2, 3]] = out[..., [2, 3]]
    assert torch.allclose(masked.softmax(-1)[..., [2, 3]], torch.tensor(0.5))


def test_draft_vocab_takes_the_most_frequent_then_the_lowest_ids():
    data = [torch.tensor([9, 9, 9, 5, 5, 7]), torch.tensor([5, 2])]
    # counts: 5 and 9 three times, 2 and 7 once; equal counts: the lower id first
    assert draft_vocab(data, 12, 3).tolist() == [2, 5, 9]
    assert draft_vocab(data, 12, 6).tolist() == [0, 1, 2, 5, 7, 9]  # never seen: 0 and 1
    assert draft_vocab(data, 12, 50).tolist() == list(range(12))


def test_load_draft_refuses_another_target(distilled, tiny_llama):
    other = tiny_llama(1, vocab_size=300, hidden=32, layers=3, max_positions=4096)
    with pytest.raises(ValueError, match="embedding of shape"):
        load_draft(distilled, other)


def test_decoding_with_the_distilled_draft_is_lossless(distilled, tiny_target, byte_tokenizer):
    pair = agentspec.load_pair(tiny_target, distilled, tokenizer=byte_tokenizer, device="cpu")
    assert (
        pair.draft_name == str(distilled)
        and pair.draft.get_input_embeddings() is tiny_target.get_input_embeddings()
    )
    assert_lossless(pair, byte_tokenizer, ("model", "model_scheduled"))


def test_resume_continues_from_the_last_checkpoint(
    distilled, tiny_target, byte_tokenizer, tmp_path, monkeypatch
):
    import shutil

    import agentspec.distill.pipeline as pipeline

    out = tmp_path / "draft"
    shutil.copytree(distilled, out)
    shard = out / "data" / "train-00000.pt"
    mtime = shard.stat().st_mtime_ns
    logs: list[str] = []
    monkeypatch.setattr(pipeline, "_log", lambda cfg: logs.append)
    cfg = DistillConfig(steps=6, n_layers=2, architecture="layers", **TINY)
    distill(tiny_target, out, tokenizer=byte_tokenizer, config=cfg)
    assert any("resuming from step 4" in line for line in logs), logs
    assert shard.stat().st_mtime_ns == mtime  # the data is not generated again
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000004.pt", "step-0000006.pt"]
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6
    with pytest.raises(ValueError, match="n_layers"):  # another draft shape cannot resume
        distill(tiny_target, out, tokenizer=byte_tokenizer, config=cfg.replace(n_layers=1, steps=8))
    with pytest.raises(ValueError, match="architecture"):
        distill(tiny_target, out, tokenizer=byte_tokenizer, config=cfg.replace(architecture="eagle", steps=8))


def test_prompt_positions_and_token_id_prompts(tiny_target, tmp_path):
    """Prompts given as token ids (no chat template needed); prompt positions stored and weighted."""
    prompts = [[(7 * i + j) % 250 for j in range(5 + i)] for i in range(10)]
    out = distill(tiny_target, tmp_path / "d", prompts=prompts, steps=2, n_layers=1, init_layers=(2,),
                  prompt_weight=0.3, architecture="layers", **{**TINY, "heldout_fraction": 0.3})  # fmt: skip
    e = load_examples(out / "data", "train")[0]
    assert e.first == 1 and len(e.topk_ids) == len(e.ids) - 1 and e.kind == "custom"
    assert load_draft(out, tiny_target).config.num_hidden_layers == 1


def test_time_budget_stops_cleanly_with_a_loadable_draft(tiny_target, byte_tokenizer, tmp_path):
    """A budget already spent: one training shard (always), no step, yet a checkpoint and a draft."""
    opts = {**TINY, "time_budget_s": 0.01}
    out = distill(
        tiny_target, tmp_path / "d", tokenizer=byte_tokenizer, n_layers=1, architecture="layers", **opts
    )
    assert sorted(p.name for p in (out / "data").glob("train-*.pt")) == ["train-00000.pt"]
    assert os.listdir(out / "checkpoints") == ["step-0000000.pt"]
    assert json.loads((out / "metrics.json").read_text())["steps"] == 0
    assert load_draft(out, tiny_target).config.num_hidden_layers == 1


# ------------------------------------------------------------------------------ an EAGLE head
@pytest.fixture(scope="module")
def distilled_eagle(tiny_target, byte_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    distill(tiny_target, out, tokenizer=byte_tokenizer, steps=4, draft_vocab=64, **TINY)  # the default
    return out


def test_eagle_head_is_distilled_saved_and_loaded(distilled_eagle, tiny_target, byte_tokenizer):
    from safetensors import safe_open

    from agentspec.drafters.eagle import is_eagle

    marker = json.loads((distilled_eagle / MARKER).read_text())
    assert marker["architecture"] == "eagle" and marker["init_layers"] == [2]  # the target's last
    assert any(name.startswith("features-train-") for name in os.listdir(distilled_eagle / "data"))
    with safe_open(str(distilled_eagle / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "fc.bias", VOCAB_KEY} <= keys and not any(k.startswith("lm_head") for k in keys)
    metrics = json.loads((distilled_eagle / "metrics.json").read_text())
    assert metrics["steps"] == 4
    assert_agreement_over_heldout(metrics["heldout"], distilled_eagle)
    assert "EAGLE" in (distilled_eagle / "README.md").read_text()
    head = load_draft(distilled_eagle, tiny_target)
    assert is_eagle(head) and head.embed is tiny_target.get_input_embeddings()
    assert isinstance(head.get_output_embeddings(), SubsetHead)
    pair = agentspec.load_pair(tiny_target, distilled_eagle, tokenizer=byte_tokenizer, device="cpu")
    assert is_eagle(pair.draft)
    assert_lossless(pair, byte_tokenizer, ("model", "model_scheduled", "auto"))


def test_eagle_unrolled_training_runs_and_reports_the_chained_agreement(
    tiny_target, byte_tokenizer, tmp_path
):
    out = distill(tiny_target, tmp_path / "e2", tokenizer=byte_tokenizer, steps=2, eagle_unroll=2, **TINY)
    held = json.loads((out / "metrics.json").read_text())["heldout"]
    assert_agreement_over_heldout(held, out)
    # the second draft token's agreement, over the positions whose first was right: a fraction of
    # those, which only a full evaluation knows
    assert 0.0 <= held["chained_agreement"] <= 1.0
    with pytest.raises(ValueError, match="eagle_unroll"):
        DistillConfig(eagle_unroll=3)


@pytest.mark.model
def test_loading_the_embedded_pair_does_not_import_the_trainer():
    """Reading a draft folder belongs with loading models: ``agentspec.distill`` stays unimported."""
    import subprocess
    import sys

    code = (
        "import sys, agentspec;"
        "pair = agentspec.load_pair();"
        "assert pair.draft is not None, 'the embedded pair has its distilled draft';"
        "bad = [m for m in sys.modules if m.startswith('agentspec.distill')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
