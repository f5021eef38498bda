"""The decode loop on chat prompts against transformers ``generate``; the distilled default draft.

    python -m benchmarks core [--quick]                           # part decode (~17 min on 2 cores)
    python -m benchmarks core --part draft [--quick] [--draft F]  # (~15 min; --quick ~4)

**decode**: the embedded target alone (the drafter is prompt lookup) decodes each prompt of
``agentspec.bench.workloads.PROMPTS`` greedily every way, interleaved per prompt in an order that rotates
from prompt to prompt so that machine drift hits every mode alike: ``hf`` (``model.generate``, the
reference), ``plain`` (``agentspec.generate(speculative=False)``) and ``spec_k`` (``num_draft_tokens=k``
for each k in --draft-lengths). agentspec runs with ``prefix_cache=False``: every call prefills its whole
prompt, as transformers does, so only decoding is compared. Every output must equal the reference token
for token (EOS included); a mismatch is reported with the target's logit margin (top1 - top2) where they
part. Speeds per call: with prefill (``tps_e2e``), after the first token (``tps_decode``), per CPU-second
(``tps_cpu``, steadier on a shared machine). The verify-cost curve: one target pass over 1-16 new tokens
after a 300-token cache; T(k)/T(1) is the price of verifying k tokens in decode steps.

**draft**: the pair's draft (the embedded distilled head, or a folder from ``agentspec distill``) on
held-out prompts of ``agentspec.distill.prompts`` (never trained on), one torch thread unless --threads:

1. acceptance of 4-token drafts at temperature 0 and 0.7, per kind: ``token_acceptance`` (alpha of
   Leviathan et al.: accepted / (accepted + passes that ended on a rejection)), ``acceptance_rate``
   (accepted / drafted); at temperature 0 every output must equal plain decoding's.
2. cost: one draft and one target step after a 300-token cache, alternately (and the draft with the full
   LM head: what the cut head saves); with the verify-cost curve V(n), Leviathan et al.'s cost model
   gives per draft length k the alpha needed for 1x and 1.5x: (1 - a^(k+1)) / (1 - a) tokens per pass
   against k c + V(k+1) target steps.
3. speed on open chat, where lookup-style drafters find nothing: the chat prompts of ``PROMPTS`` and
   held-out chat prompts, greedy, plainly and with ``drafter="model"``, ``"model_scheduled"``, ``"auto"``
   and ``auto_no_model`` (auto as for a pair without a draft model), interleaved per prompt; the ratio
   is plain time / mode time; every output must equal plain's.

Writes the part's key of results/core.json and core_<part>.png; exits 1 if any output differed.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

import agentspec
from agentspec.bench import roofline
from agentspec.bench.conversation import prompt_ids
from agentspec.bench.divergence import first_diff, top_two
from agentspec.bench.workloads import PROMPTS, QUICK_PROMPTS
from agentspec.distill.prompts import is_heldout, make_prompts, render
from agentspec.drafters import DraftMemory, HybridDrafter
from agentspec.drafters.eagle import is_eagle
from benchmarks import harness

NO_REUSE = {"prefix_cache": False}  # every call prefills its prompt: decoding alone is compared
CONVENTIONS = {
    "tps_e2e": "output tokens / wall time of the call, prefill included",
    "tps_decode": "tokens after the first release / time after it (decode phase only)",
    "ratio_e2e_to_hf": "tps_e2e / tps_e2e of transformers generate() on the same prompts",
    "tps_cpu": "output tokens / CPU seconds of this process (all threads) during the calls",
    "cpu_share": "CPU seconds / (wall seconds x torch threads); well below 1 = machine shared",
    "mean_acceptance_length": "(accepted + verify_steps) / verify_steps: includes the target's token",
    "identical": "output ids equal transformers generate() ids token for token (EOS included)",
    "margin": "target logits top1 - top2 at the first differing position (one plain forward)",
}


def verify_cost(pair, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Median time of one target pass over k new tokens after a 300-token cache, per k in ``sizes``."""
    return roofline.verify_cost(pair.target, pair.tokenizer, sizes, 300, repeats)


# --- decode --------------------------------------------------------------------------------------


