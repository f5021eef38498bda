"""The 12-call agent conversation, agentspec beside vLLM, and the first call beside a later one
(issue 29's goals), per dtype, in one run.

Run from the repository root with the machine to itself (each dtype starts a vLLM worker: a minute
or two; ``.venv-vllm``, ``make vllm``):

    python -m benchmarks.bench_vs_vllm [--dtypes float32,bfloat16] [--calls 12] [--max-tokens 64]
        [--repeats 2] [--systems agentspec,vllm,serve] [--vllm-threads N]
        [--first-call-sizes 128,1024] [--transcript PATH] [--out benchmarks/results/vs_vllm.json]

The like-for-like comparison in bfloat16 (recommended; see "the same transcript" below):

    python -m benchmarks.bench_vs_vllm --dtypes bfloat16 --transcript benchmarks/conversation_transcript.json

**The conversation**: the inventory agent of ``agentspec/bench/conversation.py`` (``LONG_TURNS``:
6 user requests, each followed by a tool result, over the ~1,100-token system prompt that lists
the tools as text), ``--calls`` calls one at a time, each call's messages the system prompt, the
turns so far and the system's own earlier replies, as an agent loop sends them. No tools are bound,
so every reply is the model's raw text and replies compare as text; the tool results go as role
"function" (a result answering no call id: a plain-text reply has no parsed call a "tool" message
could answer). Greedy, at most ``--max-tokens`` a reply. Each system runs alone; the servers idle
while another system runs:

- ``agentspec``: ``ChatSpecDecode`` in this process with its defaults (speculation, the pair's
  prefix cache) on ``agentspec.load_pair(dtype=...)``, a **fresh pair per repeat** (its prefix
  cache and drafting memory start empty), warmed by one short call without the prefix cache.
- ``vllm``: one vLLM worker per dtype (``agentspec.fleet.vllm``: n-gram speculation, prefix
  caching), through the openai client's ``/v1/completions`` with the token ids ChatSpecDecode
  renders for the same messages (vLLM's chat endpoint renders the history in other tokens; the two
  engines are to read the same prompt), a **fresh cache salt per repeat** and for its warm-up call.
  By default vLLM binds its threads to one NUMA node's cores less one (one core of 2 here; the JSON's
  ``vllm_cores`` reads it from the log); ``--vllm-threads`` binds that many. The in-process pair
  runs a torch thread per CPU, as ``agentspec serve`` does.
- ``serve`` (optional): ``agentspec serve`` on every CPU (``bench_fleet``'s ``single``), through
  the openai client's chat endpoint, a fresh cache salt per repeat.

``--repeats`` runs of every system, the order rotating each repeat. Per system and repeat: total
seconds (the calls' sum), seconds per call, output tokens, tokens/s, and each reply; per dtype the
goal figure, vLLM's total over agentspec's (each the fastest repeat: a shared machine's noise only
adds time; goal >= 1.5), and which replies equal across systems and repeats.

**The same transcript** (``--transcript PATH``, a JSON file whose "replies" hold at least
``--calls`` - 1 replies): call n's earlier assistant messages are the file's first n replies, not the
system's own. In bfloat16 a near-tie of the top two logits flips a token on one system and not on
the other; with its own replies fed back, every later prompt then differs, and so does every later
reply's length, so the two totals measure different work (one run: agentspec wrote 209 tokens,
vLLM 280). With the transcript every system reads the same prompt on every call whatever it wrote
before; each system's own replies are still recorded and compared. ``conversation_transcript.json``
holds the 12 float32 replies every system wrote alike. Two figures beside the goal figure, where
agentspec and vLLM both ran:

- ``same_work`` (per dtype; goal ``conversation_same_work_vllm_over_agentspec_{dtype}``, >= 1.5):
  over the calls where every system's every repeat wrote the same reply, the sum of each system's
  seconds per call of its fastest repeat, and vLLM's sum over agentspec's: the same prompts and the
  same replies on both sides (absent where no call is equal).
- ``conversation_per_token_vllm_over_agentspec_{dtype}``: agentspec's tokens/s over vLLM's (each the
  fastest repeat), a rate that different reply lengths distort less than totals do (informational:
  no goal of its own).

**First call against a later one**: in a fresh Python process (nothing warm), ``load_pair`` timed
(the load), then ``ChatSpecDecode(pair=pair, prefix_cache=False)`` on prompt A (the first call),
then on prompt B (a later call): B has A's token count and other text (words of the system prompt
in another order), and nothing is reused from A's prefix. Each size runs twice, A then B and B then
A, so the firsts and the laters do the same work; the figure per size is the firsts' sum over the
laters' (goal <= 1.1). The drafting memory of the pair's default namespace is dropped after each call
(it outlives ``prefix_cache=False``), so the later call cannot draft from the first's reply.

Writes JSON (``--out``: environment, every figure, ``goals``), a PNG beside it (seconds per call)
and prints a table.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# OpenMP's own waiting, as a user runs it: passive waiting (bench_core.py's default, for a shared
# machine) made a bfloat16 one-row step 1.7x slower here (76.6 against 45.3 ms, issue 29)
import httpx
import openai
import torch
from langchain_core.messages import convert_to_messages

import agentspec
from agentspec.bench import conversation as convo
from agentspec.bench.run import environment
from agentspec.chat import prepare
from agentspec.fleet.process import checkout_env, free_port
from agentspec.fleet.vllm import vllm_worker
from agentspec.warm import warm_up
from benchmarks.bench_concurrency import completion_turn
from benchmarks.bench_fleet import CALL_TIMEOUT_S, running, turn
from benchmarks.bench_serve import in_process
from langchain_agentspec import ChatSpecDecode
from langchain_agentspec.messages import to_openai_messages

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {
    "agentspec": "ChatSpecDecode in process, its defaults (speculation, prefix cache), a fresh pair a repeat",
    "vllm": "one vLLM worker, n-gram speculation, prefix caching, prompts as ChatSpecDecode's token ids",
    "serve": "one agentspec serve on every CPU, through the openai client's chat endpoint",
}
CONVERSATION_GOAL = 1.5  # vLLM's conversation time over agentspec's, at least
FIRST_CALL_GOAL = 1.1  # a first call's time over a later one's of the same size, at most
TOOL_NAME = "stockbot"  # the name the tool results go under (role "function" takes one)


# --- the conversation ---------------------------------------------------------------------------


def call_messages(n: int, answers: list[str]) -> list[dict]:
    """Call n's OpenAI-format messages, the tool results as role "function" (see the docstring)."""
    msgs = convo.messages_for_call(n, answers, convo.LONG_TURNS)
    return [{**m, "role": "function", "name": TOOL_NAME} if m["role"] == "tool" else m for m in msgs]


