"""The device check's phases after the product's own (``gpu_check``: batch 1 and batch 8 end to end):
identity, host reads per drafter, the roofline, where a pass's time goes, the prefix cache, assisted
generation, and last the compiled ones (a first compile takes a minute on a GPU)."""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch

import agentspec
from agentspec.bench import passes, roofline
from agentspec.bench.divergence import first_diff, logit_margin
from agentspec.bench.replay import expected_tokens_per_pass
from agentspec.bench.syncs import HostSyncs
from agentspec.bench.systems import StaticCompiled
from agentspec.cache import PrefixCache
from agentspec.kv import ModelState
from agentspec.numerics import float32_flags
from agentspec.static_kv import StaticState
from benchmarks import harness
from benchmarks.gpu_setup import (
    Plan,
    Report,
    Speed,
    hf_greedy,
    noisy_copy,
    prompts,
    random_model,
    speculate,
    timed,
    word_tokenizer,
)

DRAFTERS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto")
STATIC_DRAFTERS = ("model", "auto")  # also run with the pair's static draft cache (draft_cache="static")
ACCEPTANCES = (0.8, 0.5)  # the replay drafter's, per draft position
VERIFY_SIZES = (1, 2, 3, 4, 5, 8, 16)
PROFILE_ROWS = [1, 5, 17]  # new rows of the profiled and compiled target passes
PROFILE_PASSES = 3  # passes under the profiler per row count
COMPILE_GUESS_S = 60.0  # what a first compile on a GPU machine is assumed to take, before one is timed


def identity_pairs(plan: Plan):
    """(dtype, pair) for float32 then bfloat16, the same weights (the draft a noisy copy); the
    float32 pair stays alive while the bfloat16 one runs (its target gives the margins)."""
    width = plan.draft["vocab_size"]
    tok = word_tokenizer(width)
    base = random_model(plan.identity, torch.float32, plan.device, seed=0, width=width, logit_std=8.0)
    draft = noisy_copy(base, width, noise=0.1, seed=1)
    assert draft.config.vocab_size == width, f"{draft.config.vocab_size=} {width=}"
    yield torch.float32, agentspec.load_pair(base, draft, tokenizer=tok)
    low = [copy.deepcopy(m).to(torch.bfloat16) for m in (base, draft)]
    yield torch.bfloat16, agentspec.load_pair(low[0], low[1], tokenizer=tok)


def identity_row(pair, calls, name: str, cached: bool, n: int, reference_model) -> dict[str, Any]:
    """One drafter's calls against ``generate()``'s; each divergence with ``reference_model``'s
    (the float32 target's) logit margin at that position."""
    cache = PrefixCache(1 << 30) if cached else False
    row: dict[str, Any] = {"identical": True, "divergences": [], "drafted": 0, "accepted": 0, "restored": 0}
    for ids, ref in calls:
        out, steps = speculate(pair, ids, name, n, cache)
        row["drafted"] += sum(s.drafted for s in steps)
        row["accepted"] += sum(s.accepted for s in steps)
        row["restored"] += steps[0].restored
        i = first_diff(out, ref)
        if i is not None:
            row["identical"] = False
            d = {"position": i, "prompt_tokens": len(ids)}
            if i < len(ref):  # how near a tie it was, in float32
                d["float32_margin"] = logit_margin(reference_model, ids + ref[:i])
            row["divergences"].append(d)
    return row