@dataclass
class Run:
    """One decode of one prompt in one mode."""

    tokens: list[int]
    seconds: float  # wall time of the whole call, prefill included
    first_token_s: float  # wall time until the first output token was available
    first_tokens: int  # tokens available at that moment (a verify pass can release several)
    cpu_seconds: float  # CPU time of this process during the call (all threads)
    stats: dict[str, Any] | None = None  # agentspec's DecodeStats (None for transformers)


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:  # call 1 is the prompt, call 2 the first token
        self.calls += 1
        self.first = self.first or (time.perf_counter() if self.calls == 2 else None)

    def end(self) -> None:
        pass


def decode(pair, mode: str, ids: list[int], n: int) -> Run:
    """One greedy call of ``mode`` (hf, plain or spec_k), timed to its first token and its end."""
    c0, t0 = time.process_time(), time.perf_counter()
    if mode == "hf":
        x, timer = torch.tensor([ids], device=pair.device), _FirstTokenTimer()
        with torch.inference_mode():
            out = pair.target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=n, streamer=timer)  # fmt: skip
        dt = time.perf_counter() - t0
        first = (timer.first or t0 + dt) - t0
        return Run(out[0, len(ids) :].tolist(), dt, first, 1, time.process_time() - c0)
    options = {"speculative": False} if mode == "plain" else {"num_draft_tokens": int(mode.split("_")[1])}
    tokens: list[int] = []
    first_s, first_n, last = None, 0, None
    for last in agentspec.stream(pair, ids, max_new_tokens=n, **NO_REUSE, **options):
        tokens += last.tokens
        if first_s is None and last.tokens:
            first_s, first_n = time.perf_counter() - t0, len(last.tokens)
    dt = time.perf_counter() - t0
    assert last is not None
    return Run(tokens, dt, first_s or dt, first_n, time.process_time() - c0, asdict(last.stats))


def compare(pair, prompt_ids: list[int], ref: list[int], got: list[int]) -> dict[str, Any]:
    """Token-for-token comparison; on a mismatch, where and how close the target's call was."""
    if got == ref:
        return {"identical": True}
    i = first_diff(ref, got)
    assert i is not None
    top1, top2, margin = top_two(pair.target, prompt_ids + ref[:i])
    decoded = pair.tokenizer.decode
    return {
        "identical": False, "first_diff": i, "ref_len": len(ref), "got_len": len(got),
        "ref_token": ref[i] if i < len(ref) else None, "got_token": got[i] if i < len(got) else None,
        "top1": top1, "top2": top2, "margin": margin, "context": decoded(ref[max(0, i - 8) : i]),
        "ref_text": decoded(ref[i : i + 1]), "got_text": decoded(got[i : i + 1]),
    }  # fmt: skip


def summarise(runs: list[Run], ref: dict[str, Any] | None = None) -> dict[str, Any]:
    """Totals over runs; with ``ref`` (the same prompts' summary for transformers), ratios to it."""
    n, secs = sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs)
    dec_n = sum(len(r.tokens) - r.first_tokens for r in runs)
    dec_s = sum(r.seconds - r.first_token_s for r in runs)
    cpu = sum(r.cpu_seconds for r in runs)
    out: dict[str, Any] = {"tokens": n, "seconds": secs, "tps_e2e": n / secs, "tps_cpu": n / max(cpu, 1e-9),
                           "tps_decode": dec_n / dec_s if dec_s > 0 else float("nan"),
                           "cpu_share": cpu / (secs * torch.get_num_threads())}  # fmt: skip
    if ref:
        for key in ("e2e", "decode", "cpu"):
            out[f"ratio_{key}_to_hf"] = out[f"tps_{key}"] / ref[f"tps_{key}"]
    stats = [r.stats for r in runs if r.stats]
    if stats:
        drafted, accepted = sum(s["draft_tokens"] for s in stats), sum(s["accepted_tokens"] for s in stats)
        steps = sum(s["verify_steps"] for s in stats)
        out |= {"draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": steps,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_acceptance_length": (accepted + steps) / steps if steps else 0.0,  # with the bonus
                "mean_draft_length": drafted / steps if steps else 0.0}  # fmt: skip
    return out


