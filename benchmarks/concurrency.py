"""K agent sessions at once on agentspec (in process, one server, a fleet) and vLLM; calls sharing passes.

    python -m benchmarks concurrency [--part sessions] [--systems a,b] [--k 1,2,4,8,16]
        [--max-new-tokens 48] [--dtype float32] [--traces a,b]
    python -m benchmarks concurrency --part fleet      # single, fleet_hash, fleet_rr and vLLM
    python -m benchmarks concurrency --part join [--chunks 0,256,64,32] [--prompt-tokens 4000] [--calls 4]
    python -m benchmarks concurrency --part batch [--prompts 8] [--rounds 2]
    python -m benchmarks concurrency --part shared_prompt [--calls 8] [--rounds 2] [--draft-model PATH]

``sessions`` (the default; an hour or more on 2 CPU cores) and ``fleet`` (20-30 minutes): K sessions
at once replay the agent traces turn by turn (``workloads.sessions``: session i replays trace i mod 5,
a repeated trace tagged in its first user message, so no two sessions send the same history), greedy,
each under its own ``X-Session-ID``. No tools are bound (the traces carry theirs in the system
prompt), so replies compare as text. The systems run one after another, each alone on the machine,
an in-process system's every K in a fresh process (no idle threads of one system slow the next):

- ``inprocess``: K threads calling ``ChatSpecDecode.invoke`` on one pair in one process, whose
  scheduler shares its passes among them (``scheduler``: passes, member shares and rows over the run);
  ``sequential``: the same K sessions one after another; ``inprocess_off``: at once with speculation
  off; ``inprocess_unscheduled``: at once, each call drafting as it would alone (the scheduler's
  ``schedule_drafts`` off: no shared verify lengths; ``scheduler.trimmed`` counts the draft tokens a
  shared pass left out); ``inprocess_eagle3``: at once on a pair drafting with the EAGLE-3 head
  agentspec ships, 4 tokens a pass (``scheduler.draft_steps_per_pass``: the head's steps each of its
  passes ran, packed across calls). A fresh pair for each K, so no K reads what an earlier one left in
  its caches.
- ``single``: one ``agentspec serve`` on every CPU; ``fleet_hash`` / ``fleet_rr``: 2 workers of one CPU
  each behind vllm-router, consistent hashing / round robin (``placement``: each session's workers,
  from the router's log; ``requests_per_worker``: from each worker's /metrics).
- ``vllm_spec`` / ``vllm_plain``: one vLLM worker with prefix caching, with and without n-gram
  speculation (``.venv-vllm``: ``make vllm``; skipped with a note where missing). In ``sessions`` each
  turn goes to ``/v1/completions`` as the token ids agentspec renders for it, so both engines read the
  same prompt (vLLM's chat endpoint renders the tool history in fewer tokens); in ``fleet`` it goes to
  the chat endpoint, as any client's would.
- ``vllm_eagle3``: one vLLM worker drafting with the EAGLE-3 head agentspec ships
  (``agentspec.models.EAGLE3_HEAD``), 4 tokens a pass, prefix caching; in ``sessions`` by default.

In-process runs also give their ``compute_floor``: the rows the run had to compute (uncached prompt
tokens and output tokens of every turn) times a row's cost at the pair's best rate, timed on the same
pair right after (a forward of 256 fresh rows), and ``wall_over_floor``.

Each server run of a K uses a cache salt of its own. Per system and K: session latency (median, p90),
generated tokens/s, the share of prompt tokens read from cache, and every turn compared with the
reference system's turn for the same history (``same_as_reference``: reply and prompt length equal;
the reference is ``sequential`` in ``sessions``, the solo turns, and ``single`` in ``fleet``); ``goals``
(``GOALS``) wherever their systems ran.

``join``: ``--calls`` plain greedy calls (one token a pass each) start together on one pair; once each
has ``--warm`` tokens, a ``--prompt-tokens`` prompt joins, fed ``prefill_chunk`` tokens a pass beside
their rows (0: in one pass). Per chunk size: the running calls' time between tokens (median, p90 and
the longest; the goal: p90 within 2x the median), the joiner's time to first token, and whether every
output equals the same call alone.

``batch``: ``ChatSpecDecode.batch()`` of ``--prompts`` short questions (LangChain's thread pool; the
scheduler shares its passes among them) against the same prompts invoked one after another, a fresh
pair each, rounds alternating which goes first; greedy, every batched reply compared with its
sequential one.

``shared_prompt``: ``--calls`` agent calls start together with one system prompt (``INVENTORY_1``'s,
its tools included) and a question each, greedy, on a fresh pair per mode, rounds alternating which
goes first: ``shared`` (the scheduler copies a prompt's rows another call holds, ``share_prompts``),
``unshared`` (each computes its own) and ``one_after_another`` (the solo replies). Per mode: wall
time, the rows copied, and ``prefix_rows_computed``: the rows of the calls' common prefix the target
computed (once: the common prefix less what the prefix cache held; unshared: once per call). With
``--draft-model`` the calls draft with that model, whose prompt rows are copied in flight too
(``scheduler.draft_shared``).

Writes ``results/concurrency.json`` (one key per part) and ``concurrency_<part>.png`` for the sessions.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import harness, workloads

# the in-process systems: their description, and what differs from ChatSpecDecode's defaults (the
# chat model's fields; "schedule_drafts": the pair's scheduler's)
IN_PROCESS: dict[str, tuple[str, dict[str, Any]]] = {
    "inprocess": ("K threads on one in-process pair (ChatSpecDecode), its scheduler sharing passes", {}),
    "inprocess_off": ("the same with speculation off (drafter 'none')", {"drafter": "none"}),
    "inprocess_unscheduled": (
        "the same with each call drafting as alone (no shared verify lengths)",
        {"schedule_drafts": False},
    ),
    "inprocess_eagle3": (
        "the same on a pair drafting with agentspec's EAGLE-3 head (drafter 'model', 4 tokens a pass)",
        {"drafter": "model", "draft_model": "eagle3"},
    ),
    "sequential": ("the same K sessions one after another on one in-process pair", {}),
}
SYSTEMS = {
    **{name: description for name, (description, _) in IN_PROCESS.items()},
    **harness.SYSTEMS,
}
SESSION_PARTS = {  # part: (its systems, its K, the system every turn is compared with)
    "sessions": ("inprocess,sequential,single,vllm_spec,vllm_eagle3", "1,2,4,8,16", "sequential"),
    "fleet": ("single,fleet_hash,fleet_rr,vllm_spec,vllm_plain", "1,2,4,8", "single"),
}
# (name, K, system a, system b, field, a's field over b's (gap: their difference) against the bound)
GOALS = [
    ("k8_inprocess_over_vllm_spec_tokens_per_s", 8, "inprocess", "vllm_spec", "tokens_per_s", ">=", 1.5),
    ("k8_vllm_spec_over_inprocess_median_session_s", 8, "vllm_spec", "inprocess", "median_session_s",
     ">=", 1.0),
    ("k8_inprocess_over_vllm_eagle3_tokens_per_s", 8, "inprocess", "vllm_eagle3", "tokens_per_s", ">=", 1.0),
    ("k8_inprocess_over_sequential_tokens_per_s", 8, "inprocess", "sequential", "tokens_per_s", ">=", 3.0),
    ("k8_inprocess_over_inprocess_off_tokens_per_s", 8, "inprocess", "inprocess_off", "tokens_per_s",
     ">=", 1.1),
    ("k8_single_over_inprocess_wall_s", 8, "single", "inprocess", "wall_s", "<=", 1.10),
    ("k1_vllm_spec_over_single", 1, "vllm_spec", "single", "median_session_s", ">=", 1.5),
    ("k8_single_over_fleet_hash", 8, "single", "fleet_hash", "median_session_s", ">=", 1.3),
    ("k8_cache_share_gap", 8, "single", "fleet_hash", "cache_share", "gap <=", 0.05),
]  # fmt: skip


# --- K sessions at once -------------------------------------------------------------------------


def replay(ask: Callable[[list[dict], str], dict], session: str, tag: str | None, trace) -> dict[str, Any]:
    """One session: ``trace``'s turns one after another, each history answered by ``ask(messages,
    session)``, which returns the turn's record (``harness.chat_turn``'s fields)."""
    start = time.perf_counter()
    histories = [workloads.tagged(workloads.openai_messages(h), tag) for h, _ in workloads.calls(trace)]
    turns = [ask(messages, session) for messages in histories]
    seconds = time.perf_counter() - start
    return {"session": session, "trace": trace.name, "tag": tag, "seconds": seconds, "turns": turns}


def at_once(name: str, k: int, traces, ask, workers: int | None = None) -> tuple[dict, list[dict]]:
    """k sessions of system ``name``, ``workers`` at a time (default: all at once): the run's figures
    (session latency, generated tokens/s, share of prompt tokens from cache) and the sessions."""
    ids, start = [f"{name}-k{k}-s{i}" for i in range(k)], time.perf_counter()
    with ThreadPoolExecutor(workers or k) as pool:
        jobs = [pool.submit(replay, ask, i, *tt) for i, tt in zip(ids, workloads.sessions(k, traces))]
        sessions = [job.result() for job in jobs]
    wall = time.perf_counter() - start
    turns = [t for s in sessions for t in s["turns"]]
    latencies = [s["seconds"] for s in sessions]
    cached, prompt = (sum(t[f] for t in turns) for f in ("cached_tokens", "prompt_tokens"))
    return {
        "k": k,
        "wall_s": round(wall, 3),
        "median_session_s": round(statistics.median(latencies), 3),
        "p90_session_s": round(harness.p90(latencies), 3),
        "tokens_per_s": round(sum(t["output_tokens"] for t in turns) / wall, 3),
        "cache_share": round(cached / prompt, 4),
    }, sessions


def scheduler_work(pair, before: dict[str, int] | None = None) -> dict[str, Any]:
    """The scheduler's passes, member shares and rows so far, or since ``before``, and both per pass."""
    stats = pair.scheduler.stats
    fields = ("passes", "members", "rows", "trimmed", "draft_steps", "draft_passes", "draft_shared")
    work = {f: getattr(stats, f, 0) - (before or {}).get(f, 0) for f in fields}
    per_pass = {f"{f}_per_pass": round(work[f] / work["passes"], 3) if work["passes"] else None
                for f in ("members", "rows")}  # fmt: skip
    # drafters' model steps per pass that ran them: 1 where none are packed
    steps = work["draft_steps"] / work["draft_passes"] if work["draft_passes"] else None
    return work | per_pass | {"draft_steps_per_pass": round(steps, 3) if steps else None}