def rendered_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The prompt ids ChatSpecDecode runs for ``messages``: through LangChain's messages and back."""
    return prepare(tokenizer, to_openai_messages(convert_to_messages(messages))).prompt.ids


def conversation(
    ask: Callable[[list[dict]], dict], calls: int, fixed: list[str] | None = None
) -> dict[str, Any]:
    """``calls`` calls one at a time, each answered by ``ask(messages)`` (a turn record: seconds,
    text, prompt, cached and output tokens); each reply goes into the next call's messages, or, given
    ``fixed`` (a transcript), ``fixed``'s replies do, so that every system reads the same prompts
    whatever it wrote (its own replies are still recorded)."""
    answers: list[str] = []
    turns: list[dict] = []
    for n in range(calls):
        earlier = answers if fixed is None else fixed[:n]
        turns.append(ask(call_messages(n, earlier)))
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
    """The replies of a transcript file (its "replies"): enough for ``calls`` calls, since call n
    reads the first n and a short file would otherwise fail only at the run's last call."""
    replies = json.loads(path.read_text())["replies"]
    if len(replies) < calls - 1 or not all(isinstance(r, str) for r in replies):
        raise ValueError(f"{path}: 'replies' must hold at least {calls - 1} strings, holds {len(replies)}")
    return replies