def decode_prompt(pair, i: int, prompt: tuple, modes: list[str], n: int, repeats: int) -> tuple[dict, dict]:
    """Every mode on one prompt, ``repeats`` times in rotated order: its entry and its runs per mode."""
    name, kind, messages = prompt
    ids = prompt_ids(pair.tokenizer, messages)
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for r in range(repeats):
        for mode in harness.rotated(modes, i + r):
            runs[mode].append(decode(pair, mode, ids, n))
    ref = runs["hf"][0].tokens
    entry: dict[str, Any] = {"name": name, "kind": kind, "prompt_tokens": len(ids), "output_tokens": len(ref)}
    hf = summarise(runs["hf"])
    entry["modes"] = {m: summarise(runs[m], hf if m != "hf" else None) for m in modes}
    for m, summary in entry["modes"].items():
        checks = [compare(pair, ids, ref, run.tokens) for run in runs[m]]
        summary["identical"] = all(c["identical"] for c in checks)
        summary["mismatches"] = [c for c in checks if not c["identical"]]
        summary["seconds_per_repeat"] = [run.seconds for run in runs[m]]
    entry["output_text"] = pair.tokenizer.decode(ref)
    speeds = "  ".join(
        f"{m}={s['tps_e2e']:.1f}" + ("" if s["identical"] else "(DIFF)") for m, s in entry["modes"].items()
    )
    print(f"{name:22s} {len(ids):4d}+{len(ref):3d} tok  tok/s: {speeds}", flush=True)
    for m, s in entry["modes"].items():
        for c in s["mismatches"]:
            print(f"    MISMATCH {m} at {c['first_diff']}: hf {c['ref_text']!r} vs {c['got_text']!r}; "
                  f"target margin top1-top2 = {c['margin']:.4f}")  # fmt: skip
    return entry, runs


def aggregate(entries: list[dict], runs: list[dict[str, list[Run]]], modes: list[str]) -> dict:
    """Per mode over all prompts, with each kind's (chat, agent) speed, ratios and acceptance beside."""

    def over(kind: str | None = None) -> dict[str, dict]:
        chosen = [p for e, p in zip(entries, runs) if kind in (None, e["kind"])]
        merged = {m: [r for p in chosen for r in p[m]] for m in modes}
        hf = summarise(merged["hf"]) if merged["hf"] else None
        return {m: summarise(merged[m], hf if m != "hf" else None) for m in modes} if hf else {}

    out = over()
    for m in modes:
        out[m]["identical"] = all(e["modes"][m]["identical"] for e in entries)
        for kind in ("chat", "agent"):
            for key, v in over(kind).get(m, {}).items():
                if key in ("tps_e2e", "ratio_e2e_to_hf", "ratio_cpu_to_hf", "acceptance_rate"):
                    out[m][f"{kind}_{key}"] = v
    return out


def run_decode(args) -> tuple[dict[str, Any], bool]:
    harness.set_threads(args.threads)
    n_new = args.max_new_tokens or (48 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 2)
    t_start = time.perf_counter()
    pair = agentspec.load_pair(device=args.device, draft_model=False)
    prompts = [p for p in PROMPTS if not args.quick or p[0] in QUICK_PROMPTS]
    modes = ["hf", "plain"] + [f"spec_{k}" for k in args.draft_lengths]
    env = harness.environment(pair)
    print(f"{env['model']} ({env['device']}, {env['dtype']}, {env['torch_threads']} threads): "
          f"{len(prompts)} prompts x {len(modes)} modes, {n_new} new tokens")  # fmt: skip
    warm = prompt_ids(pair.tokenizer, [{"role": "user", "content": "Hi"}])
    for mode in modes:  # every code path once (allocator, kernels, lazy imports)
        decode(pair, mode, warm, n_new)
    done = [decode_prompt(pair, i, p, modes, n_new, repeats) for i, p in enumerate(prompts)]
    entries, runs = [e for e, _ in done], [r for _, r in done]
    totals = aggregate(entries, runs, modes)
    curve = verify_cost(pair, [1, 2, 4, 8, 16], args.verify_repeats or (7 if args.quick else 15))
    env["load_average_end"] = list(os.getloadavg())
    identical = all(a["identical"] for a in totals.values())
    result = {
        "benchmark": "core", "quick": args.quick, "max_new_tokens": n_new, "repeats": repeats,
        "draft_lengths": args.draft_lengths, "modes": modes, "conventions": CONVENTIONS, "environment": env,
        "aggregate": totals, "all_identical": identical, "prompts": entries, "verify_cost": curve,
        "runtime_s": time.perf_counter() - t_start,
    }  # fmt: skip
    for m, a in totals.items():
        print(f"{m:8s} tok/s {a['tps_e2e']:6.2f}  vs hf {a.get('ratio_e2e_to_hf', 1.0):5.2f} (cpu "
              f"{a.get('ratio_cpu_to_hf', 1.0):5.2f})  accept {a.get('acceptance_rate', 0):4.2f}  "
              f"identical {a['identical']}")  # fmt: skip
    ratios = ", ".join(f"T({p['new_tokens']})/T(1) {p['ratio_to_1']:.2f}" for p in curve["points"])
    print(f"verify cost: {ratios}")
    return result, identical


