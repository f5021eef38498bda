"""``benchmarks/vs_vllm.py`` (``python -m benchmarks vllm``) without a model or a server: the
same-transcript mode (every system reads the same prompts whatever it wrote) and the like-for-like
figures of the report."""

from __future__ import annotations

import json

import pytest

from benchmarks import vs_vllm as bench

TRANSCRIPT = ["fixed reply 0", "fixed reply 1", "fixed reply 2"]


class FakeAsk:
    """An ``ask`` that records the messages of each call and answers with a turn record of its own
    (reply "own reply n", n + 1 seconds, n + 2 output tokens), as a system would."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    def __call__(self, messages: list[dict]) -> dict:
        n = len(self.calls)
        self.calls.append(messages)
        return {
            "seconds": n + 1.0,
            "text": f"own reply {n}",
            "prompt_tokens": 100 + n,
            "cached_tokens": 90 if n else 0,
            "output_tokens": n + 2,
        }


def assistant_texts(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant"]


def test_by_default_each_call_reads_the_systems_own_replies():
    ask = FakeAsk()
    out = bench.conversation(ask, 3)
    assert [assistant_texts(m) for m in ask.calls] == [[], ["own reply 0"], ["own reply 0", "own reply 1"]]
    assert out["replies"] == ["own reply 0", "own reply 1", "own reply 2"]


def test_a_transcript_gives_every_call_its_replies_and_records_the_systems_own():
    ask = FakeAsk()
    out = bench.conversation(ask, 3, TRANSCRIPT)
    assert ask.calls == [bench.call_messages(n, TRANSCRIPT[:n]) for n in range(3)]
    assert [assistant_texts(m) for m in ask.calls] == [[], TRANSCRIPT[:1], TRANSCRIPT[:2]]
    assert out["replies"] == ["own reply 0", "own reply 1", "own reply 2"]  # still the system's own
    assert out["per_call_s"] == [1.0, 2.0, 3.0]
    assert out["total_s"] == 6.0 and out["output_tokens"] == 9 and out["tokens_per_s"] == 1.5


def test_the_vllm_path_passes_the_transcript_on(monkeypatch):
    """run_vllm's calls through a fake completion endpoint: its prompts are the transcript's."""
    prompts = []

    def fake_turn(client, model, ids, salt, session, n_new) -> dict:
        prompts.append(ids)
        return {"seconds": 0.5, "text": "vllm's", "prompt_tokens": 1, "cached_tokens": 0, "output_tokens": 1}

    monkeypatch.setattr(bench.harness, "completion_turn", fake_turn)
    monkeypatch.setattr(bench.harness, "client", lambda url: None)
    monkeypatch.setattr(bench, "rendered_ids", lambda tokenizer, messages: messages)
    out = bench.run_vllm("http://unused", "model", None, 8, 3, TRANSCRIPT)
    assert prompts == [bench.call_messages(n, TRANSCRIPT[:n]) for n in range(3)]
    assert out["replies"] == ["vllm's"] * 3


def test_the_shipped_transcript_covers_the_conversation(tmp_path):
    path = bench.harness.ROOT / "benchmarks/conversation_transcript.json"
    replies = bench.load_transcript(path, len(bench.convo.LONG_TURNS))
    assert len(replies) == len(bench.convo.LONG_TURNS) and all(isinstance(r, str) and r for r in replies)
    assert "results/vllm.json" in json.loads(path.read_text())["source"]
    args = bench.parse(["--calls", "3", "--transcript", str(path)])
    assert args.fixed == replies and args.transcript == path
    assert bench.parse([]).fixed is None and bench.parse([]).transcript is None
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"replies": ["one"]}))
    with pytest.raises(ValueError, match="at least 2"):
        bench.load_transcript(short, 3)


def run(repeat: int, per_call: list[float], replies: list[str], tokens: int) -> dict:
    total = sum(per_call)
    return {
        "repeat": repeat,
        "total_s": total,
        "per_call_s": per_call,
        "output_tokens": tokens,
        "tokens_per_s": tokens / total,
        "replies": replies,
    }


# calls 0 and 2 equal everywhere; call 1 differs in vLLM's second repeat; each system's fastest
# repeat is its first (agentspec: 6 s; vllm: 12 s)
RUNS = {
    "agentspec": [run(0, [1.0, 2.0, 3.0], ["a", "b", "c"], 30), run(1, [1.5, 2.0, 3.0], ["a", "b", "c"], 30)],
    "vllm": [run(0, [2.0, 4.0, 6.0], ["a", "b", "c"], 36), run(1, [3.0, 4.0, 6.0], ["a", "B", "c"], 36)],
}


def test_same_work_sums_the_equal_calls_of_each_fastest_repeat():
    assert bench.same_work(RUNS) == {
        "calls": [0, 2],
        "agentspec_s": 4.0,  # 1 + 3
        "vllm_s": 8.0,  # 2 + 6
        "vllm_over_agentspec": 2.0,
    }


def test_same_work_is_none_without_an_equal_call_or_without_both_systems():
    differ = {
        name: [{**r, "replies": [f"{name}{i}" for i in range(3)]} for r in runs]
        for name, runs in RUNS.items()
    }
    assert bench.same_work(differ) is None
    assert bench.same_work({"agentspec": RUNS["agentspec"]}) is None


def per_dtype(runs: dict[str, list[dict]]) -> dict:
    return {"runs": runs, "replies": bench.compare_replies(runs), "same_work": bench.same_work(runs)}


def test_the_goals_and_the_table_hold_the_like_for_like_figures():
    goals = bench.conversation_goals("bfloat16", per_dtype(RUNS))
    assert goals == {
        "conversation_vllm_over_agentspec_bfloat16": {"value": 2.0, "goal": ">= 1.5", "met": True},
        # agentspec 30 tokens in 6 s, vLLM 36 in 12 s: 5 tok/s over 3
        "conversation_per_token_vllm_over_agentspec_bfloat16": {"value": 1.667, "goal": None},
        "conversation_same_work_vllm_over_agentspec_bfloat16": {"value": 2.0, "goal": ">= 1.5", "met": True},
    }
    result = {"transcript": "t.json", "goals": goals, "dtypes": {"bfloat16": per_dtype(RUNS)}}
    text = bench.conversation_table(result)
    assert "same work, calls [0, 2]: agentspec 4.00 s, vllm 8.00 s, vllm/agentspec 2.000" in text
    assert "every call's earlier replies from t.json" in text


def test_agentspec_alone_has_no_conversation_goal():
    assert bench.conversation_goals("float32", per_dtype({"agentspec": RUNS["agentspec"]})) == {}


def test_first_call_goals_take_the_worst_size_and_the_largest_warm_up_share():
    def row(ratio: float, warm_ups: tuple[float, float]) -> dict:
        return {"first_over_later": ratio, "runs": [{"load_s": 1.0, "warm_up_s": w} for w in warm_ups]}

    goals = bench.first_call_goals("float32", [row(1.02, (0.1, 0.1)), row(1.2, (0.1, 0.2))])
    assert goals == {
        "first_over_later_float32": {"value": 1.2, "goal": "<= 1.1", "met": False},
        "warm_up_over_load_float32": {"value": 0.25, "goal": "<= 0.2", "met": False},  # 0.2 / (1 - 0.2)
    }
    assert bench.first_call_goals("float32", []) == {}


def test_vllm_with_the_eagle3_head_has_its_own_goal():
    """The ``vllm_eagle3`` system (the shipped head drafting in vLLM): agentspec ahead of it, its
    total seconds over agentspec's at least 1."""
    runs = {**RUNS, "vllm_eagle3": [run(0, [2.0, 2.0, 2.0], ["a", "b", "c"], 30)]}
    goals = bench.conversation_goals("float32", per_dtype(runs))
    assert goals["conversation_vllm_eagle3_over_agentspec_float32"] == {
        "value": 1.0,
        "goal": ">= 1.0",
        "met": True,
    }
    assert goals["conversation_vllm_over_agentspec_float32"]["value"] == 2.0
    without_ngram = {name: runs[name] for name in ("agentspec", "vllm_eagle3")}
    assert list(bench.conversation_goals("float32", per_dtype(without_ngram))) == [
        "conversation_vllm_eagle3_over_agentspec_float32"
    ]


def test_the_vllm_worker_drafts_with_a_head_folder(tmp_path):
    """``vllm_worker_command(head=...)``: vLLM's speculative config names the folder and its type."""
    from agentspec.fleet.vllm import head_speculation, vllm_worker_command

    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    command = vllm_worker_command(8000, speculative=False, head=tmp_path, model_dir=tmp_path)
    config = json.loads(command[command.index("--speculative-config") + 1])
    assert (
        config
        == head_speculation(tmp_path)
        == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 4}
    )
    assert "--per-request-spec-decode-metrics" in command
    assert "--speculative-config" not in vllm_worker_command(8000, speculative=False, model_dir=tmp_path)
