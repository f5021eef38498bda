"""agentspec beside a vLLM worker on a 12-call agent conversation, and a first call beside a later one.

    python -m benchmarks vllm [--part conversation] [--dtypes float32,bfloat16] [--calls 12]
        [--max-tokens 64] [--repeats 2] [--systems agentspec,vllm] [--transcript PATH]
    python -m benchmarks vllm --part first_call [--dtypes ...] [--sizes 128,1024] [--max-tokens 64]
    python -m benchmarks vllm --part heads --head FOLDER [--method eagle3] [--k 3] [--prompts 24]

With the machine to itself; the conversation starts a vLLM worker per dtype (``make vllm``). Each part
writes its key of ``results/vllm.json`` (environment, figures, ``goals``); the conversation also plots
seconds per call (``vllm_conversation.png``).

**conversation**: the inventory agent of ``agentspec/bench/conversation.py`` (``LONG_TURNS``: user
requests and tool results over a ~1,100-token system prompt listing the tools as text), ``--calls``
calls one at a time, each with the system prompt, the turns so far and the earlier replies, as an agent
loop sends them. No tools are bound, so replies compare as text; tool results go as role "function" (a
plain-text reply has no parsed call a "tool" message could answer). Greedy, ``--max-tokens`` at most.
Each system runs while the other idles:

- ``agentspec``: ``ChatSpecDecode`` in process, its defaults (speculation, prefix cache), on a fresh
  ``load_pair`` per repeat (its caches start empty) warmed by one short call; a torch thread per CPU.
- ``vllm``: one vLLM worker (``agentspec.fleet.vllm``: n-gram speculation, prefix caching; one NUMA
  node's cores less one, ``vllm_cores``) through ``/v1/completions`` with the token ids ChatSpecDecode
  renders (its chat endpoint renders the history in other tokens), a fresh cache salt per repeat.
- ``vllm_eagle3`` (``--systems agentspec,vllm,vllm_eagle3``): the same, drafting with the EAGLE-3
  head agentspec ships (``agentspec.models.EAGLE3_HEAD``), 4 tokens a pass; goal: its total seconds
  over agentspec's >= 1.0.

``--repeats`` runs of each, the order rotating. The goal figure: vLLM's total seconds over agentspec's,
each the fastest repeat (a shared machine's noise only adds time; goal >= 1.5); replies are compared
per call across systems and repeats.

``--transcript PATH`` (a JSON whose "replies" cover ``--calls`` - 1 calls; the shipped
``benchmarks/conversation_transcript.json`` holds 12 float32 replies every system wrote alike): call
n's earlier replies are the file's first n, not the system's own: a bfloat16 near-tie of the top two
logits flips a token on one system only, and fed back it changes every later prompt, so the totals
would measure different work (each system's own replies are still recorded). Beside the goal:
``same_work``, vLLM's seconds over agentspec's on the calls where every run wrote the same reply (the
same prompts and tokens on both sides; goal >= 1.5), and the per-token ratio (informational).

**first_call**: in a fresh Python process (nothing warm), ``load_pair`` timed, then
``ChatSpecDecode(prefix_cache=False)`` on prompt A (the first call) and prompt B (a later call): B has
A's token count and other text (the system prompt's words in another order), so nothing is reused.
Each size runs A then B and B then A, so firsts and laters do the same work; the figure is the firsts'
sum over the laters' (goal <= 1.1). The drafting memory is dropped after each call (it outlives
``prefix_cache=False``): the later call cannot draft from the first's reply. And the warm-up's share
of the load (goal <= 0.2).

**heads**: one head folder in the speculators format, drafting in agentspec (``drafter="model"``,
``num_draft_tokens=k``) and in vLLM's offline engine (``speculative_config`` method and
``num_speculative_tokens=k``, eager, no prefix caching), greedy, on the same held-out prompts of
``agentspec.distill.prompts``: the mean acceptance length (vLLM's: 1 + accepted tokens over passes
that drafted) on each side (goal: ours within 10% of vLLM's), accepted tokens by position, replies
compared, and agentspec's speed over plain decoding of the same prompts (interleaved).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from langchain_core.messages import convert_to_messages

import agentspec
from agentspec.bench import conversation as convo
from agentspec.chat import prepare
from agentspec.fleet.process import checkout_env
from agentspec.warm import warm_up
from benchmarks import harness
from langchain_agentspec import ChatSpecDecode
from langchain_agentspec.messages import to_openai_messages

SYSTEMS = {
    "agentspec": "ChatSpecDecode in process, its defaults (speculation, prefix cache), a fresh pair a repeat",
    "vllm": "one vLLM worker, n-gram speculation, prefix caching, prompts as ChatSpecDecode's token ids",
    "vllm_eagle3": "one vLLM worker drafting with agentspec's EAGLE-3 head (4 tokens a pass), prefix "
    "caching, prompts as ChatSpecDecode's token ids",
}
WORKERS = {"vllm": "vllm_spec", "vllm_eagle3": "vllm_eagle3"}  # each vLLM system's harness worker
CONVERSATION_GOAL = 1.5  # vLLM's conversation time over agentspec's, at least
FIRST_CALL_GOAL = 1.1  # a first call's time over a later one's of the same size, at most
WARM_UP_GOAL = 0.2  # the warm-up's time over the rest of the load, at most
TOOL_NAME = "stockbot"  # the name the tool results go under (role "function" takes one)


# --- the conversation ---------------------------------------------------------------------------


def call_messages(n: int, answers: list[str]) -> list[dict]:
    """Call n's OpenAI-format messages, the tool results as role "function" (see the docstring)."""
    msgs = convo.messages_for_call(n, answers, convo.LONG_TURNS)
    return [{**m, "role": "function", "name": TOOL_NAME} if m["role"] == "tool" else m for m in msgs]