def run_pair(name: str, dtype: str, k: int, n_new: int, traces) -> dict[str, Any]:
    """k sessions on a fresh pair in this process: all at once (``inprocess``) or one after another."""
    import torch

    import agentspec
    from agentspec.models import EAGLE3_HEAD
    from langchain_agentspec import ChatSpecDecode

    options = dict(IN_PROCESS[name][1])
    head = options.pop("draft_model", None) == "eagle3"
    pair = agentspec.load_pair(draft_model=str(EAGLE3_HEAD) if head else None, dtype=dtype)
    pair.scheduler.schedule_drafts = options.pop("schedule_drafts", pair.scheduler.schedule_drafts)
    llm = ChatSpecDecode(pair=pair, max_tokens=n_new, **options)
    # first-call costs stay out of the timing (the chat template's first tokens stay in the pair's
    # cache: a first turn reads them, where a server's salted turn reads nothing)
    harness.in_process(llm, [{"role": "user", "content": "Hi"}])
    before = scheduler_work(pair)
    ask = lambda messages, _session: harness.in_process(llm, messages)  # noqa: E731
    figures, sessions = at_once(name, k, traces, ask, 1 if name == "sequential" else k)
    work = scheduler_work(pair, before)
    settings = {"load_factor": pair.scheduler.load_factor, "schedule_drafts": pair.scheduler.schedule_drafts,
                "process": os.getpid(), "torch_threads": torch.get_num_threads()}  # fmt: skip
    floor = compute_floor(pair, [t for s in sessions for t in s["turns"]])
    floor["wall_over_floor"] = round(figures["wall_s"] / floor["floor_s"], 3)
    return {**figures, **settings, "scheduler": work, "compute_floor": floor, "sessions": sessions}