def plot_decode(result: dict[str, Any], out) -> None:
    modes, prompts, env = result["modes"], result["prompts"], result["environment"]
    names = [p["name"] for p in prompts] + ["ALL"]
    with harness.figure(out, 2, part="decode", size=(7.5, 5.5)) as (ax1, ax2):
        width = 0.8 / len(modes)
        for j, mode in enumerate(modes):
            ys = [p["modes"][mode]["tps_e2e"] for p in prompts] + [result["aggregate"][mode]["tps_e2e"]]
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(names))]
            ax1.bar(xs, ys, width, label=mode)
        ax1.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        load = max(env["load_average_start"][0], env["load_average_end"][0])
        ax1.set_title(f"{env['model']} greedy, {result['max_new_tokens']} new tokens, {env['device']} "
                      f"{env['dtype']}, {env['torch_threads']} threads; load {load:.1f}",
                      fontsize=9)  # fmt: skip
        ax1.set_ylabel("tokens/s (end to end, prefill included)")
        ax1.legend(fontsize=8)
        ax1.grid(axis="y", alpha=0.3)
        pts, cache = result["verify_cost"]["points"], result["verify_cost"]["cache_tokens"]
        ks = [p["new_tokens"] for p in pts]
        ax2.plot(ks, [p["median_ms"] for p in pts], "o-", label="median")
        lo, hi = [p["min_ms"] for p in pts], [p["max_ms"] for p in pts]
        ax2.fill_between(ks, lo, hi, alpha=0.2, label="min-max")
        for p in pts:
            ax2.annotate(f"{p['ratio_to_1']:.2f}x", (p["new_tokens"], p["median_ms"]),
                         textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(ks, [str(k) for k in ks])
        ax2.set(xlabel="new tokens in one target pass", ylabel="ms", ylim=(0, None),
                title=f"verify cost, {cache}-token cache (T(k)/T(1) labelled)")  # fmt: skip
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)


# --- draft ---------------------------------------------------------------------------------------


def counts(stats) -> dict[str, int]:
    return {key: getattr(stats, key) for key in ("draft_tokens", "accepted_tokens", "verify_steps")}


def heldout_prompts(tokenizer, kinds: tuple[str, ...], per_kind: int, skip: int = 0) -> list[dict]:
    """Held-out prompts of the default recipe, per kind, after ``skip`` of each kind (the pipeline's
    own evaluation takes the first held-out prompts; the speed measurement takes later ones)."""
    from agentspec.distill.config import DistillConfig

    cfg = DistillConfig()
    out: dict[str, list[dict]] = {k: [] for k in kinds}
    seen = dict.fromkeys(kinds, 0)
    for spec in make_prompts(cfg.n_prompts, cfg.seed):
        if spec.kind not in out or not is_heldout(spec.key(), cfg.heldout_fraction):
            continue
        seen[spec.kind] += 1
        if seen[spec.kind] > skip and len(out[spec.kind]) < per_kind:
            name = f"{spec.kind}_{seen[spec.kind]}"
            out[spec.kind].append({"name": name, "kind": spec.kind, "ids": render(tokenizer, spec)})
    return [p for k in kinds for p in out[k]]