def run_agentspec(dtype: str, n_new: int, calls: int, fixed: list[str] | None = None) -> dict[str, Any]:
    """The conversation on a fresh pair in this process (nothing an earlier repeat cached is read)."""
    pair = agentspec.load_pair(dtype=dtype)
    ChatSpecDecode(pair=pair, prefix_cache=False, max_tokens=4).invoke("Hi")  # first-call costs
    llm = ChatSpecDecode(pair=pair, max_tokens=n_new)
    return conversation(lambda m: in_process(llm, m), calls, fixed)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)


def run_vllm(
    url: str, model: str, tokenizer: Any, n_new: int, calls: int, fixed: list[str] | None = None
) -> dict[str, Any]:
    """The conversation through vLLM's ``/v1/completions`` under a cache salt of its own."""
    client, salt = openai_client(url), uuid.uuid4().hex

    def ask(messages: list[dict]) -> dict:
        return completion_turn(client, model, rendered_ids(tokenizer, messages), salt, salt, n_new)

    return conversation(ask, calls, fixed)


def run_serve(url: str, model: str, n_new: int, calls: int, fixed: list[str] | None = None) -> dict[str, Any]:
    """The conversation through ``agentspec serve``'s chat endpoint under a cache salt of its own."""
    client, salt = openai_client(url), uuid.uuid4().hex
    return conversation(lambda m: turn(client, model, m, salt, salt, n_new), calls, fixed)


# --- the servers --------------------------------------------------------------------------------


def warm(url: str) -> str:
    """The served model's name, after one short call under a salt no run uses."""
    client = openai_client(url)
    model = client.models.list().data[0].id
    hi = [{"role": "user", "content": "Hi"}]
    client.chat.completions.create(model=model, messages=hi, max_tokens=4, extra_body={"cache_salt": "warm"})
    return model


@contextlib.contextmanager
def servers(names: list[str], dtype: str, threads: int | None, log_dir: Path) -> Iterator[dict[str, str]]:
    """The URL of each server system in ``names``, started for the block (all idle but the one called)."""
    with contextlib.ExitStack() as stack:
        urls = {}
        if "vllm" in names:
            port = free_port()
            worker = vllm_worker(port, log=log_dir / f"vllm_{dtype}.log", dtype=dtype, threads=threads)
            urls["vllm"] = stack.enter_context(worker).url
        if "serve" in names:
            system = stack.enter_context(running("single", log_dir, dtype))
            if isinstance(system, str):
                raise RuntimeError(f"agentspec serve: {system}")
            urls["serve"] = system.url
        yield urls


def side_by_side(args: argparse.Namespace, dtype: str, tokenizer: Any, log_dir: Path) -> dict[str, Any]:
    """Every system's conversation ``args.repeats`` times, the order rotating each repeat."""
    names = args.systems
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with servers(names, dtype, args.vllm_threads, log_dir) as urls:
        models = {n: warm(url) for n, url in urls.items()}
        versions = {n: server_version(url) for n, url in urls.items()}
        binding = vllm_cores(log_dir / f"vllm_{dtype}.log") if "vllm" in urls else None
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                run = one_run(name, urls, models, tokenizer, dtype, args)
                runs[name].append({"repeat": r, **run})
                print(
                    f"  {dtype} repeat {r} {name:>9}: {run['total_s']:8.2f} s, "
                    f"{run['tokens_per_s']:6.2f} tok/s",
                    flush=True,
                )
    return {
        "runs": runs,
        "server_versions": versions,
        "vllm_cores": binding,
        "replies": compare_replies(runs),
    }


def one_run(name: str, urls: dict, models: dict, tokenizer: Any, dtype: str, args) -> dict[str, Any]:
    if name == "agentspec":
        return run_agentspec(dtype, args.max_tokens, args.calls, args.fixed)
    if name == "vllm":
        return run_vllm(urls[name], models[name], tokenizer, args.max_tokens, args.calls, args.fixed)
    return run_serve(urls[name], models[name], args.max_tokens, args.calls, args.fixed)