FLOOR_ROWS = 256  # rows of the forward that times a row at the pair's best rate (a prompt's prefill)


def compute_floor(pair, turns: list[dict]) -> dict[str, Any]:
    """The least time the run's work could take: the rows it must compute (each turn's uncached
    prompt tokens and its output tokens, one row each) times a row's cost at the pair's best rate,
    measured now, on this pair: the median of 3 forwards of ``FLOOR_ROWS`` fresh rows, per row."""
    import torch

    from agentspec.kv import ModelState

    ids = [(7 * i) % 1000 + 100 for i in range(FLOOR_ROWS)]
    times = []
    for _ in range(3):
        state = ModelState(pair.target_forward)
        start = time.perf_counter()
        with torch.inference_mode():
            state.forward(ids, 1)
        times.append(time.perf_counter() - start)
    row_s = statistics.median(times) / FLOOR_ROWS
    rows = sum(t["prompt_tokens"] - t["cached_tokens"] + t["output_tokens"] for t in turns)
    return {"rows": rows, "row_s": round(row_s, 6), "floor_s": round(rows * row_s, 3)}


def run_server(system: harness.System, model: str, k: int, n_new: int, traces, tokenizer=None) -> dict:
    """k sessions at once through ``system``: by chat, or with a ``tokenizer`` by ``/v1/completions``
    of the prompt ids agentspec renders."""
    from agentspec.chat import prepare

    client, salt = harness.client(system.url), uuid.uuid4().hex

    def ask(messages: list[dict], session: str) -> dict[str, Any]:
        if tokenizer is None:
            return harness.chat_turn(client, model, messages, session, salt, n_new)
        ids = prepare(tokenizer, messages).prompt.ids  # as ChatSpecDecode and agentspec serve render
        return harness.completion_turn(client, model, ids, session, salt, n_new)

    served = system.served()
    figures, sessions = at_once(system.name, k, traces, ask)
    return {
        **figures,
        "requests_per_worker": [b - a for a, b in zip(served, system.served())],
        "placement": system.placement([s["session"] for s in sessions]),
        "sessions": sessions,
    }


