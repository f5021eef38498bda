"""Core decoding benchmark: plain transformers ``generate`` vs agentspec plain vs agentspec speculative.

Run from the repository root:

    python -m benchmarks.bench_core            # full: 8 prompts x 2 repeats, 128 new tokens (~17 min)
    python -m benchmarks.bench_core --quick    # 4 prompts x 1, 48 new tokens (~3 min)

(Times on 2 CPU cores shared with other jobs, load average 3-4.5; an idle machine is faster.)

It loads the embedded default pair (``load_pair()``: SmolLM2-135M-Instruct, no draft model, so the
speculative drafter is prompt lookup), renders each prompt with the tokenizer's chat template and
decodes it greedily every way, interleaved per prompt (the order rotates from prompt to prompt) so
that machine drift hits every mode alike:

    hf          ``model.generate(do_sample=False, max_new_tokens=N)``, the reference
    plain       ``agentspec.generate(pair, ids, speculative=False)``: our loop with no draft
    spec_k      ``agentspec.generate(pair, ids, num_draft_tokens=k)`` for each k in --draft-lengths

(agentspec's modes call ``agentspec.stream``, which ``generate`` only collects, to time the first
token, with ``prefix_cache=False``: every call prefills its whole prompt, as transformers does, so
only decoding is compared; ``benchmarks/bench_prefix_cache.py`` measures reuse.)

Every output is compared token for token with the reference (both include the EOS that ended
generation). A mismatch is reported, never hidden, with the target's logit margin (top1 - top2,
from one plain forward pass over prompt + common prefix) at the first differing position.

It also measures the verify-cost curve: the time of one target forward pass over 1, 2, 4, 8, 16 new
tokens after a 300-token cache (median of repeats, rolled back with ``ModelState.truncate``), and
T(k)/T(1), the price of verifying k tokens in units of one decode step.

Writes JSON (--out) and a PNG next to it. Speeds are wall-clock tokens/s per call, prefill
included ("e2e"), for the decode phase alone, after the first token ("decode"), and per CPU-second
("cpu", steadier on a shared machine). The exit status is 1 if any output differed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# OpenMP threads that spin while they wait (libgomp's default) turn a busy machine's slowdown from
# its share of the CPUs into several times that: measured here, one decode step with 2 threads took
# 700 ms under a load of 3.5 on 2 cores, 200 ms with passive waiting. It must be set before torch
# loads; export OMP_WAIT_POLICY=ACTIVE to measure with spinning threads. Recorded in the JSON.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import agentspec  # noqa: E402
from agentspec.bench import roofline  # noqa: E402
from agentspec.bench.divergence import first_diff, top_two  # noqa: E402
from agentspec.bench.workloads import PROMPTS, QUICK_PROMPTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """One decode of one prompt in one mode."""

    mode: str
    tokens: list[int]
    seconds: float  # wall time of the whole call, prefill included
    first_token_s: float  # wall time until the first output token was available
    first_tokens: int  # tokens available at that moment (a verify pass can release several)
    stats: dict[str, Any] | None = None  # agentspec's DecodeStats (None for transformers)
    cpu_seconds: float = 0.0  # CPU time of this process during the call (all threads)

    @property
    def tps_e2e(self) -> float:
        return len(self.tokens) / self.seconds

    @property
    def tps_decode(self) -> float:
        n, dt = len(self.tokens) - self.first_tokens, self.seconds - self.first_token_s
        return n / dt if n > 0 and dt > 0 else float("nan")


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt, call 2 the first token
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(pair, ids: list[int], n: int) -> Run:
    x = torch.tensor([ids], device=pair.device)
    timer = _FirstTokenTimer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, streamer=timer
        )
    dt = time.perf_counter() - t0
    tokens = out[0, len(ids) :].tolist()
    return Run("hf", tokens, dt, (timer.first or t0 + dt) - t0, 1)


def _no_reuse() -> dict[str, Any]:
    """Turn off the cross-call prefix cache: every mode prefills its prompt, as transformers does."""
    params = inspect.signature(agentspec.stream).parameters
    return {"prefix_cache": False} if "prefix_cache" in params else {}


def run_agentspec(pair, ids: list[int], n: int, mode: str, **options) -> Run:
    options.update(_no_reuse())
    tokens: list[int] = []
    first_s, first_n, last = None, 0, None
    t0 = time.perf_counter()
    for last in agentspec.stream(pair, ids, max_new_tokens=n, **options):
        tokens += last.tokens
        if first_s is None and last.tokens:
            first_s, first_n = time.perf_counter() - t0, len(last.tokens)
    dt = time.perf_counter() - t0
    assert last is not None
    return Run(mode, tokens, dt, first_s or dt, first_n, asdict(last.stats))


@torch.inference_mode()
def compare(pair, prompt_ids: list[int], ref: list[int], got: list[int]) -> dict[str, Any]:
    """Token-for-token comparison; on a mismatch, where and how close the target's call was."""
    if got == ref:
        return {"identical": True}
    i = first_diff(ref, got)
    info: dict[str, Any] = {
        "identical": False,
        "first_diff": i,
        "ref_len": len(ref),
        "got_len": len(got),
        "ref_token": ref[i] if i < len(ref) else None,
        "got_token": got[i] if i < len(got) else None,
    }
    top1, top2, margin = top_two(pair.target, prompt_ids + ref[:i])
    info.update(top1=top1, top2=top2, margin=margin)
    tok = pair.tokenizer
    info["context"] = tok.decode(ref[max(0, i - 8) : i])
    info["ref_text"] = tok.decode(ref[i : i + 1])
    info["got_text"] = tok.decode(got[i : i + 1])
    return info


