"""Prefix cache on vs off on a multi-turn agent conversation, in one run.

    python -m benchmarks.bench_prefix_cache [--conversation tools|text] [--max-tokens 48] \
        [--repeats 3] [--threads N] [--dtype auto|float32|bfloat16] \
        [--out benchmarks/results/prefix_cache.json]

Replays the scripted conversation of ``agentspec/bench/conversation.py`` (8 calls over an inventory
agent's system prompt) with the embedded pair. ``tools`` (the default) binds the tools as an agent
framework does: each request goes through ``agentspec.chat`` with ``OPENAI_TOOLS``, a reply before
a tool result must be a call (and is parsed into one), and the reply's grammar constrains decoding;
``text`` writes the tool schemas into the system prompt instead. Each call runs twice, interleaved
so machine drift hits both alike: with the pair's prefix cache, and with ``prefix_cache=False``
(same loop, no reuse), ``--repeats`` times each way (the fastest counts: a shared machine's
noise only ever adds time). The cached run's replies continue the conversation, and every run must
produce the same tokens.

Time to first token (``ttft_s``) is the wall time from the call (the grammar's matcher built, the
prefix restored) to its first step; ``ttft_loop_s`` the loop's own, from after the restore. What
the cached share of the prompt allows: with a share s restored, prefilling the rest at the
uncached call's rate takes ``ttft_off * (1 - s)``, a speed-up of ``1 / (1 - s)`` (``allowed``);
``ratio`` is the speed-up reached over that (1.0: the cached call costs only its uncached tokens).
Over calls 2..n, ``ratio`` is ``sum(ttft_off * (1 - s)) / sum(ttft_on)``; a pass costs at least
what one fed one token costs (the weights are read whatever the rows), so the summary also gives
the ratio with that floor (``one_token_pass_s``, the call's fastest such pass) added to each
allowed time. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import agentspec
from agentspec.bench import conversation as convo
from agentspec.bench.run import add_dtype_argument
from agentspec.chat.request import prepare
from agentspec.chat.tool_calls import parse_reply
from agentspec.config import GenerationConfig
from agentspec.kv import ModelState
from benchmarks.plots import finish


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Conversation:
    """Call n's prompt ids, grammar and config, and the reply that continues the conversation."""

    def __init__(self, pair, kind: str, max_tokens: int):
        self.pair, self.kind, self.replies = pair, kind, []
        self.base = GenerationConfig(max_new_tokens=max_tokens)

    def request(self, n: int):
        tok = self.pair.tokenizer
        if self.kind == "text":
            texts = [r["content"] for r in self.replies]
            return convo.prompt_ids(tok, convo.messages_for_call(n, texts)), None, self.base
        msgs = convo.bound_messages_for_call(n, self.replies)
        req = prepare(tok, msgs, convo.OPENAI_TOOLS, convo.tool_choice_for_call(n))
        return req.prompt.ids, req, req.fitted(self.pair, self.base)

    def answer(self, text: str, req) -> None:
        if req is None:
            self.replies.append({"role": "assistant", "content": text})
            return
        reply = parse_reply(req.prompt.forced + text, req.tool_names)
        msg = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
        self.replies.append(msg | {"invalid_tool_calls": reply.invalid_tool_calls})


def timed_call(pair, ids, req, config, drafter: str, cache: bool, namespace: str) -> dict:
    """One call through ``agentspec.stream``; TTFT from the call to its first step."""
    t0 = time.perf_counter()
    grammar = req.constraint(pair) if req is not None else None
    steps = []
    run = agentspec.stream(pair, ids, drafter, cache, grammar, namespace, config=config)
    for step in run:
        steps.append((time.perf_counter() - t0, step))
    ttft, first = steps[0]
    stats = first.stats
    return {
        "ttft_s": ttft,
        "ttft_loop_s": stats.time_to_first_token_s,
        "first_pass_fed": first.fed,  # the uncached prompt tokens, and the draft verified with them
        "first_pass_drafted": first.drafted,
        # the fastest pass fed one token: what any pass costs however few its rows (the weights' read)
        "one_token_pass_s": min((st.seconds for _, st in steps if st.fed == 1), default=None),
        "total_s": time.perf_counter() - t0,
        "output_tokens": stats.output_tokens,
        "restored_tokens": stats.cached_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "token_ids": [t for _, step in steps for t in step.tokens],
    }


def best_of(pair, ids, req, config, drafter: str, repeats: int) -> tuple[dict, dict]:
    """The fastest of ``repeats`` runs each way, interleaved, and whether all gave the same tokens.

    Repeat r runs in namespace r, where the conversation's earlier calls saved the same states (and
    the drafters' memory the same outputs), so every repeat restores the same prefix.
    """
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(repeats):
        for cache in (True, False):
            runs[cache].append(timed_call(pair, ids, req, config, drafter, cache, f"repeat-{r}"))
    same = all(x["token_ids"] == runs[True][0]["token_ids"] for x in runs[True] + runs[False])
    on, off = (min(runs[c], key=lambda x: x["ttft_s"]) for c in (True, False))
    on["same_in_every_run"] = same
    return on, off