def report(name: str, run: dict[str, Any]) -> dict[str, Any]:
    shared = run.get("scheduler", {}).get("members_per_pass")
    print(f"{name:>10} K={run['k']}: median {run['median_session_s']:7.2f} s, p90 {run['p90_session_s']:7.2f}"
          f" s, {run['tokens_per_s']:6.2f} tok/s, cache {run['cache_share']:.2f}"
          + ("" if shared is None else f", {shared} sequences per pass"), flush=True)  # fmt: skip
    return run


def measure(
    names: list[str], ks: list[int], n_new: int, dtype: str, traces, tokenizer, threads: int | None = None
) -> tuple[dict, dict]:
    """The runs of each system that can run here, one system after another (each has the machine to
    itself; an in-process system's every K in a process of its own, ``harness.in_own_process``), and
    why the others were skipped. ``tokenizer``: vLLM is sent prompt ids, not chats."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    print(f"servers' logs in {log_dir}", flush=True)
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if name in IN_PROCESS:
            runs[name] = [report(name, harness.in_own_process(run_pair, name, dtype, k, n_new, traces,
                                                              threads=threads)) for k in ks]  # fmt: skip
            continue
        with harness.running(name, log_dir, dtype) as system:
            if isinstance(system, str):
                skipped[name] = system
                print(f"{name}: skipped, {system}", flush=True)
                continue
            model = [harness.served_model(url) for url in system.workers][0]  # every worker warm
            ids_by = tokenizer if name.startswith("vllm") else None
            runs[name] = [report(name, run_server(system, model, k, n_new, traces, ids_by)) for k in ks]
    return runs, skipped


def compare(runs: dict[str, list[dict]], reference: str) -> list[tuple]:
    """Mark every turn against the ``reference`` system's turn for the same history (the same trace,
    tag and turn): its reply and its prompt length each equal; count per run. Returns the turns whose
    reply differs, as (session, turn index, turn, reference turn)."""
    key = lambda s, n: (s["trace"], s["tag"], n)  # noqa: E731
    ref = {
        key(s, n): t for r in runs.get(reference, []) for s in r["sessions"] for n, t in enumerate(s["turns"])
    }
    differing = []
    for run in (run for system_runs in runs.values() for run in system_runs):
        for s in run["sessions"]:
            for n, t in enumerate(s["turns"]):
                other = ref.get(key(s, n))
                t["same_as_reference"] = None if other is None else same(t, other)
                if other is not None and not t["same_as_reference"]["reply"]:
                    differing.append((s, n, t, other))
        marks = [
            t["same_as_reference"] for s in run["sessions"] for t in s["turns"] if t["same_as_reference"]
        ]
        run["same_as_reference"] = {
            "replies": sum(m["reply"] for m in marks),
            "prompt_tokens": sum(m["prompt_tokens"] for m in marks),
            "turns": len(marks),
        }
    return differing


def divergences(differing: list[tuple], traces, dtype: str) -> list[dict[str, Any]]:
    """Where each differing reply (``compare``'s) parts from its reference, and the target's logit
    margin there (``agentspec.bench.divergence``: top-1 minus top-2 after the common part, one plain
    transformers pass in the run's dtype): a near tie is two correct computations summing in another
    order, a wide margin a bug. Replies are compared as their texts' token ids. Each is also set on
    its turn (``divergence``)."""
    if not differing:
        return []
    import agentspec
    from agentspec.bench.divergence import first_diff, top_two
    from agentspec.chat import prepare

    pair, by_name, out = agentspec.load_pair(dtype=dtype), {t.name: t for t in traces}, []
    encode = lambda text: pair.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for s, n, turn, other in differing:
        messages = workloads.openai_messages(workloads.calls(by_name[s["trace"]])[n][0])
        ids = prepare(pair.tokenizer, workloads.tagged(messages, s["tag"])).prompt.ids
        got, want = encode(turn["text"]), encode(other["text"])
        at = first_diff(got, want) or 0
        first, second, margin = top_two(pair.target, ids + want[:at])
        turn["divergence"] = {"token": at, "margin": round(margin, 4), "top_two": [first, second]}
        out.append({"session": s["session"], "turn": n, **turn["divergence"]})
    return out


def same(turn: dict[str, Any], other: dict[str, Any]) -> dict[str, bool]:
    return {
        "reply": (turn["text"], turn["tool_calls"]) == (other["text"], other["tool_calls"]),
        "prompt_tokens": turn["prompt_tokens"] == other["prompt_tokens"],
    }


def goals(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """``GOALS`` where both their systems ran at their K; every in-process reply at K = 8 as solo."""
    at = {(name, run["k"]): run for name, system_runs in runs.items() for run in system_runs}
    out: dict[str, Any] = {}
    for name, k, a, b, field, test, bound in GOALS:
        if (a, k) in at and (b, k) in at:
            x, y = at[a, k][field], at[b, k][field]
            value = abs(x - y) if test.startswith("gap") else x / y
            met = value >= bound if test == ">=" else value <= bound
            out[name] = {"value": round(value, 4), "goal": f"{test.split()[-1]} {bound}", "met": met}
    if ("inprocess", 8) in at:
        same = at["inprocess", 8]["same_as_reference"]
        out["k8_inprocess_replies_as_solo"] = {"value": [same["replies"], same["turns"]],
                                               "met": 0 < same["turns"] == same["replies"]}  # fmt: skip
    return out


def plot(result: dict[str, Any], out: Path, part: str) -> None:
    panels = [
        ("median_session_s", "median session latency (s)"),
        ("tokens_per_s", "generated tokens/s, all sessions"),
        ("cache_share", "share of prompt tokens from cache"),
    ]
    with harness.figure(out, len(panels), part=part, size=(5, 4.2)) as axes:
        for ax, (field, label) in zip(axes, panels):
            for name, system_runs in result["runs"].items():
                ks = [run["k"] for run in system_runs]
                (line,) = ax.plot(ks, [run[field] for run in system_runs], "o-", label=name)
                if field == "median_session_s":
                    ax.plot(ks, [run["p90_session_s"] for run in system_runs], ":", color=line.get_color())
            ax.set_xscale("log", base=2)
            ax.set_xticks(result["k"], [str(k) for k in result["k"]])
            ax.set_xlabel("concurrent sessions K")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
        axes[0].set_title(f"Agent sessions at once, {result['dtype']} (dotted: p90)")


def sessions_part(args) -> dict[str, Any]:
    import agentspec

    systems, ks, reference = SESSION_PARTS[args.part]
    names, ks = (args.systems or systems).split(","), [int(k) for k in (args.k or ks).split(",")]
    if unknown := set(names) - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    traces = workloads.traces_named(args.traces)
    n_new = args.max_new_tokens or 48
    pair = agentspec.load_pair(dtype=args.dtype)  # at the start: the commit, the machine, the load
    env, dtype = harness.environment(pair), str(pair.dtype).removeprefix("torch.")
    tokenizer = pair.tokenizer if args.part == "sessions" else None
    del pair  # each in-process run loads a fresh one
    runs, skipped = measure(names, ks, n_new, dtype, traces, tokenizer, args.threads)
    differing = compare(runs, reference)
    result = {
        "benchmark": f"K concurrent agent sessions: {', '.join(names)}",
        "environment": env,
        "dtype": dtype,
        "systems": {name: SYSTEMS[name] for name in names},
        "skipped": skipped,
        "k": ks,
        "traces": [t.name for t in traces],
        "max_new_tokens": n_new,
        "reference": reference,
        "goals": goals(runs),
        "divergences": divergences(differing, traces, dtype),
        "runs": runs,
    }
    if runs:
        plot(result, args.out, args.part)
    print(json.dumps({"goals": result["goals"], "skipped": skipped}, indent=1), flush=True)
    return result


# --- a long prompt joining decoding calls ---------------------------------------------------------


def question_ids(pair, text: str) -> list[int]:
    from agentspec.bench.conversation import prompt_ids

    return prompt_ids(pair.tokenizer, [{"role": "user", "content": text}])


def long_prompt(pair, tokens: int) -> list[int]:
    """A chat prompt of about ``tokens`` tokens: a log to summarise."""
    words = " ".join(
        f"Item {i}: the shipment of part {i * 7 % 97} arrived on day {i % 31}." for i in range(tokens)
    )
    ids = question_ids(pair, "Summarise this log.\n" + words)
    return ids[: tokens - 8] + ids[-8:]  # the chat template's end, so the model answers


def token_times(steps: list) -> list[float]:
    """Each output token's time since the one before it (a pass's tokens share its interval)."""
    out = []
    for prev, step in zip(steps, steps[1:]):
        gap = (step.started + step.seconds) - (prev.started + prev.seconds)
        out += [gap / max(1, len(step.tokens))] * len(step.tokens)
    return out


def one_join(pair, prompts: list[list[int]], joiner: list[int], n_new: int, warm: int) -> dict[str, Any]:
    """The calls started together, the long prompt joining once each has ``warm`` tokens."""
    import agentspec

    steps: list[list] = [[] for _ in prompts]
    warmed = threading.Barrier(len(prompts) + 1)

    def call(i: int) -> None:
        reached = False
        for step in agentspec.stream(pair, prompts[i], None, False, max_new_tokens=n_new, speculative=False):
            steps[i].append(step)
            if not reached and sum(len(s.tokens) for s in steps[i]) >= warm:
                reached = True
                warmed.wait()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    warmed.wait()
    t0 = time.perf_counter()
    joined = list(agentspec.stream(pair, joiner, None, False, max_new_tokens=8, speculative=False))
    ttft = joined[0].started + joined[0].seconds - t0
    for t in threads:
        t.join()
    gaps = [g for s in steps for g in token_times(s)]
    return {
        "outputs": [[t for s in st for t in s.tokens] for st in steps],
        "joiner_output": [t for s in joined for t in s.tokens],
        "median_ms": statistics.median(gaps) * 1e3,
        "p90_ms": statistics.quantiles(gaps, n=10)[-1] * 1e3,
        "max_ms": max(gaps) * 1e3,
        "joiner_ttft_s": ttft,
    }


def join_part(args) -> dict[str, Any]:
    import agentspec

    pair = agentspec.load_pair(dtype=args.dtype)
    n_new = args.max_new_tokens or 64
    prompts = [question_ids(pair, q) for q in workloads.QUESTIONS[: args.calls or 4]]
    joiner = long_prompt(pair, args.prompt_tokens)
    alone = [agentspec.generate(pair, p, None, False, max_new_tokens=n_new).token_ids for p in prompts]
    runs = {}
    for chunk in [int(c) for c in args.chunks.split(",")]:
        pair.scheduler.prefill_chunk = chunk or pair.max_context
        run = one_join(pair, prompts, joiner, n_new, args.warm)
        run["identical_to_alone"] = run.pop("outputs") == alone
        run["p90_over_median"] = run["p90_ms"] / run["median_ms"]
        runs[str(chunk)] = run
        shown = {
            k: round(v, 3) if isinstance(v, float) else v for k, v in run.items() if k != "joiner_output"
        }
        print(f"chunk {chunk}: {shown}", flush=True)
    return {
        "benchmark": "a long prompt joining decoding calls, per prefill chunk size",
        "environment": harness.environment(pair),
        "calls": len(prompts),
        "prompt_tokens": len(joiner),
        "max_new_tokens": n_new,
        "runs": runs,
    }


# --- ChatSpecDecode.batch() against one call after another -----------------------------------------


def timed_replies(how: str, prompts: list[str], dtype: str, n_new: int) -> tuple[float, list[str], dict]:
    """(seconds, replies, the scheduler's passes and calls per pass) on a fresh pair."""
    import agentspec
    from langchain_agentspec import ChatSpecDecode

    llm = ChatSpecDecode(pair=agentspec.load_pair(dtype=dtype), max_tokens=n_new)
    llm.invoke("Hi")  # first-call costs out of the timing
    before = scheduler_work(llm.pair)
    t0 = time.perf_counter()
    if how == "batch":
        replies = [m.content for m in llm.batch(prompts, config={"max_concurrency": len(prompts)})]
    else:
        replies = [llm.invoke(p).content for p in prompts]
    seconds = time.perf_counter() - t0
    work = scheduler_work(llm.pair, before)
    return seconds, replies, {"passes": work["passes"], "calls_per_pass": work["members_per_pass"]}


def batch_part(args) -> dict[str, Any]:
    import agentspec

    prompts, n_new = workloads.QUESTIONS[: args.prompts], args.max_new_tokens or 48
    rows: list[dict] = []
    for r in range(args.rounds):
        got = {
            how: timed_replies(how, prompts, args.dtype, n_new)
            for how in harness.rotated(["batch", "sequential"], r)
        }
        row: dict[str, Any] = {how: {"seconds": got[how][0], **got[how][2]} for how in got}
        row["replies_identical"] = got["batch"][1] == got["sequential"][1]
        row["sequential_over_batch"] = got["sequential"][0] / got["batch"][0]
        rows.append(row)
        print(row, flush=True)
    return {
        "benchmark": "ChatSpecDecode.batch() against the same prompts one after another, fresh pairs",
        "environment": harness.environment(agentspec.load_pair(dtype=args.dtype)),
        "prompts": prompts,
        "max_tokens": n_new,
        "rounds": rows,
        "median_sequential_over_batch": statistics.median(r["sequential_over_batch"] for r in rows),
        "all_replies_identical": all(r["replies_identical"] for r in rows),
    }


# --- calls starting together with one system prompt -------------------------------------------------

SHARED_MODES = {  # mode: (the calls at once, the scheduler's share_prompts)
    "shared": (True, True),
    "unshared": (True, False),
    "one_after_another": (False, True),
}


def one_system_prompt(mode: str, k: int, dtype: str, n_new: int, draft_model: str | None) -> dict[str, Any]:
    """k agent calls with ``INVENTORY_1``'s system prompt (its tools included) and a question each,
    at once or one after another, on a fresh pair (``draft_model``: drafting with that model): wall
    time, each call's prompt and cached tokens (restored or copied from a call beside it), the rows the
    scheduler copied (``scheduler.draft_shared``: a draft model's), the replies."""
    import agentspec
    from langchain_agentspec import ChatSpecDecode

    together, share = SHARED_MODES[mode]
    pair = agentspec.load_pair(draft_model=draft_model, dtype=dtype)
    pair.scheduler.share_prompts = share
    llm = ChatSpecDecode(pair=pair, max_tokens=n_new)
    harness.in_process(llm, [{"role": "user", "content": "Hi"}])  # first-call costs out of the timing
    system = {"role": "system", "content": workloads.INVENTORY_1.system}
    histories = [[system, {"role": "user", "content": q}] for q in workloads.QUESTIONS[:k]]
    before, shared0 = scheduler_work(pair), pair.scheduler.stats.shared
    start = time.perf_counter()
    with ThreadPoolExecutor(k if together else 1) as pool:
        turns = list(pool.map(lambda m: harness.in_process(llm, m), histories))
    wall = time.perf_counter() - start
    prompts = [agentspec_prompt(pair, m) for m in histories]
    assert [len(p) for p in prompts] == [t["prompt_tokens"] for t in turns], "the chat model's prompts differ"
    return {
        "wall_s": round(wall, 3),
        "median_call_s": round(statistics.median(t["seconds"] for t in turns), 3),
        "common_prefix_tokens": common_prefix(prompts),
        "shared_rows": pair.scheduler.stats.shared - shared0,
        "scheduler": scheduler_work(pair, before),
        "turns": turns,
    }


def agentspec_prompt(pair, messages: list[dict]) -> list[int]:
    from agentspec.bench.conversation import prompt_ids

    return prompt_ids(pair.tokenizer, messages)


def common_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares."""
    n = min(len(p) for p in prompts)
    return next((i for i in range(n) if len({p[i] for p in prompts}) > 1), n)


def prefix_rows_computed(run: dict[str, Any]) -> int:
    """The rows of the calls' common prefix the target computed over the run: each call computes
    the part of it past its cached tokens (restored or copied come first in a prompt)."""
    common = run["common_prefix_tokens"]
    return sum(max(0, common - t["cached_tokens"]) for t in run["turns"])


def shared_prompt_part(args) -> dict[str, Any]:
    import agentspec

    k, n_new = args.calls or 8, args.max_new_tokens or 32
    rounds: list[dict] = []
    for r in range(args.rounds):
        row = {
            mode: one_system_prompt(mode, k, args.dtype, n_new, args.draft_model)
            for mode in harness.rotated(list(SHARED_MODES), r)
        }
        solo = [t["text"] for t in row["one_after_another"]["turns"]]
        for mode, run in row.items():
            run["prefix_rows_computed"] = prefix_rows_computed(run)
            run["replies_as_one_after_another"] = [t["text"] for t in run["turns"]] == solo
            print(mode, {f: v for f, v in run.items() if f != "turns"}, flush=True)
        row["unshared_over_shared_wall"] = row["unshared"]["wall_s"] / row["shared"]["wall_s"]
        rounds.append(row)
    return {
        "benchmark": f"{k} agent calls starting together with one system prompt: its rows computed once",
        "environment": harness.environment(
            agentspec.load_pair(draft_model=args.draft_model, dtype=args.dtype)
        ),
        "max_tokens": n_new,
        "rounds": rounds,
        "median_unshared_over_shared_wall": statistics.median(r["unshared_over_shared_wall"] for r in rounds),
        "all_replies_identical": all(
            run["replies_as_one_after_another"] for r in rounds for run in r.values() if isinstance(run, dict)
        ),
    }


PARTS = {
    "sessions": sessions_part,
    "fleet": sessions_part,
    "join": join_part,
    "batch": batch_part,
    "shared_prompt": shared_prompt_part,
}


def main(argv: list[str] | None = None) -> int:
    # the in-process pair gets what a serve worker gets: a thread per CPU
    ap = harness.parser("concurrency", __doc__, threads=len(os.sched_getaffinity(0)), dtype=True)
    ap.add_argument("--part", choices=PARTS, default="sessions")
    ap.add_argument("--max-new-tokens", type=int, help="per reply (default: 64 for join, else 48)")
    sessions = ap.add_argument_group("sessions and fleet")
    sessions.add_argument("--systems", help=f"comma-separated, of {', '.join(SYSTEMS)} (default: the part's)")
    sessions.add_argument("--k", help="comma-separated session counts (default: 1,2,4,8,16; fleet 1,2,4,8)")
    sessions.add_argument("--traces", help="comma-separated trace names (default: all)")
    join = ap.add_argument_group("join")
    join.add_argument("--chunks", default="0,256,64,32", help="prefill chunk sizes (0: no chunking)")
    join.add_argument("--prompt-tokens", type=int, default=4000)
    join.add_argument("--calls", type=int, help="calls at once (default: 4; shared_prompt 8)")
    join.add_argument("--warm", type=int, default=8, help="tokens each call has when the long prompt joins")
    batch = ap.add_argument_group("batch")
    batch.add_argument("--prompts", type=int, default=8)
    batch.add_argument("--rounds", type=int, default=2, help="(shared_prompt too)")
    shared = ap.add_argument_group("shared_prompt")
    shared.add_argument("--draft-model", help="a draft model to draft with (default: the embedded pair's)")
    args = ap.parse_args(argv)
    harness.set_threads(args.threads)
    harness.write(args.out, PARTS[args.part](args), part=args.part)
    return 0
