"""``benchmarks/before_after.py``'s reply comparison between two commits, on hand-written run outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.before_after import (
    all_replies_identical,
    check_dtype,
    compare_replies,
    trace_replies,
    traces_job,
)


def _turns(*texts: str, ids: bool = True) -> list[dict]:
    """A trace run's turns: turn i's plain reply is texts[i] (its token ids: one id per character)."""
    turns = [{"trace": "t", "turn": i, "output_text": text} for i, text in enumerate(texts)]
    for turn in turns if ids else []:
        turn["output_token_ids"] = [ord(c) for c in turn["output_text"]]
    return turns


def test_equal_replies_are_compared_by_token_ids_where_both_runs_wrote_them():
    same = compare_replies(trace_replies(_turns("ab", "cd")), trace_replies(_turns("ab", "cd")))
    assert same == {"replies_identical": True, "replies_compared": "token_ids", "replies": 2}


def test_a_run_without_token_ids_is_compared_by_text_and_the_first_difference_is_named():
    older, newer = trace_replies(_turns("ab", "cx", "ee", ids=False)), trace_replies(_turns("ab", "cd", "ff"))
    out = compare_replies(older, newer)
    assert out["replies_identical"] is False and out["replies_compared"] == "text"
    assert out["first_difference"] == {"index": 1, "reply": "t#1", "before": "cx", "after": "cd"}


def test_a_missing_reply_is_a_difference():
    out = compare_replies(trace_replies(_turns("ab")), trace_replies(_turns("ab", "cd")))
    assert out["replies_identical"] is False
    assert out["first_difference"] == {
        "index": 1,
        "reply": "t#1",
        "before": None,
        "after": [ord("c"), ord("d")],
    }


def test_an_output_without_replies_is_null_with_a_reason():
    before = trace_replies([{"trace": "t", "turn": 0}])  # an older commit's run: no replies written
    assert before is None
    out = compare_replies(before, trace_replies(_turns("ab")))
    assert out["replies_identical"] is None and "before" in out["replies_reason"]


def test_the_summary_is_false_on_any_difference_else_null_on_any_unknown():
    jobs = [{"replies_identical": v} for v in (True, None, False)]
    assert all_replies_identical(jobs) is False
    assert all_replies_identical(jobs[:2]) is None
    assert all_replies_identical(jobs[:1]) is True


def test_dtype_is_passed_where_the_checkout_takes_it_and_a_run_in_another_stops(tmp_path):
    out = tmp_path / "o.json"
    assert "--dtype" not in traces_job(Path("."), "t", "none", None, out)  # a checkout from before --dtype
    assert traces_job(Path("."), "t", "none", "bfloat16", out)[-2:] == ["--dtype", "bfloat16"]
    check_dtype("auto", "before", "torch.float32")  # auto: each checkout's own default
    check_dtype("float32", "before", "torch.float32")
    with pytest.raises(RuntimeError, match="the before checkout ran in torch.float32"):
        check_dtype("bfloat16", "before", "torch.float32")
