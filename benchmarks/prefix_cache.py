"""The prefix cache on and off across a tool-binding agent conversation: time to first token, in one run.

    python -m benchmarks prefix-cache [--max-tokens 48] [--repeats 3] [--drafter auto] [--threads N] \
        [--dtype auto|float32|bfloat16]

Replays the scripted conversation of ``agentspec/bench/conversation.py`` (8 calls over an inventory
agent's system prompt) on the embedded pair, its tools bound as an agent framework binds them: each
request goes through ``agentspec.chat`` with ``OPENAI_TOOLS``, a reply before a tool result must be a
call (parsed into one), and the reply's grammar constrains decoding. Each call runs with the pair's
prefix cache and with ``prefix_cache=False`` (same loop, no reuse), interleaved so drift hits both alike,
``--repeats`` times each way; the fastest counts (a shared machine's noise only adds time). The cached
run's replies continue the conversation, and every run must produce the same tokens (``identical``).

``ttft_s`` is the wall time from the call (the grammar's matcher built, the prefix restored) to its first
step; ``ttft_loop_s`` the loop's own, from after the restore. With a share s of the prompt restored,
prefilling the rest at the uncached call's rate takes ``ttft_off * (1 - s)``, a speed-up of ``1 / (1 -
s)`` (``ttft_allowed``); ``ttft_ratio`` is the speed-up reached over that (1.0: the cached call costs
only its uncached tokens). Over calls 2..n: ``sum(ttft_off * (1 - s)) / sum(ttft_on)``; a pass costs at
least a one-token pass (the weights are read whatever the rows), so the summary also gives the ratio
with that floor (``one_token_pass_s``) added to each allowed time. ``restore_memory``: the peak bytes
allocated while restoring the last prompt and running its first pass. Writes JSON and a PNG.
"""

from __future__ import annotations

import resource
import time

from torch.profiler import ProfilerActivity, profile

import agentspec
from agentspec.bench import conversation as convo
from agentspec.chat import parse_reply
from agentspec.chat.request import prepare
from agentspec.config import GenerationConfig
from benchmarks import harness


class Conversation:
    """Call n's prompt ids, prepared request and config, and the reply that continues the conversation."""

    def __init__(self, pair, max_tokens: int):
        self.pair, self.replies = pair, []
        self.base = GenerationConfig(max_new_tokens=max_tokens)

    def request(self, n: int):
        msgs = convo.bound_messages_for_call(n, self.replies)
        req = prepare(self.pair.tokenizer, msgs, convo.OPENAI_TOOLS, convo.tool_choice_for_call(n))
        return req.prompt.ids, req, req.fitted(self.pair, self.base)

    def answer(self, text: str, req) -> None:
        reply = parse_reply(req.prompt.forced + text, req.tool_names)
        msg = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
        self.replies.append(msg | {"invalid_tool_calls": reply.invalid_tool_calls})


def timed_call(pair, ids, req, config, drafter: str, cache: bool, namespace: str) -> dict:
    """One call through ``agentspec.stream``; TTFT from the call to its first step."""
    t0 = time.perf_counter()
    steps = []
    for step in agentspec.stream(pair, ids, drafter, cache, req.constraint(pair), namespace, config=config):
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


def call_row(pair, n: int, ids, req, config, drafter: str, repeats: int) -> dict:
    """Call n, the fastest of ``repeats`` runs each way, interleaved; identical if every run gave the
    same tokens. Repeat r runs in namespace r, where the conversation's earlier calls saved the same
    states (and the drafters' memory the same outputs), so every repeat restores the same prefix."""
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(repeats):
        for cache in (True, False):
            runs[cache].append(timed_call(pair, ids, req, config, drafter, cache, f"repeat-{r}"))
    tokens = [x.pop("token_ids") for x in runs[True] + runs[False]]
    on, off = (min(runs[c], key=lambda x: x["ttft_s"]) for c in (True, False))
    share = on["restored_tokens"] / len(ids)
    speedup, allowed = off["ttft_s"] / on["ttft_s"], 1 / (1 - share)
    return {"call": n, "prompt_tokens": len(ids), "cached_share": share, "cache_on": on, "cache_off": off,
            "ttft_speedup": speedup, "ttft_allowed": allowed, "ttft_ratio": speedup / allowed,
            "identical": all(t == tokens[0] for t in tokens), "tokens": tokens[0]}  # fmt: skip