def rendered_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The prompt ids ChatSpecDecode runs for ``messages``: through LangChain's messages and back."""
    return prepare(tokenizer, to_openai_messages(convert_to_messages(messages))).prompt.ids


def conversation(ask: Callable[[list[dict]], dict], calls: int, fixed: list[str] | None = None) -> dict:
    """``calls`` calls one at a time, each answered by ``ask(messages)`` (a turn record); each reply goes
    into the next call's messages, or, given ``fixed`` (a transcript), ``fixed``'s replies do."""
    answers: list[str] = []
    turns: list[dict] = []
    for n in range(calls):
        turns.append(ask(call_messages(n, answers if fixed is None else fixed[:n])))
        answers.append(turns[-1]["text"])
    total = sum(t["seconds"] for t in turns)
    tokens = sum(t["output_tokens"] for t in turns)
    return {
        "total_s": round(total, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / total, 3),
        "per_call_s": [round(t["seconds"], 3) for t in turns],
        "prompt_tokens": [t["prompt_tokens"] for t in turns],
        "cached_tokens": [t["cached_tokens"] for t in turns],
        "output_tokens_per_call": [t["output_tokens"] for t in turns],
        "replies": answers,
    }


def load_transcript(path: Path, calls: int) -> list[str]:
    """A transcript's "replies", checked to cover ``calls`` calls (else only the last call would fail)."""
    replies = json.loads(path.read_text())["replies"]
    if len(replies) < calls - 1 or not all(isinstance(r, str) for r in replies):
        raise ValueError(f"{path}: 'replies' must hold at least {calls - 1} strings, holds {len(replies)}")
    return replies


def run_agentspec(dtype: str, n_new: int, calls: int, fixed: list[str] | None = None) -> dict[str, Any]:
    """The conversation on a fresh pair in this process (nothing an earlier repeat cached is read)."""
    pair = agentspec.load_pair(dtype=dtype)
    ChatSpecDecode(pair=pair, prefix_cache=False, max_tokens=4).invoke("Hi")  # first-call costs
    llm = ChatSpecDecode(pair=pair, max_tokens=n_new)
    return conversation(lambda m: harness.in_process(llm, m), calls, fixed)


def run_vllm(url: str, model: str, tokenizer, n_new: int, calls: int, fixed: list[str] | None = None) -> dict:
    """The conversation through vLLM's ``/v1/completions`` under a cache salt of its own."""
    client, salt = harness.client(url), uuid.uuid4().hex

    def ask(messages: list[dict]) -> dict:
        return harness.completion_turn(client, model, rendered_ids(tokenizer, messages), salt, salt, n_new)

    return conversation(ask, calls, fixed)