def phase_identity(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference_model = None
    for dtype, pair in identity_pairs(plan):
        reference_model = reference_model or pair.target  # the float32 one, first
        # two calls, the second extending the first and its output (so a cached call restores a prefix)
        first, more = prompts(plan.draft["vocab_size"], 2, seed=2)
        ref = hf_greedy(pair.target, first, plan.new_tokens)
        second = first + ref + more
        calls = [(first, ref), (second, hf_greedy(pair.target, second, plan.new_tokens))]
        static = dataclasses.replace(pair, draft_cache="static")  # the draft in one preallocated state
        rows = {}
        for label, on, names in (("", pair, DRAFTERS), (" static draft", static, STATIC_DRAFTERS)):
            for name in names:
                for cached in (False, True):
                    key = f"{name}{label} {'cached' if cached else 'uncached'}"
                    rows[key] = identity_row(on, calls, name, cached, plan.new_tokens, reference_model)
        identical = all(r["identical"] for r in rows.values())
        # as they stood while the rows ran: a float32 pair's load pins full-precision products
        name = str(dtype).removeprefix("torch.")
        out[name] = {"identical": identical, "rows": rows, "float32_flags": float32_flags()}
    out["identical_float32"] = out["float32"]["identical"]
    return out


def phase_syncs(plan: Plan) -> dict[str, Any]:
    _, pair = next(identity_pairs(plan))
    ids = prompts(plan.draft["vocab_size"], 1, seed=3)[0]
    rows = {}
    for name in ("model", "prompt_lookup", "suffix", "model_scheduled", "auto", "none"):
        speculate(pair, ids, name, 4)  # warm-up
        with HostSyncs(pair) as syncs:
            _, steps = speculate(pair, ids, name, 2 * plan.new_tokens)
        n = sum(s.target_pass for s in steps)
        rows[name] = {"passes": n, "count": syncs.count, "cuda": syncs.cuda, "per_pass": syncs.count / n,
                      "cuda_per_pass": syncs.cuda / n, "where": dict(syncs.where.most_common(8))}  # fmt: skip
    return {"rows": rows, "cuda_counted": plan.device.type == "cuda"}


def step_ms(forward, prefix: list[int], new: list[int], sizes, repeats: int) -> dict[int, float]:
    """Median ms of one eager pass over k new tokens after ``prefix``, per k (rounds rotate the k;
    round 0 warms up and is dropped); the cache rolls back after each pass."""
    state = ModelState(forward)
    state.forward(prefix, keep=1)
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for r in range(repeats + 1):
        for k in harness.rotated(sizes, r):
            _, s = timed(lambda k=k: state.forward(new[:k], keep=k), state.model.device)  # a row per token
            if r:
                times[k].append(s)
            state.truncate(len(prefix))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def phase_roofline(speed: Speed) -> dict[str, Any]:
    """A verify pass's time against its floor, the target's weight bytes over the read bandwidth the
    device shows here: the 7B-shaped target's eager pass (the pair's own forward) over 1..16 new rows
    after the prompt, and the 0.5B-shaped draft's step; the verify-cost curve T(n)/T(1) and the
    speed-up the cost model projects from it, E(a, k) / (V(k + 1) + k c)."""
    pair, p = speed.pair, speed.plan
    bandwidth = roofline.read_bandwidth(p.device, mib=1024 if p.device.type == "cuda" else 128)
    per_ms = bandwidth["best_gb_s"] * 1e6  # bytes a millisecond, at the best read seen
    new = speed.ids[: max(VERIFY_SIZES)]
    target = step_ms(pair.target_forward, speed.ids, new, list(VERIFY_SIZES), p.repeats)
    draft = step_ms(pair.draft_forward, speed.ids, new, [1], p.repeats)[1]
    target_floor = roofline.bytes_per_step(pair.target) / per_ms
    draft_floor = roofline.bytes_per_step(pair.draft) / per_ms
    c = draft / target[1]
    curve = {k: v / target[1] for k, v in target.items()}
    projected = {str(a): expected_tokens_per_pass(a, p.k) / (curve[p.k + 1] + p.k * c) for a in ACCEPTANCES}
    return {
        "bandwidth": bandwidth,
        "target_weight_bytes": roofline.bytes_per_step(pair.target),
        "draft_weight_bytes": roofline.bytes_per_step(pair.draft),
        "target_floor_ms": target_floor,
        "draft_floor_ms": draft_floor,
        "target_ms": target,
        "target_over_floor": {k: v / target_floor for k, v in target.items()},
        "verify_pass_over_floor": target[p.k + 1] / target_floor,
        "draft_step_ms": draft,
        "draft_over_floor": draft / draft_floor,
        "verify_cost_curve": curve,
        "draft_over_target": c,
        "cache_tokens": len(speed.ids),
        "k": p.k,
        "projected_speedup_eager": projected,
    }


def phase_profile(speed: Speed) -> dict[str, Any]:
    """Each kind of pass under ``torch.profiler``: where its time goes by op category, the kernels it
    launches and the attention kernel SDPA took (``agentspec.bench.passes.profile_passes``): the
    target's prefill of the prompt, its one-row step, a verify pass of k + 1 rows and one of 17, and
    the draft's step; the rows after the prompt's length of random cached tokens."""
    pair, p = speed.pair, speed.plan
    n = p.prompt_tokens
    target, draft, count = pair.target_forward, pair.draft_forward, PROFILE_PASSES
    kinds = {"prefill": (target, 0, n, 1), "decode_1": (target, n, 1, count),
             f"verify_{p.k + 1}": (target, n, p.k + 1, count), "verify_17": (target, n, 17, count),
             "draft_step": (draft, n, 1, count)}  # fmt: skip
    out = {name: passes.profile_passes(*args) for name, args in kinds.items()}
    return {"cache_tokens": n, "dtype": str(p.speed_dtype).removeprefix("torch."), "kinds": out}


def eager_logits(forward, prefix: list[int], new: list[int], sizes) -> dict[int, torch.Tensor]:
    """The logits [k, V] of the eager pass over each ``k`` new rows after ``prefix`` (prefilled once)."""
    state = ModelState(forward)
    state.forward(prefix, keep=1)
    out = {}
    for k in sizes:
        out[k] = state.forward(new[:k], keep=k)
        state.truncate(len(prefix))
    return out


def compiled_verify_ms(pair, prefix: list[int], new: list[int], want: torch.Tensor, repeats: int) -> dict:
    """The target's pass over ``k = len(want)`` new rows after ``prefix``, compiled over
    ``StaticState(width=k)`` (CUDA graphs on CUDA): compile seconds, median ms, and its logits' largest
    difference from ``want``, the eager pass's; each pass rolls back by moving the state's length."""
    k = len(want)
    state = StaticState(pair.target, capacity=len(prefix) + k, compiled=True, width=k)
    with torch.inference_mode():
        state.forward(prefix, keep=1)  # longer than the width: eager

        def once() -> tuple[torch.Tensor, float]:
            torch.compiler.cudagraph_mark_step_begin()
            logits, s = timed(lambda: state.forward(new[:k], keep=k).clone(), pair.device)
            state.truncate(len(prefix))
            return logits, s

        got, compile_s = once()
        once(), once()  # CUDA graphs record on the calls after the compiling one
        times = [once()[1] for _ in range(repeats)]
    diff = (got.float() - want.float()).abs().max().item()
    return {"compile_s": compile_s, "median_ms": statistics.median(times) * 1e3, "max_logit_diff": diff}


def phase_compiled_verify(speed: Speed, report: Report) -> dict[str, Any]:
    """The target's verify pass at each PROFILE_ROWS size, eager (the pair's lean forward) and
    compiled over our static state, while the budget leaves time for one more compile."""
    pair, p = speed.pair, speed.plan
    new = speed.ids[: max(PROFILE_ROWS)]
    eager = step_ms(pair.target_forward, speed.ids, new, PROFILE_ROWS, p.repeats)
    want = eager_logits(pair.target_forward, speed.ids, new, PROFILE_ROWS)
    out: dict[str, Any] = {"eager_ms": {str(k): v for k, v in eager.items()}, "compiled": {}, "skipped": []}
    need = COMPILE_GUESS_S if p.device.type == "cuda" else 0.0
    for k in PROFILE_ROWS:
        if report.left() <= need:
            out["skipped"].append(k)
            continue
        row = compiled_verify_ms(pair, speed.ids, new, want[k], p.repeats)
        row["eager_over_compiled"] = eager[k] / row["median_ms"]
        out["compiled"][str(k)] = row
        need = row["compile_s"]
    return out


def phase_assisted(speed: Speed) -> dict[str, Any]:
    """transformers assisted generation with the 0.5B-shaped draft, k tokens per pass, timed per pass.
    It cannot take the replay drafter (``generate()`` builds its own candidate generator; the public
    ``custom_generate`` replaces the whole loop, ours then), so its random draft gets about no
    acceptance and the rows compare costs per pass: at acceptance a a pass adds E(a, k) tokens. The
    pair's logits widths differ: universal assisted decoding, as a user of this pair runs it."""
    from transformers import StoppingCriteriaList

    pair, p = speed.pair, speed.plan
    pair.draft.generation_config.update(
        num_assistant_tokens=p.k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0
    )
    assisted = dict(assistant_model=pair.draft, tokenizer=pair.tokenizer, assistant_tokenizer=pair.tokenizer)
    hf_greedy(pair.target, speed.ids[:16], 4, **assisted)  # warm-up
    calls = []

    def count(input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        calls.append(1)  # a stopping criterion that stops nothing: generate() calls it once per pass
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    stop = StoppingCriteriaList([count])
    tokens, s = timed(
        lambda: hf_greedy(pair.target, speed.ids, p.e2e_tokens, stopping_criteria=stop, **assisted), p.device
    )
    n = len(calls)
    row = {"seconds": s, "passes": n, "per_pass_ms": s / n * 1e3, "tokens_per_pass": len(tokens) / n,
           "identical": tokens == speed.ref, "takes_replay_drafter": False}  # fmt: skip
    at_equal = {}  # what it would do at the replay rows' acceptance: E(a, k) tokens a pass
    for a in ACCEPTANCES:
        replay = speed.rows.get(f"agentspec replay {a}")
        if replay:
            projected = expected_tokens_per_pass(a, p.k) / (row["per_pass_ms"] / 1e3)
            at_equal[str(a)] = {
                "agentspec_per_pass_ms": replay["per_pass_ms"],
                "assisted_tokens_per_s_projected": projected,
                "speedup_vs_assisted_projected": replay["tokens_per_s"] / projected,
            }
    return {"row": row, "vs_assisted_at_equal_acceptance": at_equal, "k": p.k}


# ---- prefix cache, batched calls ---------------------------------------------------------------
def peak(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """``fn()`` and the most device memory allocated above what was allocated before (CUDA only)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - before


def phase_prefix_cache(speed: Speed) -> dict[str, Any]:
    pair, p = speed.pair, speed.plan
    ids = (speed.ids * 4)[: 4 * p.prompt_tokens]
    cache = PrefixCache(1 << 36)

    def first_step(prompt: list[int]):
        calls = agentspec.stream(pair, prompt, None, prefix_cache=cache, max_new_tokens=2, speculative=False)
        step = next(calls)
        calls.close()  # a closed stream saves what it verified: the prompt's KV goes into the cache
        return step

    def restore():
        return cache.restore(pair, ids, {"target": pair.target})

    cold, cold_peak = peak(p.device, lambda: first_step(ids))
    restores = [timed(restore, p.device)[1] * 1e3 for _ in range(p.repeats)]
    states, restore_peak = peak(p.device, restore)
    restored = states["target"]
    warm, warm_peak = peak(p.device, lambda: first_step(ids + speed.ids[:8]))
    kv = sum(
        t.numel() * t.element_size() for layer in restored.cache.layers for t in (layer.keys, layer.values)
    )
    return {
        "prompt_tokens": len(ids),
        "restored_tokens": len(restored.ids),
        "restore_ms_median": statistics.median(restores),
        "restore_ms_min": min(restores),
        "ttft_cold_ms": cold.seconds * 1e3,
        "ttft_cached_ms": warm.seconds * 1e3,
        "cached_restored": warm.restored,
        "kv_bytes_restored": kv,
        "cache_bytes_used": cache.bytes_used,
        "peak_bytes": {"cold_call": cold_peak, "restore": restore_peak, "cached_call": warm_peak},
        "peak_measured": "torch.cuda.max_memory_allocated above the allocation before"
        if p.device.type == "cuda"
        else "not on this device: KV tensor bytes instead",
    }


# ---- compiled baselines --------------------------------------------------------------------------
def compiled_step_ms(model, prefix: list[int], new: list[int], k: int, repeats: int) -> dict[str, float]:
    """transformers' StaticCache with the model's forward under ``torch.compile(mode="reduce-overhead")``
    (CUDA graphs on CUDA): compile seconds and median ms of a pass over k new tokens after
    ``prefix``; each pass rolls back by moving the cache's length (``crop``), not by copying."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=len(prefix) + max(VERIFY_SIZES))
    x = torch.tensor([new[:k]], device=model.device)
    step = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)  # one graph per part
    with torch.inference_mode():
        prefill = torch.tensor([prefix], device=model.device)
        model(input_ids=prefill, cache=cache, use_cache=True, logits_to_keep=1)

        def once() -> float:
            torch.compiler.cudagraph_mark_step_begin()
            _, s = timed(
                lambda: step(input_ids=x, cache=cache, use_cache=True, logits_to_keep=k), model.device
            )
            cache.crop(-k)
            return s

        compile_s = once()
        once(), once()  # CUDA graphs record on the calls after the compiling one
        times = [once() for _ in range(repeats)]
    return {"compile_s": compile_s, "median_ms": statistics.median(times) * 1e3}


def static_generate(speed: Speed) -> dict[str, Any]:
    """Compiled static-cache ``generate()`` (``agentspec.bench.systems.StaticCompiled``), timed after
    a compiling call, and agentspec's replay rows against it."""
    pair, p = speed.pair, speed.plan
    compiled = StaticCompiled(p.device, len(speed.ids) + p.e2e_tokens)

    def run(n: int) -> list[int]:
        return hf_greedy(pair.target, speed.ids, n, **compiled.options(pair.target, len(speed.ids), n))

    _, compile_s = timed(lambda: run(4), p.device)
    tokens, s = timed(lambda: run(p.e2e_tokens), p.device)
    row = {"compile_s": compile_s, "seconds": s, "tokens_per_s": len(tokens) / s,
           "identical": tokens == speed.ref}  # fmt: skip
    for a in ACCEPTANCES:
        replay = speed.rows.get(f"agentspec replay {a}")
        if replay:
            row[f"replay_{a}_speedup"] = s / replay["seconds"]
    return row


def phase_compiled(speed: Speed, report: Report) -> dict[str, Any]:
    """Each part runs while the budget leaves time for one more compile (as long as the last one
    took): compiled static-cache ``generate()`` end to end first (the goals' baseline), then the
    draft's one-token step and the target's (k+1)- and 1-token passes."""
    pair, p = speed.pair, speed.plan
    out: dict[str, Any] = {"parts_skipped": []}
    need = COMPILE_GUESS_S if p.device.type == "cuda" else 0.0
    if report.left() > need and speed.ref:
        out["static_generate"] = static_generate(speed)
        need = out["static_generate"]["compile_s"]
    else:
        out["parts_skipped"].append("static_generate")
    new = speed.ids[: max(VERIFY_SIZES)]
    for name, model, k in [("draft_step", pair.draft, 1), (f"target_{p.k + 1}", pair.target, p.k + 1),
                           ("target_1", pair.target, 1)]:  # fmt: skip
        if report.left() <= need:
            out["parts_skipped"].append(name)
            continue
        out[name] = compiled_step_ms(model, speed.ids, new, k, p.repeats)
        need = out[name]["compile_s"]
    if "draft_step" in out and "target_1" in out:
        out["draft_over_target"] = out["draft_step"]["median_ms"] / out["target_1"]["median_ms"]
    if f"target_{p.k + 1}" in out and "target_1" in out:
        out["verify_cost_k_plus_1"] = out[f"target_{p.k + 1}"]["median_ms"] / out["target_1"]["median_ms"]
    return out