def acceptance(pair, prompts: list[dict], temperature: float, n: int, k: int) -> dict[str, Any]:
    rows = []
    for i, p in enumerate(prompts):
        opts: dict[str, Any] = {"max_new_tokens": n, "temperature": temperature, **NO_REUSE}
        if temperature > 0:
            opts["seed"] = 1000 + i
        spec = agentspec.generate(pair, p["ids"], drafter="model", num_draft_tokens=k, **opts)
        s = spec.stats
        row = {"name": p["name"], "kind": p["kind"], "output_tokens": s.output_tokens, **counts(s),
               "histogram": list(s.acceptance_histogram)}  # fmt: skip
        if temperature == 0:
            row["identical_to_plain"] = (
                agentspec.generate(pair, p["ids"], speculative=False, **opts).token_ids == spec.token_ids
            )
        rows.append(row)
        print(f"  T={temperature} {p['name']}: {row['accepted_tokens']}/{row['draft_tokens']}", flush=True)
    return {"rows": rows, "by_kind": _rates(rows, k), "all": _rates(rows, k, by_kind=False)["all"]}


def _rates(rows: list[dict], k: int, by_kind: bool = True) -> dict[str, dict]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["kind"] if by_kind else "all", []).append(r)
    out = {}
    for key, rs in groups.items():
        drafted, accepted = sum(r["draft_tokens"] for r in rs), sum(r["accepted_tokens"] for r in rs)
        steps = sum(r["verify_steps"] for r in rs)
        # passes that ended on a rejected token: all but those that accepted a full k-token draft
        # (a draft cut short by the token limit counts as rejected: slightly pessimistic)
        rejections = sum(sum(r["histogram"][:k]) for r in rs)
        out[key] = {
            "prompts": len(rs),
            "token_acceptance": accepted / (accepted + rejections) if accepted + rejections else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_pass": accepted / steps if steps else None,
            "tokens_per_pass": sum(r["output_tokens"] for r in rs) / steps if steps else None,
        }
    return out


def step_costs(pair, ids: list[int], repeats: int) -> dict[str, float]:
    """Median ms of one decode step after ``len(ids)`` cached tokens: target, draft, draft full head.
    An EAGLE head's step is its own (a token and the target's feature in, its LM head out): the
    feature comes free with the target's verify pass."""
    from transformers import DynamicCache

    eagle, draft = is_eagle(pair.draft), pair.draft
    full, cut = pair.target.get_output_embeddings(), draft.get_output_embeddings()
    x, one = torch.tensor([ids], device=pair.device), torch.tensor([[ids[-1]]], device=pair.device)
    times: dict[str, list[float]] = {"target": [], "draft": [], "draft_full_head": []}
    caches = {
        "target": DynamicCache(),
        "draft": DynamicCache(config=draft.decoder.config) if eagle else DynamicCache(),
    }
    feats = torch.zeros((1, len(ids), draft.config.hidden_size), dtype=pair.dtype) if eagle else None

    def step(name: str, tokens: torch.Tensor) -> None:  # the EAGLE head's features: zeros cost the same
        model, cache = (pair.target, caches["target"]) if name == "target" else (draft, caches["draft"])
        if name != "target" and eagle:
            draft(feats[:, : tokens.shape[1]], tokens, cache)
        else:
            model(input_ids=tokens, cache=cache, use_cache=True)

    with torch.inference_mode():
        for name in ("target", "draft"):  # the cached prefix
            step(name, x)
        for _ in range(repeats):
            for name in times:
                draft.set_output_embeddings(full if name == "draft_full_head" else cut)
                t = time.perf_counter()
                step(name, one)
                times[name].append(time.perf_counter() - t)
                caches["target" if name == "target" else "draft"].crop(-1)
        draft.set_output_embeddings(cut)
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    return {**{f"{name}_ms": v for name, v in ms.items()}, "draft_per_target": ms["draft"] / ms["target"],
            "draft_full_head_per_target": ms["draft_full_head"] / ms["target"]}  # fmt: skip