def vllm_cores(log: Path) -> str | None:
    """The CPU cores vLLM's worker bound its threads to, as its log says (by default one NUMA
    node's cores less one, kept for its scheduler: one core of two here)."""
    found = re.findall(r"core ids=(\[[0-9, ]*\])", log.read_text(errors="replace"))
    return found[-1] if found else None


def server_version(url: str) -> str | None:
    """vLLM's ``/version`` (None where a server has none)."""
    r = httpx.get(f"{url}/version", timeout=10)
    return r.json().get("version") if r.status_code == 200 else None


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


# --- the first call against a later one ---------------------------------------------------------


def one_token_words(tokenizer: Any) -> list[str]:
    """Words of the system prompt that are one token each after a space (so n words add n tokens)."""
    words = sorted(set(re.findall(r"[a-z]+", convo.SYSTEM_PROMPT)))
    return [w for w in words if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]


def sized_prompt(tokenizer: Any, size: int, seed: int) -> list[dict]:
    """A one-message prompt of exactly ``size`` tokens as ChatSpecDecode renders it: a question and
    the system prompt's one-token words in an order of ``seed``'s."""
    pool, rng = one_token_words(tokenizer), random.Random(seed)
    head = "Summarise these stock notes in one line:"
    base = len(rendered_ids(tokenizer, [{"role": "user", "content": head}]))
    words: list[str] = []
    while len(words) < size - base:
        words += rng.sample(pool, len(pool))
    messages = [{"role": "user", "content": " ".join([head, *words[: size - base]])}]
    got = len(rendered_ids(tokenizer, messages))
    assert got == size, f"{size=} {got=}: a word merged with its neighbour"
    return messages


def first_call_child() -> None:
    """In a fresh process: the load, then one call per prompt given on stdin, each timed."""
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    start = time.perf_counter()
    pair = agentspec.load_pair(dtype=spec["dtype"], warm_up=False)
    load_s = time.perf_counter() - start
    warm_up_s = warm_up(pair)  # what load_pair runs by default: timed on its own here
    llm = ChatSpecDecode(pair=pair, prefix_cache=False, max_tokens=spec["max_tokens"])
    calls = []
    for messages in spec["prompts"]:
        calls.append(in_process(llm, messages))
        # what drafting learned from this reply goes: a later call drafting from it would be faster
        # for that, not for being later (the pair's learned pass costs stay: they are warm state)
        pair.tenants.drop(None)
    print(json.dumps({"load_s": load_s + warm_up_s, "warm_up_s": warm_up_s, "calls": calls}))