def restore_memory(pair, ids: list[int]) -> dict:
    """Peak bytes allocated (torch's CPU allocations, by the profiler) while restoring ``ids`` (as the
    first repeat saved them) and running the first pass over the rest, and the restored KV's bytes."""
    state = []

    def restore():
        restored = pair.prefix_cache.restore(pair, ids, {"target": pair.target}, namespace="repeat-0")
        state.append(restored["target"])

    def first_pass():
        state[0].forward(ids[len(state[0].ids) :], keep=1)

    out = {}
    for name, fn in (("restore", restore), ("first_pass", first_pass)):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        live = peak = 0
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            live += e.self_cpu_memory_usage
            peak = max(peak, live)
        out[f"{name}_peak_bytes"] = peak
    layers = state[0].cache.layers
    out["restored_tokens"] = len(state[0].ids)
    out["prefix_kv_bytes"] = sum(la.keys.numel() * la.keys.element_size() * 2 for la in layers)
    return out


def run(pair, max_tokens: int, drafter: str, repeats: int) -> dict:
    hi = convo.prompt_ids(pair.tokenizer, [{"role": "user", "content": "hi"}])
    agentspec.generate(pair, hi, max_new_tokens=2, prefix_cache=False)  # warm-up
    conv = Conversation(pair, max_tokens)
    calls = []
    for n in range(len(convo.TURNS)):
        ids, req, config = conv.request(n)
        row = call_row(pair, n, ids, req, config, drafter, repeats)
        conv.answer(pair.tokenizer.decode(row.pop("tokens"), skip_special_tokens=True), req)
        calls.append(row)
        print(
            f"call {n}: {len(ids)} prompt tokens, {row['cached_share']:.3f} restored, TTFT "
            f"{row['ttft_speedup']:.2f}x of {row['ttft_allowed']:.2f}x, identical {row['identical']}"
        )
    later = calls[1:]
    on_total = sum(c["cache_on"]["total_s"] for c in calls)
    off_total = sum(c["cache_off"]["total_s"] for c in calls)
    allowed_s = sum(c["cache_off"]["ttft_s"] * (1 - c["cached_share"]) for c in later)
    floor_s = sum(c["cache_on"]["one_token_pass_s"] or 0.0 for c in later)
    on_s = sum(c["cache_on"]["ttft_s"] for c in later)
    summary = {
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
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }
    return {"calls": calls, "restore_memory": restore_memory(pair, ids), "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("prefix_cache", __doc__, dtype=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="runs per call and mode (the fastest counts)")
    ap.add_argument("--drafter", default="auto")
    args = ap.parse_args(argv)
    harness.set_threads(args.threads)
    pair = agentspec.load_pair(draft_model=False, dtype=args.dtype)  # no draft model: the model-free drafters
    result = {"drafter": args.drafter, "max_new_tokens": args.max_tokens,
              "repeats": args.repeats, **run(pair, args.max_tokens, args.drafter, args.repeats),
              "environment": harness.environment(pair)}  # fmt: skip
    result["first_prompt_tokens"] = result["calls"][0]["prompt_tokens"]  # the system prompt, tools, a turn
    harness.write(args.out, result)
    calls = result["calls"]
    with harness.figure(args.out, size=(7, 4)) as ax:
        x = [c["call"] + 1 for c in calls]
        ax.plot(x, [c["cache_off"]["ttft_s"] for c in calls], "o-", label="prefix_cache=False")
        allowed = [c["cache_off"]["ttft_s"] * (1 - c["cached_share"]) for c in calls]
        ax.plot(x, allowed, "k:", label="uncached share at the uncached rate")
        ax.plot(x, [c["cache_on"]["ttft_s"] for c in calls], "o-", label="prefix cache on")
        ax.set(
            xlabel="agent call", ylabel="time to first token (s)", title="Time to first token, call by call"
        )
        ax.legend()
    return 0 if result["summary"]["all_identical"] else 1
