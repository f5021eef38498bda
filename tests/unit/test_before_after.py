"""``python -m benchmarks before-after``: the commands each checkout's layout gets, and the reply
comparison between two checkouts, on hand-written run outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.before_after import agents_summary, compare_replies, loop_job, traces_job


def _replies(*texts: str) -> list:
    """A trace run's replies: turn i's plain reply is texts[i], as token ids (one id per character)."""
    return [[f"t#{i}", [ord(c) for c in text]] for i, text in enumerate(texts)]


def _tree(tmp_path: Path, *files: str) -> Path:
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    return tmp_path


def test_equal_replies_are_identical():
    same = compare_replies(_replies("ab", "cd"), _replies("ab", "cd"), "token_ids")
    assert same == {"replies_identical": True, "replies_compared": "token_ids", "replies": 2}


def test_the_first_difference_is_named():
    out = compare_replies(_replies("ab", "cx", "ee"), _replies("ab", "cd", "ff"), "token_ids")
    assert out["replies_identical"] is False
    assert out["first_difference"] == {"index": 1, "reply": "t#1", "before": [99, 120], "after": [99, 100]}


def test_a_missing_reply_is_a_difference():
    out = compare_replies(_replies("ab"), _replies("ab", "cd"), "token_ids")
    assert out["replies_identical"] is False
    assert out["first_difference"] == {"index": 1, "reply": "t#1", "before": None, "after": [99, 100]}


def test_a_trace_runs_the_traces_suite_or_the_script_it_replaced(tmp_path):
    out = tmp_path / "o.json"
    suites = traces_job(_tree(tmp_path / "new", "benchmarks/__main__.py"), "t", "none", "auto", out)
    assert suites[:4] == [sys.executable, "-m", "benchmarks", "traces"]
    assert suites[4:] == ["--traces", "t", "--configs", "none", "--dtype", "auto", "--out", str(out)]
    script = traces_job(_tree(tmp_path / "old", "benchmarks/__init__.py"), "t", "none", "bfloat16", out, 4)
    assert script[1:3] == ["-m", "benchmarks.bench_agent_traces"]
    assert script[-2:] == ["--max-new-tokens", "4"] and "bfloat16" in script


def test_the_loop_runs_from_the_checkouts_module_and_a_layout_without_one_stops(tmp_path):
    assert loop_job(_tree(tmp_path / "new", "benchmarks/loop.py"), 8, "auto")[-3:] == [
        "8",
        "auto",
        "benchmarks.loop",
    ]
    old = _tree(tmp_path / "old", "benchmarks/bench_langchain_loop.py")
    assert loop_job(old, 8, "auto")[-1] == "benchmarks.bench_langchain_loop"
    with pytest.raises(RuntimeError, match="a layout this benchmark cannot run"):
        loop_job(_tree(tmp_path / "older", "integrations/langchain/langchain_agentspec/bench.py"), 8, "auto")


def test_the_summary_sums_seconds_per_configuration_and_is_false_on_any_reply_difference():
    def side(seconds: float) -> dict:
        return {"all_identical": True, "configs": {"none": {"seconds": seconds}}}

    trace = {"before": side(3.0), "after": side(2.0), "replies_identical": True}
    result = {"configs": "none", "traces": {"a": trace, "b": {**trace, "replies_identical": False}}}
    out = agents_summary(result)
    assert out["agent_traces"]["none"] == {"before_s": 6.0, "after_s": 4.0, "before_over_after": 1.5}
    assert out["identical"] and out["all_replies_identical"] is False


def test_the_loop_apart_runs_each_chat_model_in_its_own_process(tmp_path, monkeypatch):
    """``--loop-apart``: one process per chat model, its seconds and replies gathered as the loop's
    job gives them; a model the checkout lacks is left out."""
    import json
    from argparse import Namespace

    from benchmarks import before_after

    tree = _tree(tmp_path, "benchmarks/loop.py")
    ran = []

    def run_in(where, argv, threads):
        system = argv[-1]
        ran.append((where, system, argv[-2], threads))
        texts = {"agentspec full": "a", "agentspec baseline": "a"}
        printed = {"seconds": 2.0, "ran": system in texts, "dtype": "torch.float32"}
        printed["replies"] = [[f"{system} call 0", texts[system]]] if system in texts else []
        return 5.0, "call 0: ...\n" + json.dumps(printed)

    monkeypatch.setattr(before_after, "run_in", run_in)
    out = before_after.loop_apart(tree, Namespace(loop_max_new_tokens=16, dtype="float32", threads=1))
    assert [system for _, system, _, _ in ran] == list(before_after.LOOP_SYSTEMS)
    assert {module for _, _, module, _ in ran} == {"benchmarks.loop"}
    assert out["process_s"] == 15.0 and out["full_equals_baseline"] is True
    assert out["total_seconds"] == {"agentspec full": 2.0, "agentspec baseline": 2.0}
    assert out["replies"] == [["agentspec full call 0", "a"], ["agentspec baseline call 0", "a"]]