def verify_cost(pair, sizes: list[int], cache_len: int, repeats: int) -> dict[str, Any]:
    """Median time of one target forward over k new tokens after a cache_len-token cache."""
    return roofline.verify_cost(pair.target, pair.tokenizer, sizes, cache_len, repeats)


def environment(pair) -> dict[str, Any]:
    """CPU, threads, versions, model and git commit (``agentspec.bench.run.environment``)."""
    from agentspec.bench.run import environment as bench_environment

    return bench_environment(pair)


def summarise(runs: list[Run], ref: dict[str, Any] | None = None) -> dict[str, Any]:
    """Totals over runs; with ``ref`` (the same prompts' summary for transformers), ratios to it."""
    n = sum(len(r.tokens) for r in runs)
    secs = sum(r.seconds for r in runs)
    dec_n = sum(len(r.tokens) - r.first_tokens for r in runs)
    dec_s = sum(r.seconds - r.first_token_s for r in runs)
    out: dict[str, Any] = {
        "tokens": n,
        "seconds": secs,
        "tps_e2e": n / secs,
        "tps_decode": dec_n / dec_s if dec_s > 0 else float("nan"),
        # CPU time / (wall time x torch threads): near 1 on an idle machine, well below on a shared one
        "cpu_share": sum(r.cpu_seconds for r in runs) / (secs * torch.get_num_threads()),
        # tokens per CPU-second: steadier than wall time on a shared machine (with passive waiting)
        "tps_cpu": n / max(sum(r.cpu_seconds for r in runs), 1e-9),
    }
    if ref:
        out["ratio_e2e_to_hf"] = out["tps_e2e"] / ref["tps_e2e"]
        out["ratio_decode_to_hf"] = out["tps_decode"] / ref["tps_decode"]
        out["ratio_cpu_to_hf"] = out["tps_cpu"] / ref["tps_cpu"]
    stats = [r.stats for r in runs if r.stats]
    if stats:
        drafted = sum(s["draft_tokens"] for s in stats)
        accepted = sum(s["accepted_tokens"] for s in stats)
        steps = sum(s["verify_steps"] for s in stats)
        out["draft_tokens"] = drafted
        out["accepted_tokens"] = accepted
        out["verify_steps"] = steps
        out["acceptance_rate"] = accepted / drafted if drafted else 0.0
        out["mean_acceptance_length"] = (accepted + steps) / steps if steps else 0.0  # incl. bonus
        out["mean_draft_length"] = drafted / steps if steps else 0.0
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    names = [p["name"] for p in result["prompts"]] + ["ALL"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2.4, 1]})
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        ys = [p["modes"][mode]["tps_e2e"] for p in result["prompts"]]
        ys.append(result["aggregate"][mode]["tps_e2e"])
        ax1.bar([i + (j - (len(modes) - 1) / 2) * width for i in range(len(names))], ys, width, label=mode)
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("tokens/s (end to end, prefill included)")
    env = result["environment"]
    busy = f"; load avg {max(env['load_average_start'][0], env['load_average_end'][0]):.1f}"
    ax1.set_title(
        f"{env['model']} greedy, {result['max_new_tokens']} new tokens, {env['device']} "
        f"{env['dtype']}, {env['torch_threads']} threads{busy}"
    )
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)

    pts = result["verify_cost"]["points"]
    ks = [p["new_tokens"] for p in pts]
    ax2.plot(ks, [p["median_ms"] for p in pts], "o-", label="median")
    ax2.fill_between(ks, [p["min_ms"] for p in pts], [p["max_ms"] for p in pts], alpha=0.2, label="min-max")
    for p in pts:
        ax2.annotate(
            f"{p['ratio_to_1']:.2f}x",
            (p["new_tokens"], p["median_ms"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(ks, [str(k) for k in ks])
    ax2.set_xlabel("new tokens in one target pass")
    ax2.set_ylabel("ms")
    ax2.set_ylim(bottom=0)
    ax2.set_title(f"verify cost, {result['verify_cost']['cache_tokens']}-token cache (T(k)/T(1) labelled)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts, 48 new tokens, fewer repeats (~2 min)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/core.json")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (quick: 48)")
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=[3, 5, 8])
    ap.add_argument("--repeats", type=int, default=None, help="decodes of each prompt per mode (2; quick: 1)")
    ap.add_argument("--verify-repeats", type=int, default=None, help="default 15 (quick: 7)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--device", default=None, help="default: load_pair's (CUDA if available, else CPU)")
    args = ap.parse_args(argv)
    n_new = args.max_new_tokens or (48 if args.quick else 128)
    verify_repeats = args.verify_repeats or (7 if args.quick else 15)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    pair = agentspec.load_pair(device=args.device, draft_model=False)  # the target alone, as documented
    assert pair.draft is None, "this benchmark measures the default pair (prompt lookup drafting)"
    prompts = [p for p in PROMPTS if not args.quick or p[0] in QUICK_PROMPTS]
    modes = ["hf", "plain"] + [f"spec_{k}" for k in args.draft_lengths]
    env = environment(pair)
    print(
        f"{env['model']} on {env['cpu_model']} ({env['device']}, {env['dtype']}, "
        f"{env['torch_threads']} threads); {len(prompts)} prompts x {len(modes)} modes, {n_new} new tokens"
    )

    def call(mode: str, ids: list[int]) -> Run:
        c0 = time.process_time()
        if mode == "hf":
            run = run_hf(pair, ids, n_new)
        elif mode == "plain":
            run = run_agentspec(pair, ids, n_new, mode, speculative=False)
        else:
            run = run_agentspec(pair, ids, n_new, mode, num_draft_tokens=int(mode.split("_")[1]))
        run.cpu_seconds = time.process_time() - c0
        return run

    # warm up every code path once (allocator, kernels, lazy imports) on a short prompt
    warm = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    for mode in modes:
        call(mode, list(warm))

    per_prompt: list[dict[str, Any]] = []
    all_runs: dict[str, list[Run]] = {m: [] for m in modes}
    run_names: list[str] = []  # the prompt of each entry of all_runs[mode]
    mismatches = 0
    for i, (name, kind, messages) in enumerate(prompts):
        ids = list(
            pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        runs: dict[str, list[Run]] = {m: [] for m in modes}
        for r in range(args.repeats):
            s = (i + r) % len(modes)
            for mode in modes[s:] + modes[:s]:  # rotated order: no mode always runs first
                runs[mode].append(call(mode, ids))
        ref = runs["hf"][0].tokens
        entry: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "prompt_tokens": len(ids),
            "output_tokens": len(ref),
            "modes": {},
        }
        hf_sum = summarise(runs["hf"])
        for mode in modes:
            m = summarise(runs[mode], hf_sum if mode != "hf" else None)
            checks = [compare(pair, ids, ref, run.tokens) for run in runs[mode]]
            m["identical"] = all(c["identical"] for c in checks)
            m["mismatches"] = [c for c in checks if not c["identical"]]
            mismatches += len(m["mismatches"])
            m["seconds_per_repeat"] = [run.seconds for run in runs[mode]]
            entry["modes"][mode] = m
            all_runs[mode] += runs[mode]
        run_names += [name] * args.repeats
        entry["output_text"] = pair.tokenizer.decode(ref)
        per_prompt.append(entry)
        line = "  ".join(
            f"{m}={entry['modes'][m]['tps_e2e']:.1f}" + ("" if entry["modes"][m]["identical"] else "(DIFF)")
            for m in modes
        )
        head = f"[{i + 1}/{len(prompts)}] {name:22s} {len(ids):4d}+{len(ref):3d} tok"
        print(f"{head}  tok/s: {line}", flush=True)
        for m in modes:
            for c in entry["modes"][m]["mismatches"]:
                print(
                    f"    MISMATCH {m}: first diff at {c['first_diff']}: hf {c['ref_token']} "
                    f"({c['ref_text']!r}) vs {c['got_token']} ({c['got_text']!r}); "
                    f"target margin top1-top2 = {c['margin']:.4f}"
                )

    hf_all = summarise(all_runs["hf"])
    aggregate = {m: summarise(all_runs[m], hf_all if m != "hf" else None) for m in modes}
    for m in modes:
        aggregate[m]["identical"] = all(p["modes"][m]["identical"] for p in per_prompt)
    for kind in ("chat", "agent"):  # the same summary over each kind of prompt
        names = {p["name"] for p in per_prompt if p["kind"] == kind}
        sub = {m: [r for name, r in zip(run_names, all_runs[m]) if name in names] for m in modes}
        if not sub["hf"]:
            continue
        hf_k = summarise(sub["hf"])
        for m in modes:
            k_sum = summarise(sub[m], hf_k if m != "hf" else None)
            for key in ("tps_e2e", "ratio_e2e_to_hf", "ratio_cpu_to_hf", "acceptance_rate"):
                if key in k_sum:
                    aggregate[m][f"{kind}_{key}"] = k_sum[key]

    print("verify-cost curve ...", flush=True)
    curve = verify_cost(pair, [1, 2, 4, 8, 16], 300, verify_repeats)
    env["load_average_end"] = list(os.getloadavg())
    warnings = []
    busiest = max(env["load_average_start"][0], env["load_average_end"][0])
    if busiest > (os.cpu_count() or 1):
        warnings.append(
            f"machine busy: 1-min load average up to {busiest:.1f} on {os.cpu_count()} CPUs; absolute speeds "
            "are depressed and noisy (modes are interleaved per prompt, so ratios suffer less)"
        )
    share = min(a["cpu_share"] for a in aggregate.values())
    if share < 0.8:
        warnings.append(f"the benchmark got as little as {share:.0%} of its threads' CPU time")
    result = {
        "benchmark": "core",
        "quick": args.quick,
        "max_new_tokens": n_new,
        "repeats": args.repeats,
        "draft_lengths": args.draft_lengths,
        "modes": modes,
        "agentspec_options": {"prefix_cache": False} if _no_reuse() else {},
        "conventions": {
            "tps_e2e": "output tokens / wall time of the call, prefill included",
            "tps_decode": "tokens after the first release / time after it (decode phase only)",
            "ratio_e2e_to_hf": "tps_e2e / tps_e2e of transformers generate() on the same prompts",
            "tps_cpu": "output tokens / CPU seconds of this process (all threads) during the calls",
            "cpu_share": "CPU seconds / (wall seconds x torch threads); well below 1 = machine shared",
            "mean_acceptance_length": "(accepted + verify_steps) / verify_steps: includes the target's token",
            "identical": "output ids equal transformers generate() ids token for token (EOS included)",
            "margin": "target logits top1 - top2 at the first differing position (one plain forward)",
        },
        "environment": env,
        "warnings": warnings,
        "aggregate": aggregate,
        "all_identical": mismatches == 0,
        "prompts": per_prompt,
        "verify_cost": curve,
        "runtime_s": time.perf_counter() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot(result, png)

    nan = float("nan")
    print(
        f"\n{'mode':8s} {'tok/s':>6s} {'decode':>6s} {'/cpu-s':>6s} {'vs hf':>6s} {'(cpu)':>6s} "
        f"{'accept':>6s} {'mean len':>8s} identical"
    )
    for m in modes:
        a = aggregate[m]
        print(
            f"{m:8s} {a['tps_e2e']:6.2f} {a['tps_decode']:6.2f} {a['tps_cpu']:6.2f} "
            f"{a.get('ratio_e2e_to_hf', 1.0):6.2f} {a.get('ratio_cpu_to_hf', 1.0):6.2f} "
            f"{a.get('acceptance_rate', nan):6.2f} {a.get('mean_acceptance_length', nan):8.2f} "
            f"{a['identical']}"
        )
    print(
        "verify cost (300-token cache): "
        + ", ".join(
            f"T({p['new_tokens']})={p['median_ms']:.1f} ms ({p['ratio_to_1']:.2f}x)" for p in curve["points"]
        )
    )
    for w in warnings:
        print(f"WARNING: {w}")
    print(f"wrote {args.out} and {png} in {result['runtime_s']:.0f} s")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
