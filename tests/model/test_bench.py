"""``agentspec bench`` and the LangChain agent loop beside it (``python -m benchmarks loop``): their
workloads, their arithmetic, and (slow) a whole short run of both on the real pair."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

import agentspec
from agentspec.bench import report, roofline, systems, workloads
from agentspec.bench.conversation import prompt_ids
from agentspec.bench.run import Settings, run
from benchmarks import loop as loop_bench


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from agentspec.models import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def tiny_qwen2(tokenizer, vocab_size: int, seed: int):
    """A random 2-layer Qwen2 of the embedded tokenizer, its LM head sharpened (clear argmaxes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.fixture(scope="module")
def padded_pair(smol_tokenizer):
    """One tokenizer, logits of two widths: the target's embeddings padded 64 rows past the draft's
    (as Qwen2.5-7B's 152,064 against 0.5B's 151,936)."""
    width = len(smol_tokenizer)
    target, draft = tiny_qwen2(smol_tokenizer, width + 64, 0), tiny_qwen2(smol_tokenizer, width, 1)
    return agentspec.load_pair(target, draft, tokenizer=smol_tokenizer)


def test_assisted_generation_runs_for_logits_of_different_widths(padded_pair):
    assert systems.different_widths(padded_pair)
    names = systems.single_call_systems(padded_pair)
    assert "transformers assisted" in names and systems.STATIC_COMPILED not in names
    ids = prompt_ids(padded_pair.tokenizer, [{"role": "user", "content": "What is the weather in Paris?"}])
    plain = systems.run_single(padded_pair, "transformers generate", ids, 12)
    assisted = systems.run_single(padded_pair, "transformers assisted", ids, 12)
    assert len(plain.tokens) == 12 and assisted.tokens == plain.tokens, f"{assisted.tokens=} {plain.tokens=}"


@pytest.mark.slow
def test_the_static_compiled_row_gives_generates_tokens(padded_pair):
    """Compiles the tiny target's one-token step (about 20 s on 2 cores), then two prompts of
    different lengths through the one graph."""
    names = systems.single_call_systems(padded_pair, static_compiled=True)
    assert names[1] == systems.STATIC_COMPILED
    state = systems.own_state(padded_pair, systems.STATIC_COMPILED, cache_len=96)
    for text in ("Hi", "What is the weather in Paris, and in Rome?"):
        ids = prompt_ids(padded_pair.tokenizer, [{"role": "user", "content": text}])
        plain = systems.run_single(padded_pair, "transformers generate", ids, 10)
        static = systems.run_single(padded_pair, systems.STATIC_COMPILED, ids, 10, state)
        assert static.tokens == plain.tokens, f"{static.tokens=} {plain.tokens=}"


def test_acceptance_by_position():
    passes = [(3, 3), (3, 1), (2, 0), (1, 1)]
    # position 1: 4 passes drafted it, 3 accepted; position 2: 3 drafted (3, 3, 2), 1 accepted (3, 3)
    assert report.acceptance_by_position(passes, 4) == [3 / 4, 1 / 3, 1 / 2, None]


def test_the_core_bench_imports_no_langchain():
    # the bench's own-pair options too: `agentspec bench --model` needs no LangChain
    code = (
        "import agentspec.bench.run, agentspec.bench.own_pair, sys; "
        "print([m for m in sys.modules if m.startswith('langchain')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_agent_loop_is_8_tool_calling_calls_over_a_long_prefix(smol_tokenizer):
    assert all(isinstance(m, dict) for c in workloads.agent_loop() for m in c)  # the core's: plain dicts
    calls = loop_bench.loop_calls()
    assert len(calls) == 8
    for i, messages in enumerate(calls):
        assert isinstance(messages[0], SystemMessage)
        assert isinstance(messages[-1], HumanMessage if i % 2 == 0 else ToolMessage)
        if i:
            assert messages[: len(calls[i - 1])] == calls[i - 1]  # each call extends the last
    ids = smol_tokenizer.apply_chat_template(
        [{"role": "system", "content": calls[0][0].content}], return_dict=True
    )["input_ids"]
    assert len(ids) >= 1000
    plain = loop_bench.without_tool_messages(calls[-1])
    assert not any(isinstance(m, ToolMessage) for m in plain)
    assert isinstance(plain[-1], HumanMessage) and plain[-1].content.startswith("Tool result: ")
    written = [m.content for m in plain if isinstance(m, AIMessage) and "<tool_call>" in m.content]
    assert len(written) == 4 and json.loads(
        written[0].removeprefix("<tool_call>").removesuffix("</tool_call>")
    )


def test_bytes_per_step_counts_weights_once(target, draft):
    n_params = sum(p.numel() * p.element_size() for p in [*target.parameters(), *target.buffers()])
    embed = target.get_input_embeddings().weight
    tied = target.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    expected = n_params if tied else n_params - embed.numel() * embed.element_size()
    assert roofline.bytes_per_step(target) == expected
    assert roofline.bytes_per_step(target, shared_with=target) == 0  # all shared


def test_goals_report_every_figure_met_or_not():
    single = {
        "all": {"agentspec auto": {"speedup_vs_assisted": 1.1}},
        "agent": {"agentspec auto": {"speedup_vs_generate": 2.5}},
    }
    loop = {"speedup_vs_ChatHuggingFace": {"agentspec full": 4.2}}
    rows = report.goals(single) + loop_bench.goals(loop)
    got = {g["goal"].split(":")[0]: (g["measured"], g["met"]) for g in rows}
    assert got == {"agent loop": (4.2, True), "single calls": (1.1, False), "agent turns": (2.5, True)}
    unmeasured = report.goals({"all": {}}) + loop_bench.goals({})
    assert [g["met"] for g in unmeasured] == [False] * 3  # not measured: not met


@pytest.mark.slow
@pytest.mark.model
def test_a_short_run_writes_json_markdown_and_plots(tmp_path):
    out, loop_out = tmp_path / "bench", tmp_path / "loop.json"
    result = run(Settings(mode="quick", max_new_tokens=8, out=out))
    assert loop_bench.main(["--max-new-tokens", "6", "--out", str(loop_out)]) == 0  # full equals baseline
    loop = json.loads(loop_out.read_text())["loop"]
    assert all(result["single"]["identical_to_generate"].values()), result["single"]["identical_to_generate"]
    assert set(loop["loop"]["total_seconds"]) == {"agentspec full", "agentspec baseline", "ChatHuggingFace"}
    assert json.loads(out.with_suffix(".json").read_text())["goals"] == result["goals"]
    assert "## Goals" in out.with_suffix(".md").read_text()
    assert all((tmp_path / p).exists() for p in result["plots"])
    assert [g["goal"].split(":")[0] for g in loop["goals"]] == ["agent loop"]
    assert (tmp_path / "loop.png").exists()


def test_a_reply_differing_from_its_solo_one_is_reported_with_the_margin_where_it_parts(smol_tokenizer):
    """The concurrency suite's ``divergences``: the first token where the two replies' ids part, and
    the target's top-two margin after the prompt and their common part (set on the turn too)."""
    from benchmarks import concurrency
    from benchmarks import workloads as trace_workloads

    traces = trace_workloads.traces_named(None)[:1]
    session = {"session": "s0", "trace": traces[0].name, "tag": None}
    turn, solo = {"text": "I will check the stock now."}, {"text": "I will check the order now."}
    (found,) = concurrency.divergences([(session, 0, turn, solo)], traces, "float32")
    a, b = (smol_tokenizer.encode(t["text"], add_special_tokens=False) for t in (turn, solo))
    at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert found["token"] == at == turn["divergence"]["token"] > 0
    assert found["margin"] >= 0 and found["top_two"][0] != found["top_two"][1]
    assert concurrency.divergences([], traces, "float32") == []