def version(url: str) -> str | None:
    return httpx.get(f"{url}/version", timeout=10).json().get("version")


def vllm_cores(log: Path) -> str | None:
    """The CPU cores vLLM's worker bound its threads to, as its log says."""
    found = re.findall(r"core ids=(\[[0-9, ]*\])", log.read_text(errors="replace"))
    return found[-1] if found else None


def side_by_side(args: argparse.Namespace, dtype: str, tokenizer: Any) -> dict[str, Any]:
    """Every system's conversation ``args.repeats`` times, the order rotating each repeat; each vLLM
    worker runs (idle while another system runs) for the whole block."""
    runs: dict[str, list[dict]] = {name: [] for name in args.systems}
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-vllm-{dtype}-"))
    with contextlib.ExitStack() as stack:
        served = {}  # each vLLM system's (url, served model name)
        for name in (n for n in args.systems if n in WORKERS):
            system = stack.enter_context(harness.running(WORKERS[name], log_dir, dtype))
            if isinstance(system, str):
                raise RuntimeError(f"{name}: {system}")
            served[name] = (system.url, harness.served_model(system.url))
        for r in range(args.repeats):
            for name in harness.rotated(args.systems, r):
                if name == "agentspec":
                    run = run_agentspec(dtype, args.max_tokens, args.calls, args.fixed)
                else:
                    run = run_vllm(*served[name], tokenizer, args.max_tokens, args.calls, args.fixed)
                runs[name].append({"repeat": r, **run})
                print(f"  {dtype} repeat {r} {name:>11}: {run['total_s']:8.2f} s, "
                      f"{run['tokens_per_s']:6.2f} tok/s", flush=True)  # fmt: skip
        versions = {n: version(url) for n, (url, _) in served.items()}
    return {
        "runs": runs,
        "server_versions": versions,
        "vllm_cores": {n: vllm_cores(log_dir / f"{WORKERS[n]}.log") for n in served},
        "replies": compare_replies(runs),
        "same_work": same_work(runs),
    }


