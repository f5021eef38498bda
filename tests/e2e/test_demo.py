"""The demo agent (examples/agent_demo.py): its answer check, and a short run whose answers it marks right.

``check`` is what decides the demo's exit status, so it is tested on hand-made conversations first: a
right answer, a field that differs from the tool's record, a lookup of the wrong record, no answer.
Then the demo runs for real on the embedded model (two questions, both agents) and must exit 0.
"""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from examples import agent_demo as demo


def conversation(tool_result: str, answer) -> dict:
    call = {"name": "read_issue", "args": {"number": 407}, "id": "call_1", "type": "tool_call"}
    messages = [
        HumanMessage("Who is assigned to issue #407?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage(tool_result, tool_call_id="call_1"),
        AIMessage(answer.model_dump_json() if answer is not None else ""),
    ]
    return {"messages": messages, "structured_response": answer}


ISSUE_407 = demo.read_issue.invoke({"number": 407})


def test_a_right_answer_is_marked_right():
    ok, verdict = demo.check(
        407, conversation(ISSUE_407, demo.IssueAnswer(number=407, priority="normal", assignee="Omar"))
    )
    assert ok, verdict


def test_a_field_that_differs_from_the_tool_is_wrong():
    answer = demo.IssueAnswer(number=407, priority="high", assignee="Omar")
    ok, verdict = demo.check(407, conversation(ISSUE_407, answer))
    assert not ok and "priority='high', the tool said 'normal'" in verdict


def test_an_answer_from_the_wrong_record_is_wrong():
    # the agent looked up #412 and answered from it, faithfully: still not the question's answer
    issue_412 = demo.read_issue.invoke({"number": 412})
    answer = demo.IssueAnswer(number=412, priority="high", assignee="Dana")
    ok, verdict = demo.check(407, conversation(issue_412, answer))
    assert not ok and "no tool result about 407" in verdict


def test_no_answer_or_an_unknown_record_is_wrong():
    assert not demo.check(407, conversation(ISSUE_407, None))[0]
    assert not demo.check(407, conversation(demo.read_issue.invoke({"number": 1}), None))[0]
    assert demo.read_release_notes.invoke({"version": "2.3.1"}) == json.dumps(demo.RELEASES[1])


@pytest.mark.model
def test_the_demo_answers_right_and_both_runs_reply_the_same(tmp_path, capsys, one_thread):
    # one_thread: the demo sets torch's threads (--threads, default 1); the fixture gives the later
    # tests back the count they had (test_threads' pool test skipped on one thread)
    out = tmp_path / "demo.json"
    assert demo.main(["--tasks", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    # the load time is printed before the agents run, and written with the dtype it resolved to
    printed = capsys.readouterr().out
    assert f"in {figures['load_s']:.1f} s ({figures['dtype']}, " in printed.split("ChatSpecDecode()")[0]
    assert figures["dtype"] in ("torch.float32", "torch.bfloat16"), figures["dtype"]
    assert figures["right"] == 2 and figures["same_replies"] is True, figures
    assert figures["answers"][0] == "v2.3.1 was released on 2025-01-20."
    calls = figures["calls"]
    assert [c["what"] for c in calls] == ["read_release_notes", "answer", "read_issue", "answer"]
    assert calls[2]["cached"] > 0  # the second question reads the system prompt and tools from the cache
    # the run's totals (get_speculation_callback) are the sums of its calls' own figures
    totals = figures["run_totals"]
    assert totals["calls"] == len(calls)
    assert totals["accepted_tokens"] == sum(c["accepted"] for c in calls)
    assert totals["cache_read_tokens"] == sum(c["cached"] for c in calls)
    assert totals["latency_saved_s"] == pytest.approx(figures["saved_estimated_s"], abs=0.01)