def first_call_process(dtype: str, prompts: list[list[dict]], n_new: int) -> dict[str, Any]:
    """``first_call_child`` in a fresh Python process; its figures, and the process's wall time."""
    spec = json.dumps({"dtype": dtype, "max_tokens": n_new, "prompts": prompts})
    command = [sys.executable, "-m", "benchmarks.bench_vs_vllm", "--first-call-child"]
    start = time.perf_counter()
    done = subprocess.run(command, input=spec, capture_output=True, text=True, cwd=ROOT, env=checkout_env())
    if done.returncode != 0:
        raise RuntimeError(f"first-call process failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), "process_s": time.perf_counter() - start}


def first_calls(dtype: str, tokenizer: Any, sizes: list[int], n_new: int) -> list[dict[str, Any]]:
    """Per prompt size, prompts A and B in both orders, each in a fresh process; the firsts' sum over
    the laters' (the same work on both sides)."""
    rows = []
    for size in sizes:
        a, b = sized_prompt(tokenizer, size, seed=1), sized_prompt(tokenizer, size, seed=2)
        runs = [first_call_process(dtype, pair, n_new) for pair in ([a, b], [b, a])]
        for order, run in zip(("AB", "BA"), runs):
            first, later = run["calls"]
            print(
                f"  {dtype} first call, {size} tokens, {order}: load {run['load_s']:.2f} s "
                f"(warm-up {run['warm_up_s']:.2f} s), "
                f"first {first['seconds']:.3f} s, later {later['seconds']:.3f} s",
                flush=True,
            )
        firsts = sum(run["calls"][0]["seconds"] for run in runs)
        laters = sum(run["calls"][1]["seconds"] for run in runs)
        rows.append({"prompt_tokens": size, "first_over_later": round(firsts / laters, 3), "runs": runs})
    return rows


# --- the report ---------------------------------------------------------------------------------


def fastest(runs: list[dict]) -> dict:
    return min(runs, key=lambda run: run["total_s"])


def same_work(runs: dict[str, list[dict]]) -> dict[str, Any] | None:
    """vLLM's seconds over agentspec's on the calls where every system's every repeat wrote the same
    reply (each system's fastest repeat): there both read the same prompt and wrote the same tokens,
    so the ratio compares the same work even where a flipped token made the totals differ. None
    where agentspec or vLLM did not run, or no call is equal."""
    if not (runs.get("agentspec") and runs.get("vllm")):
        return None
    equal = compare_replies(runs)["all_equal_per_call"]
    calls = [n for n, same in enumerate(equal) if same]
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


def conversation_goals(dtype: str, result: dict[str, Any]) -> dict[str, Any]:
    """The conversation's figures, where agentspec and vLLM both ran: the totals' ratio (the goal),
    the same-work ratio (the like-for-like one) and the per-token one (informational: replies of
    other lengths weigh less in a rate than in a total)."""
    runs = result["conversation"]["runs"]
    if not (runs.get("agentspec") and runs.get("vllm")):
        return {}
    ours, theirs = fastest(runs["agentspec"]), fastest(runs["vllm"])
    figures = {
        f"conversation_vllm_over_agentspec_{dtype}": theirs["total_s"] / ours["total_s"],
    }
    if work := result.get("same_work"):
        figures[f"conversation_same_work_vllm_over_agentspec_{dtype}"] = work["vllm_over_agentspec"]
    goal, bound = f">= {CONVERSATION_GOAL}", CONVERSATION_GOAL
    out = {name: {"value": round(v, 3), "goal": goal, "met": v >= bound} for name, v in figures.items()}
    out[f"conversation_per_token_vllm_over_agentspec_{dtype}"] = {
        "value": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
        "goal": None,  # informational: the goal is on the whole conversation's time
    }
    return out


def dtype_goals(dtype: str, result: dict[str, Any]) -> dict[str, Any]:
    """Issue 29's goals this benchmark measures, for one dtype, where their parts ran: the conversation,
    the first call, and what warming up adds to the load."""
    out = conversation_goals(dtype, result)
    if result["first_call"]:
        value = max(row["first_over_later"] for row in result["first_call"])
        met = value <= FIRST_CALL_GOAL
        out[f"first_over_later_{dtype}"] = {"value": value, "goal": f"<= {FIRST_CALL_GOAL}", "met": met}
        runs = [run for row in result["first_call"] for run in row["runs"]]
        share = max(run["warm_up_s"] / (run["load_s"] - run["warm_up_s"]) for run in runs)
        out[f"warm_up_over_load_{dtype}"] = {"value": round(share, 3), "goal": "<= 0.2", "met": share <= 0.2}
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'dtype':>9} {'system':>9} {'total s (each repeat)':>28} {'tokens':>7} {'tok/s':>7} repeats agree"
    ]
    for dtype, per in result["dtypes"].items():
        replies = per["conversation"]["replies"]
        for name, runs in per["conversation"]["runs"].items():
            totals = ", ".join(f"{run['total_s']:.2f}" for run in runs)
            best = fastest(runs)
            lines.append(
                f"{dtype:>9} {name:>9} {totals:>28} {best['output_tokens']:>7} "
                f"{best['tokens_per_s']:>7.2f} {replies[name]['repeats_agree']}"
            )
        if per.get("same_work"):
            work = per["same_work"]
            lines.append(
                f"{dtype:>9} same work, calls {work['calls']}: agentspec {work['agentspec_s']:.2f} s, "
                f"vllm {work['vllm_s']:.2f} s, vllm/agentspec {work['vllm_over_agentspec']:.3f}"
            )
        for row in per["first_call"]:
            loads = ", ".join(f"{run['load_s']:.2f}" for run in row["runs"])
            lines.append(
                f"{dtype:>9} first call, {row['prompt_tokens']} tokens: first/later "
                f"{row['first_over_later']:.3f}, load s {loads}"
            )
    if result.get("transcript"):
        lines.append(f"every call's earlier replies from {result['transcript']}")
    lines += [f"{name}: {goal}" for name, goal in result["goals"].items()]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Seconds per call of each system's fastest repeat, a panel per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plots import finish

    dtypes = list(result["dtypes"])
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for name, runs in result["dtypes"][dtype]["conversation"]["runs"].items():
            best = fastest(runs)
            calls = range(1, len(best["per_call_s"]) + 1)
            ax.plot(calls, best["per_call_s"], "o-", label=f"{name} ({best['total_s']:.1f} s)")
        ax.set_xlabel("agent call")
        ax.set_ylabel("seconds")
        ax.set_title(dtype)
        ax.legend()
    title = f"{dtypes[-1]}: the agent conversation, seconds per call (fastest repeat)"
    finish(fig, axes[0][-1], path, ylabel="seconds", title=title, dpi=110, xlabel="agent call")