def expected_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Tokens per pass over its cost in target steps: (1 - a^(k+1)) / (1 - a) / (k c + V(k+1))."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


def alpha_needed(goal: float, k: int, c: float, v: float) -> float | None:
    """The token acceptance at which ``expected_speedup`` reaches ``goal`` (None: not even at 1)."""
    if expected_speedup(1.0, k, c, v) < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):  # bisection: the speedup rises with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_speedup(mid, k, c, v) < goal else (lo, mid)
    return hi


def cost_model(curve: dict[str, Any], c: float) -> dict[str, Any]:
    """Per draft length: the acceptance a draft of cost ``c`` needs for 1x and 1.5x, given V(k+1)."""
    ratio = {p["new_tokens"]: p["ratio_to_1"] for p in curve["points"]}
    rows = [
        {"draft_tokens": n - 1, "verify_ratio": v, "alpha_for_1x": alpha_needed(1.0, n - 1, c, v),
         "alpha_for_1.5x": alpha_needed(1.5, n - 1, c, v)}  # a pass verifying n - 1 draft tokens feeds n
        for n, v in sorted(ratio.items()) if n >= 2
    ]  # fmt: skip
    return {"draft_per_target": c, "rows": rows}


def speed(pair, prompts: list[dict], n: int, modes: list[str]) -> dict[str, Any]:
    runs: dict[str, list[dict]] = {m: [] for m in ["plain", *modes]}
    no_model_memory = DraftMemory()  # its own suffix tree and calibrations, filled as its calls run
    for i, p in enumerate(prompts):
        outputs = {}
        for mode in harness.rotated(list(runs), i):
            drafter = {"plain": "none", "auto_no_model": HybridDrafter(no_model_memory)}.get(mode, mode)
            t = time.perf_counter()
            r = agentspec.generate(pair, p["ids"], drafter=drafter, max_new_tokens=n, **NO_REUSE)
            s, outputs[mode] = r.stats, r.token_ids
            row = {"name": p["name"], "seconds": time.perf_counter() - t, "tokens": len(r.token_ids)}
            runs[mode].append(row | counts(s))
        differ = [m for m in modes if outputs[m] != outputs["plain"]]
        for m in differ:
            runs[m][-1]["differs_from_plain"] = True
        print(f"  {p['name']}: " + ", ".join(f"{m} {rs[-1]['seconds']:.1f}s" for m, rs in runs.items())
              + (f"  DIFFERS: {differ}" if differ else ""), flush=True)  # fmt: skip
    plain_s = sum(r["seconds"] for r in runs["plain"])
    summary = {}
    for m, rs in runs.items():
        drafted, accepted = sum(r["draft_tokens"] for r in rs), sum(r["accepted_tokens"] for r in rs)
        summary[m] = {
            "seconds": sum(r["seconds"] for r in rs),
            "tokens": sum(r["tokens"] for r in rs),
            "speedup_vs_plain": plain_s / sum(r["seconds"] for r in rs),
            "acceptance_rate": accepted / drafted if drafted else None,
            "differs_from_plain": sum(bool(r.get("differs_from_plain")) for r in rs),
        }
    return {"runs": runs, "summary": summary}