def cached_share_row(n: int, ids: list[int], on: dict, off: dict) -> dict:
    share = on["restored_tokens"] / len(ids)
    speedup = off["ttft_s"] / on["ttft_s"]
    allowed = 1 / (1 - share)
    row = {"call": n, "prompt_tokens": len(ids), "cached_share": share, "cache_on": on, "cache_off": off}
    row.update(ttft_speedup=speedup, ttft_allowed=allowed, ttft_ratio=speedup / allowed)
    row["identical"] = on.pop("token_ids") == off.pop("token_ids") and on.pop("same_in_every_run")
    return row


def restore_memory(pair, ids: list[int]) -> dict:
    """Peak bytes allocated (torch's CPU allocations, by the profiler) while restoring ``ids`` (as the
    first repeat saved them) and running the first pass over the rest, and the restored KV's bytes."""
    cache = pair.prefix_cache
    state: list[ModelState] = []

    def restore():
        state.append(cache.restore(pair, ids, {"target": pair.target}, namespace="repeat-0")["target"])

    def first_pass():
        state[0].forward(ids[len(state[0].ids) :], keep=1)

    out = {"restored_tokens": 0}
    for name, fn in (("restore", restore), ("first_pass", first_pass)):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        live = peak = 0
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            live += e.self_cpu_memory_usage
            peak = max(peak, live)
        out[f"{name}_peak_bytes"] = peak
        if name == "restore":
            out["restored_tokens"] = len(state[0].ids)
            out["prefix_kv_bytes"] = sum(
                la.keys.numel() * la.keys.element_size() * 2 for la in state[0].cache.layers
            )
    return out


def run(max_tokens: int, drafter: str, kind: str, repeats: int, dtype: str = "auto") -> dict:
    pair = agentspec.load_pair(draft_model=False, dtype=dtype)  # as in the committed results: no draft model
    tok = pair.tokenizer
    agentspec.generate(
        pair, convo.prompt_ids(tok, [{"role": "user", "content": "hi"}]), max_new_tokens=2, prefix_cache=False
    )  # warm-up
    conv = Conversation(pair, kind, max_tokens)
    calls = []
    for n in range(len(convo.TURNS)):
        ids, req, config = conv.request(n)
        on, off = best_of(pair, ids, req, config, drafter, repeats)
        text = pair.tokenizer.decode(on["token_ids"], skip_special_tokens=True)
        row = cached_share_row(n, ids, on, off)
        conv.answer(text, req)
        calls.append(row)
        print(
            f"call {n}: {len(ids)} prompt tokens, restored {on['restored_tokens']} "
            f"({row['cached_share']:.3f}), "
            f"TTFT {on['ttft_s']:.3f}s vs {off['ttft_s']:.3f}s ({row['ttft_speedup']:.2f}x of "
            f"{row['ttft_allowed']:.2f}x allowed: {row['ttft_ratio']:.2f}), identical={row['identical']}",
            flush=True,
        )
    later = calls[1:]
    on_total = sum(c["cache_on"]["total_s"] for c in calls)
    off_total = sum(c["cache_off"]["total_s"] for c in calls)
    allowed_s = sum(c["cache_off"]["ttft_s"] * (1 - c["cached_share"]) for c in later)
    floor_s = sum(c["cache_on"]["one_token_pass_s"] or 0.0 for c in later)
    on_s = sum(c["cache_on"]["ttft_s"] for c in later)
    return {
        "benchmark": "prefix_cache",
        "conversation": kind,
        "drafter": drafter,
        "max_new_tokens": max_tokens,
        "repeats": repeats,  # each call's times: the fastest of this many runs each way
        "first_prompt_tokens": calls[0]["prompt_tokens"],  # the system prompt and tools, one user turn
        "calls": calls,
        "restore_memory": restore_memory(pair, ids),
        "summary": {
            "total_s_cache_on": on_total,
            "total_s_cache_off": off_total,
            "total_ratio": off_total / on_total,
            "ttft_ratio_calls_2_to_n_mean": sum(c["ttft_speedup"] for c in later) / len(later),
            "ttft_ratio_calls_2_to_n_min": min(c["ttft_speedup"] for c in later),
            "ttft_share_ratio_calls_2_to_n": allowed_s / on_s,
            # the same with one one-token pass added to each allowed time: a floor no cache removes
            "ttft_share_ratio_with_pass_floor": (allowed_s + floor_s) / on_s,
            "all_identical": all(c["identical"] for c in calls),
            "cache_bytes_after": pair.prefix_cache.bytes_used,
            "peak_rss_mb": peak_rss_mb(),
        },
        "environment": {
            "cpu": platform.processor() or platform.machine(),
            "dtype": str(pair.dtype),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    calls = result["calls"]
    x = [c["call"] + 1 for c in calls]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [c["cache_off"]["ttft_s"] for c in calls], "o-", label="prefix_cache=False")
    allowed = [c["cache_off"]["ttft_s"] * (1 - c["cached_share"]) for c in calls]
    ax.plot(x, allowed, "k:", label="uncached share at the uncached rate")
    ax.plot(x, [c["cache_on"]["ttft_s"] for c in calls], "o-", label="prefix cache on")
    title = "Time to first token across an agent conversation (SmolLM2-135M, CPU)"
    finish(fig, ax, path, xlabel="agent call", ylabel="time to first token (s)", title=title, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--conversation", choices=["tools", "text"], default="tools")
    ap.add_argument("--repeats", type=int, default=3, help="runs per call and mode (the fastest counts)")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_dtype_argument(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.max_tokens, args.drafter, args.conversation, args.repeats, args.dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