def measure(args: argparse.Namespace, tokenizer: Any, log_dir: Path) -> dict[str, Any]:
    """Per dtype: the first calls (no server running), then the conversations side by side."""
    out = {}
    for dtype in args.dtypes:
        first = first_calls(dtype, tokenizer, args.first_call_sizes, args.max_tokens)
        talk = side_by_side(args, dtype, tokenizer, log_dir)
        out[dtype] = {"first_call": first, "conversation": talk, "same_work": same_work(talk["runs"])}
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--calls", type=int, default=len(convo.LONG_TURNS), help="calls of the conversation")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", default="agentspec,vllm", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--vllm-threads", type=int, default=None, help="vLLM's CPU threads (default: its own)")
    ap.add_argument("--first-call-sizes", default="128,1024", help="prompt token counts; empty: none")
    ap.add_argument(
        "--transcript",
        type=Path,
        default=None,
        help="JSON whose 'replies' every system reads as its earlier replies (default: each its own)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vs_vllm.json")
    ap.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.dtypes, args.systems = args.dtypes.split(","), args.systems.split(",")
    args.first_call_sizes = [int(s) for s in args.first_call_sizes.split(",") if s]
    if set(args.systems) - set(SYSTEMS) or not 1 <= args.calls <= len(convo.LONG_TURNS):
        ap.error(f"--systems of {list(SYSTEMS)}; --calls from 1 to {len(convo.LONG_TURNS)}")
    args.fixed = load_transcript(args.transcript, args.calls) if args.transcript else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.first_call_child:
        first_call_child()
        return 0
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # as the serve worker: a thread per CPU
    pair = agentspec.load_pair(dtype=args.dtypes[0])
    env, tokenizer = environment(pair), pair.tokenizer  # at the start: the commit, the machine, the load
    del pair  # every run loads its own
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    print(f"servers' logs in {log_dir}", flush=True)
    dtypes = measure(args, tokenizer, log_dir)
    goals = {name: g for dtype, per in dtypes.items() for name, g in dtype_goals(dtype, per).items()}
    result = {
        "benchmark": "the agent conversation, agentspec beside vLLM; the first call beside a later one",
        "environment": env,
        "systems": {name: SYSTEMS[name] for name in args.systems},
        "vllm_threads": args.vllm_threads,  # None: vLLM's own binding (see its log)
        "calls": args.calls,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "transcript": str(args.transcript) if args.transcript else None,  # None: each system's own replies
        "first_prompt_tokens": len(rendered_ids(tokenizer, call_messages(0, []))),
        "goals": goals,
        "dtypes": dtypes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