def run_draft(args) -> tuple[dict[str, Any], bool]:
    harness.set_threads(args.threads or 1)
    torch.manual_seed(0)
    pair = agentspec.load_pair(device=args.device, draft_model=args.draft)
    if pair.draft is None:
        raise SystemExit("no draft model in the pair: pass --draft <folder>")
    tok, k = pair.tokenizer, 4
    per_kind = args.per_kind or (3 if args.quick else 8)
    n = args.max_new_tokens or (48 if args.quick else 96)
    acc_prompts = heldout_prompts(tok, ("chat", "agent", "tool_result", "instruction"), per_kind)
    result: dict[str, Any] = {"environment": harness.environment(pair), "draft": pair.draft_name,
                              "max_new_tokens": n, "draft_tokens_per_pass": k}  # fmt: skip
    t0 = time.perf_counter()
    result["acceptance"] = {f"t{t:g}": acceptance(pair, acc_prompts, t, n, k) for t in (0.0, 0.7)}
    result["step_costs"] = step_costs(pair, acc_prompts[0]["ids"][:300], 10 if args.quick else 30)
    print("step costs:", {name: round(v, 3) for name, v in result["step_costs"].items()}, flush=True)
    result["verify_cost"] = verify_cost(pair, [1, 2, 3, 4, 5, 7, 9], 5 if args.quick else 15)
    result["cost_model"] = cost_model(result["verify_cost"], result["step_costs"]["draft_per_target"])
    print("acceptance needed:", result["cost_model"]["rows"], flush=True)
    chat = [{"name": name, "kind": kind, "ids": prompt_ids(tok, msgs)} for name, kind, msgs in PROMPTS
            if kind == "chat"]  # fmt: skip
    chat += heldout_prompts(tok, ("chat",), 2 if args.quick else 5, skip=per_kind)
    result["speed"] = speed(pair, chat, n, ["model", "model_scheduled", "auto", "auto_no_model"])
    result["seconds"] = time.perf_counter() - t0
    bad = sum(not r.get("identical_to_plain", True) for r in result["acceptance"]["t0"]["rows"])
    bad += sum(v["differs_from_plain"] for v in result["speed"]["summary"].values())
    result["outputs_differing_from_plain"] = bad
    for t_key, a in result["acceptance"].items():
        kinds = ", ".join(f"{kind} {v['token_acceptance']:.3f}" for kind, v in a["by_kind"].items())
        print(f"token acceptance {t_key}: all {a['all']['token_acceptance']:.3f}; {kinds}")
    print(
        "speed vs plain:", {m: round(v["speedup_vs_plain"], 3) for m, v in result["speed"]["summary"].items()}
    )
    print(f"outputs differing from plain: {bad}")
    return result, bad == 0


def plot_draft(result: dict[str, Any], out) -> None:
    with harness.figure(out, 2, part="draft", size=(5.5, 4)) as (a1, a2):
        for t_key, offset in (("t0", -0.2), ("t0.7", 0.2)):
            by_kind = result["acceptance"][t_key]["by_kind"]
            alphas = [by_kind[kind]["token_acceptance"] or 0 for kind in sorted(by_kind)]
            a1.bar(
                [i + offset for i in range(len(alphas))], alphas, width=0.4, label=f"temperature {t_key[1:]}"
            )
            a1.set_xticks(range(len(alphas)), sorted(by_kind))
        a1.axhline(0.6, color="grey", linestyle="--", linewidth=1, label="goal 0.6")
        a1.set(ylabel="token acceptance alpha (4-token drafts)", title="Held-out acceptance of the draft")
        a1.legend()
        s = result["speed"]["summary"]
        a2.bar(list(s), [v["speedup_vs_plain"] for v in s.values()], color="tab:green")
        a2.axhline(1.0, color="grey", linewidth=1)
        a2.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="goal 1.5x")
        a2.set(ylabel="speed vs plain decoding", title="Open-ended chat, greedy")
        a2.legend()


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("core", __doc__)
    ap.add_argument("--part", choices=("decode", "draft"), default="decode")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats")
    ap.add_argument("--max-new-tokens", type=int, help="decode: 128 (quick 48); draft: 96 (quick 48)")
    ap.add_argument("--device", default=None, help="default: load_pair's (CUDA if available, else CPU)")
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=[3, 5, 8], help="decode: spec_k modes")
    ap.add_argument("--repeats", type=int, help="decode: decodes of each prompt per mode (2; quick 1)")
    ap.add_argument("--verify-repeats", type=int, help="decode: of the verify-cost curve (15; quick 7)")
    ap.add_argument("--draft", default=None, help="draft: a distilled draft folder (default: the embedded)")
    ap.add_argument("--per-kind", type=int, help="draft: held-out prompts per kind (8; quick 3)")
    args = ap.parse_args(argv)
    run, plot = (run_decode, plot_decode) if args.part == "decode" else (run_draft, plot_draft)
    result, ok = run(args)
    harness.write(args.out, result, part=args.part)
    plot(result, args.out)
    return 0 if ok else 1