def compare_replies(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per call, whether every system's every repeat wrote the same reply; and per system, whether
    its repeats agree and how many calls equal agentspec's first repeat's."""
    everyone = [run["replies"] for system_runs in runs.values() for run in system_runs]
    reference = runs["agentspec"][0]["replies"] if runs.get("agentspec") else everyone[0]
    per_call = [len({replies[n] for replies in everyone}) == 1 for n in range(len(reference))]
    out: dict[str, Any] = {"all_equal_per_call": per_call, "all_equal": all(per_call)}
    for name, system_runs in runs.items():
        first = system_runs[0]["replies"]
        out[name] = {
            "repeats_agree": all(run["replies"] == first for run in system_runs),
            "calls_equal_to_agentspec": [sum(a == b for a, b in zip(first, reference)), len(reference)],
        }
    return out


def fastest(runs: list[dict]) -> dict:
    return min(runs, key=lambda run: run["total_s"])


def same_work(runs: dict[str, list[dict]]) -> dict[str, Any] | None:
    """vLLM's seconds over agentspec's on the calls where every system's every repeat wrote the same
    reply (each system's fastest repeat): the same prompt and the same tokens on both sides, even where
    a flipped token made the totals differ. None without both systems or without an equal call."""
    if not (runs.get("agentspec") and runs.get("vllm")):
        return None
    calls = [n for n, same in enumerate(compare_replies(runs)["all_equal_per_call"]) if same]
    if not calls:
        return None
    best = {name: fastest(runs[name])["per_call_s"] for name in ("agentspec", "vllm")}
    seconds = {name: sum(per_call[n] for n in calls) for name, per_call in best.items()}
    return {
        "calls": calls,
        "agentspec_s": round(seconds["agentspec"], 3),
        "vllm_s": round(seconds["vllm"], 3),
        "vllm_over_agentspec": round(seconds["vllm"] / seconds["agentspec"], 3),
    }


def conversation_goals(dtype: str, per: dict[str, Any]) -> dict[str, Any]:
    """Where agentspec and vLLM both ran: the totals' ratio (the goal), the same-work ratio (the
    like-for-like one) and the per-token one (informational)."""
    runs = per["runs"]
    if not runs.get("agentspec"):
        return {}
    ours, out = fastest(runs["agentspec"]), {}
    if runs.get("vllm_eagle3"):  # the same head drafting in vLLM: agentspec ahead of it
        ratio = fastest(runs["vllm_eagle3"])["total_s"] / ours["total_s"]
        out[f"conversation_vllm_eagle3_over_agentspec_{dtype}"] = goal(ratio, 1.0)
    if not runs.get("vllm"):
        return out
    theirs = fastest(runs["vllm"])
    name = f"vllm_over_agentspec_{dtype}"
    out[f"conversation_{name}"] = goal(theirs["total_s"] / ours["total_s"], CONVERSATION_GOAL)
    if work := per.get("same_work"):
        out[f"conversation_same_work_{name}"] = goal(work["vllm_over_agentspec"], CONVERSATION_GOAL)
    per_token = ours["tokens_per_s"] / theirs["tokens_per_s"]
    out[f"conversation_per_token_{name}"] = {"value": round(per_token, 3), "goal": None}
    return out


def goal(value: float, bound: float, at_most: bool = False) -> dict[str, Any]:
    met = value <= bound if at_most else value >= bound
    return {"value": round(value, 3), "goal": f"{'<=' if at_most else '>='} {bound}", "met": met}


def conversation_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'dtype':>9} {'system':>9} {'total s (each repeat)':>28} {'tokens':>7} {'tok/s':>7} repeats agree"
    ]
    for dtype, per in result["dtypes"].items():
        for name, runs in per["runs"].items():
            totals = ", ".join(f"{run['total_s']:.2f}" for run in runs)
            best, agree = fastest(runs), per["replies"][name]["repeats_agree"]
            lines.append(f"{dtype:>9} {name:>9} {totals:>28} {best['output_tokens']:>7} "
                         f"{best['tokens_per_s']:>7.2f} {agree}")  # fmt: skip
        if work := per.get("same_work"):
            lines.append(
                f"{dtype:>9} same work, calls {work['calls']}: agentspec {work['agentspec_s']:.2f} s, "
                f"vllm {work['vllm_s']:.2f} s, vllm/agentspec {work['vllm_over_agentspec']:.3f}"
            )
    if result.get("transcript"):
        lines.append(f"every call's earlier replies from {result['transcript']}")
    return "\n".join(lines)


def plot_conversation(result: dict[str, Any], out: Path) -> None:
    """Seconds per call of each system's fastest repeat, a panel per dtype."""
    dtypes = list(result["dtypes"])
    with harness.figure(out, len(dtypes), part="conversation", size=(6, 4)) as axes:
        for ax, dtype in zip(axes if len(dtypes) > 1 else [axes], dtypes):
            for name, runs in result["dtypes"][dtype]["runs"].items():
                best = fastest(runs)
                calls = range(1, len(best["per_call_s"]) + 1)
                ax.plot(calls, best["per_call_s"], "o-", label=f"{name} ({best['total_s']:.1f} s)")
            ax.set(xlabel="agent call", ylabel="seconds", title=f"{dtype}: seconds per call (fastest repeat)")
            ax.legend()


def run_conversation(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    dtypes = {dtype: side_by_side(args, dtype, tokenizer) for dtype in args.dtypes}
    return {
        "benchmark": "the agent conversation, agentspec beside vLLM",
        "systems": {name: SYSTEMS[name] for name in args.systems},
        "calls": args.calls,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "transcript": str(args.transcript) if args.transcript else None,  # None: each system's own replies
        "first_prompt_tokens": len(rendered_ids(tokenizer, call_messages(0, []))),
        "goals": {k: g for dtype, per in dtypes.items() for k, g in conversation_goals(dtype, per).items()},
        "dtypes": dtypes,
    }


# --- the first call against a later one ---------------------------------------------------------


def sized_prompt(tokenizer: Any, size: int, seed: int) -> list[dict]:
    """A one-message prompt of exactly ``size`` tokens as ChatSpecDecode renders it: a question and
    the system prompt's one-token words (n words add n tokens) in an order of ``seed``'s."""
    words = sorted(set(re.findall(r"[a-z]+", convo.SYSTEM_PROMPT)))
    pool = [w for w in words if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    rng, head = random.Random(seed), "Summarise these stock notes in one line:"
    base = len(rendered_ids(tokenizer, [{"role": "user", "content": head}]))
    chosen: list[str] = []
    while len(chosen) < size - base:
        chosen += rng.sample(pool, len(pool))
    messages = [{"role": "user", "content": " ".join([head, *chosen[: size - base]])}]
    got = len(rendered_ids(tokenizer, messages))
    assert got == size, f"{size=} {got=}: a word merged with its neighbour"
    return messages


def first_call_child() -> None:
    """In a fresh process: the load, then one call per prompt given on stdin, each timed."""
    spec = json.loads(sys.stdin.read())
    harness.set_threads(len(os.sched_getaffinity(0)))
    start = time.perf_counter()
    pair = agentspec.load_pair(dtype=spec["dtype"], warm_up=False)
    load_s = time.perf_counter() - start
    warm_up_s = warm_up(pair)  # what load_pair runs by default: timed on its own here
    llm = ChatSpecDecode(pair=pair, prefix_cache=False, max_tokens=spec["max_tokens"])
    calls = []
    for messages in spec["prompts"]:
        calls.append(harness.in_process(llm, messages))
        # a later call drafting from this reply would be faster for that, not for being later (the
        # pair's learned pass costs stay: they are warm state)
        pair.tenants.drop(None)
    print(json.dumps({"load_s": load_s + warm_up_s, "warm_up_s": warm_up_s, "calls": calls}))


def first_call_process(dtype: str, prompts: list[list[dict]], n_new: int) -> dict[str, Any]:
    """``first_call_child`` in a fresh Python process; its figures, and the process's wall time."""
    spec = json.dumps({"dtype": dtype, "max_tokens": n_new, "prompts": prompts})
    command = [sys.executable, "-m", "benchmarks", "vllm", "--first-call-child"]
    start = time.perf_counter()
    done = subprocess.run(command, input=spec, capture_output=True, text=True, cwd=harness.ROOT,
                          env=checkout_env())  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"first-call process failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), "process_s": time.perf_counter() - start}


def first_calls(dtype: str, tokenizer: Any, sizes: list[int], n_new: int) -> list[dict[str, Any]]:
    """Per prompt size, prompts A and B in both orders, each in a fresh process; the firsts' sum over
    the laters' (the same work on both sides)."""
    rows = []
    for size in sizes:
        a, b = sized_prompt(tokenizer, size, seed=1), sized_prompt(tokenizer, size, seed=2)
        runs = [first_call_process(dtype, prompts, n_new) for prompts in ([a, b], [b, a])]
        for order, run in zip(("AB", "BA"), runs):
            first, later = run["calls"]
            print(f"  {dtype} first call, {size} tokens, {order}: load {run['load_s']:.2f} s "
                  f"(warm-up {run['warm_up_s']:.2f} s), first {first['seconds']:.3f} s, "
                  f"later {later['seconds']:.3f} s", flush=True)  # fmt: skip
        firsts = sum(run["calls"][0]["seconds"] for run in runs)
        laters = sum(run["calls"][1]["seconds"] for run in runs)
        rows.append({"prompt_tokens": size, "first_over_later": round(firsts / laters, 3), "runs": runs})
    return rows


def first_call_goals(dtype: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest first-over-later ratio of the sizes, and the largest warm-up share of a load."""
    if not rows:
        return {}
    value = max(row["first_over_later"] for row in rows)
    runs = [run for row in rows for run in row["runs"]]
    share = max(run["warm_up_s"] / (run["load_s"] - run["warm_up_s"]) for run in runs)
    return {
        f"first_over_later_{dtype}": goal(value, FIRST_CALL_GOAL, at_most=True),
        f"warm_up_over_load_{dtype}": goal(share, WARM_UP_GOAL, at_most=True),
    }


def run_first_call(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    dtypes = {dtype: first_calls(dtype, tokenizer, args.sizes, args.max_tokens) for dtype in args.dtypes}
    return {
        "benchmark": "the first call beside a later one of the same size, each pair in a fresh process",
        "max_tokens": args.max_tokens,
        "goals": {k: g for dtype, rows in dtypes.items() for k, g in first_call_goals(dtype, rows).items()},
        "dtypes": dtypes,
    }


def heldout_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """The first ``n`` held-out prompts of ``agentspec.distill.prompts`` (no training step saw them)."""
    from agentspec.distill.prompts import is_heldout, make_prompts, render
    from agentspec.distill.responses import HELDOUT

    specs = [s for s in make_prompts(40 * n) if is_heldout(s.key(), HELDOUT)][:n]
    return [render(tokenizer, s) for s in specs]


def acceptance(accepted: float, drafts: float) -> float | None:
    """vLLM's mean acceptance length: 1 + accepted tokens over passes that drafted."""
    return 1 + accepted / drafts if drafts else None


def run_heads(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """One head folder in agentspec and in vLLM: greedy, ``--k`` tokens a pass, the same prompts."""
    prompts = heldout_prompts(tokenizer, args.prompts)
    dtype = args.dtypes[0]
    pair = agentspec.load_pair(draft_model=args.head, dtype=dtype)
    ours = {
        "accepted": 0,
        "drafts": 0,
        "per_position": [0] * args.k,
        "plain_s": 0.0,
        "spec_s": 0.0,
        "outputs": [],
    }
    same_as_plain = 0
    for ids in prompts:
        options = {"max_new_tokens": args.max_tokens, "prefix_cache": False}
        t0 = time.perf_counter()
        plain = agentspec.generate(pair, ids, "none", **options)
        t1 = time.perf_counter()
        spec = agentspec.generate(pair, ids, "model", num_draft_tokens=args.k, **options)
        ours["plain_s"] += t1 - t0
        ours["spec_s"] += time.perf_counter() - t1
        same_as_plain += spec.token_ids == plain.token_ids
        stats = spec.stats
        ours["accepted"] += stats.accepted_tokens
        ours["drafts"] += stats.drafted_per_position[0] if stats.drafted_per_position else 0
        for i, a in enumerate(stats.accepted_per_position[: args.k]):
            ours["per_position"][i] += a
        ours["outputs"].append(spec.token_ids)
    ours["acceptance_length"] = acceptance(ours["accepted"], ours["drafts"])
    ours["speedup_vs_plain"] = ours["plain_s"] / ours["spec_s"]
    cached = cached_acceptance(pair, prompts, ours["outputs"], args)
    vllm = run_vllm_heads(args, prompts, dtype)
    result = {"head": str(args.head), "k": args.k, "dtype": dtype, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "agentspec": ours, "vllm": vllm, "cached": cached,
              "same_as_plain": f"{same_as_plain}/{len(prompts)}"}  # fmt: skip
    goals = {}
    if isinstance(vllm, dict) and vllm.get("acceptance_length") and ours["acceptance_length"]:
        ratio = ours["acceptance_length"] / vllm["acceptance_length"]
        same = sum(a == b for a, b in zip(ours["outputs"], vllm["outputs"]))
        goals["acceptance_length_ours_over_vllm"] = f"{ratio:.3f} (goal within 0.9-1.1)"
        goals["replies_same_as_vllm"] = f"{same}/{len(prompts)}"
    goals["speedup_vs_plain"] = f"{ours['speedup_vs_plain']:.2f}x (goal >= 1.2 for the shipped head)"
    return {**result, "goals": goals}


FOLLOW_UP = "Thanks. Now say it again in one short sentence."


def cached_acceptance(pair: Any, prompts: list[list[int]], replies: list[list[int]], args) -> dict:
    """An agent's second call (the first call's prompt and reply, then a user turn) restored from the
    prefix cache, the head's ``context_rows`` of it computed again (0, 64), against the same calls
    uncached: acceptance length and seconds of each (goal: cached >= 0.9x uncached)."""
    turn = f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"  # the embedded template's
    follow = pair.tokenizer.encode(turn, add_special_tokens=False)
    second = [p + r + follow for p, r in zip(prompts, replies)]
    options = {"num_draft_tokens": args.k, "max_new_tokens": args.max_tokens}
    head, out = pair.draft, {}
    default = head.context_rows
    for rows in (None, 0, 64):  # None: uncached
        head.context_rows = default if rows is None else rows
        accepted = drafts = 0
        elapsed = 0.0
        for first, ids in zip(prompts, second):
            pair.prefix_cache.clear()
            if rows is not None:
                agentspec.generate(
                    pair, first, "none", max_new_tokens=args.max_tokens
                )  # the first call, cached
            t0 = time.perf_counter()
            r = agentspec.generate(pair, ids, "model", prefix_cache=rows is not None, **options)
            elapsed += time.perf_counter() - t0
            accepted += r.stats.accepted_tokens
            drafts += r.stats.drafted_per_position[0] if r.stats.drafted_per_position else 0
        key = "uncached" if rows is None else f"cached_rows_{rows}"
        out[key] = {"acceptance_length": acceptance(accepted, drafts), "seconds": elapsed}
    head.context_rows = default
    base = out["uncached"]["acceptance_length"] or 1.0
    for value in out.values():
        value["over_uncached"] = (value["acceptance_length"] or 1.0) / base
    return out


def run_vllm_heads(args: argparse.Namespace, prompts: list[list[int]], dtype: str) -> dict | str:
    """``harness.vllm_heads`` in vLLM's environment on the same prompts and head."""
    from agentspec.fleet.vllm import VLLM_PYTHON
    from agentspec.models import ensure_default_model

    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON}: make vllm"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        command = [str(VLLM_PYTHON), str(harness.ROOT / "benchmarks" / "harness.py"), "heads",
                   "--model", str(ensure_default_model()), "--head", str(args.head), "--method", args.method,
                   "--k", str(args.k), "--dtype", dtype, "--prompts", f"{tmp}/prompts.json",
                   "--max-tokens", str(args.max_tokens), "--out", f"{tmp}/out.json"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            return f"vLLM failed: {done.stderr[-2000:]}"
        out = json.loads((Path(tmp) / "out.json").read_text())
    counters = out["counters"]
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    out["acceptance_length"] = acceptance(accepted, drafts)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser("vllm", __doc__, threads=len(os.sched_getaffinity(0)))
    ap.add_argument("--part", choices=("conversation", "first_call", "heads"), default="conversation")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens a reply, at most")
    ap.add_argument("--calls", type=int, default=len(convo.LONG_TURNS), help="conversation: its calls")
    ap.add_argument("--repeats", type=int, default=2, help="conversation: runs of each system")
    ap.add_argument("--systems", default="agentspec,vllm", help=f"conversation: of {', '.join(SYSTEMS)}")
    ap.add_argument("--transcript", type=Path, help="conversation: JSON whose 'replies' every system reads")
    ap.add_argument("--sizes", default="128,1024", help="first_call: prompt token counts")
    ap.add_argument("--head", type=Path, help="heads: a head folder in the speculators format")
    ap.add_argument("--method", default="eagle3", help="heads: its vLLM method (eagle3, dflash)")
    ap.add_argument("--k", type=int, default=3, help="heads: draft tokens a pass (num_speculative_tokens)")
    ap.add_argument("--prompts", type=int, default=24, help="heads: held-out prompts")
    ap.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.dtypes, args.systems = args.dtypes.split(","), args.systems.split(",")
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    if set(args.systems) - set(SYSTEMS) or not 1 <= args.calls <= len(convo.LONG_TURNS):
        ap.error(f"--systems of {list(SYSTEMS)}; --calls from 1 to {len(convo.LONG_TURNS)}")
    args.fixed = load_transcript(args.transcript, args.calls) if args.transcript else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.first_call_child:
        first_call_child()
        return 0
    harness.set_threads(args.threads)  # as the serve worker: a thread per CPU
    pair = agentspec.load_pair(dtype=args.dtypes[0])
    env, tokenizer = harness.environment(pair), pair.tokenizer  # at the start: the machine, the load
    del pair  # every run loads its own
    run = {"conversation": run_conversation, "first_call": run_first_call, "heads": run_heads}[args.part]
    result = {"environment": env, **run(args, tokenizer)}
    harness.write(args.out, result, part=args.part)
    if args.part == "conversation":
        plot_conversation(result, args.out)
        print(conversation_table(result))
    print("\n".join(f"{name}: {goal}" for name, goal in result["goals"].items()))
    return 0
