"""Each drafter on recorded tool-calling agent turns, against plain decoding, replies identical.

    OMP_NUM_THREADS=1 python -m benchmarks traces    # about 11 minutes on 2 cores
    python -m benchmarks traces --traces a,b --configs none,suffix,auto --max-new-tokens 48 --dtype bfloat16
    python -m benchmarks traces --rounds 3    # the traces 3 times, later rounds tagged (more evidence)
    python -m benchmarks traces --replay results/traces_calibration_rounds.json --out replayed.json

Replays the conversations of ``benchmarks.workloads.TRACES`` (inventory x2, SQL analytics, code editing,
document Q&A: 22 assistant turns over 300-1,100-token prompts) with the embedded pair, greedily. At
every assistant turn each configuration generates a reply, side by side, in an order that rotates from
turn to turn so that machine drift hits all alike; every reply must equal plain decoding's token for
token. With ``--rounds R`` the traces are replayed R times, round r > 0 with ``[round r]`` before
the first user message (``workloads.tagged``): each configuration's memory carries on, so a later
round drafts from the outputs of the earlier ones, as an agent repeating its tasks does. Before the
timed calls the turn's prompt is put in the prefix cache (target and draft), so every configuration
restores it the same way and the timings compare decoding.

    none             plain decoding (our loop without a draft)
    prompt_lookup    n-gram lookup in the context, 4 tokens
    suffix           suffix trees over the request and earlier outputs (SuffixDecoding)
    model            the draft model (the pair's distilled head), 2 tokens, on every 2nd turn
    model_scheduled  the draft model, its length from calibrated confidence and the verify-cost curve
    auto             per pass: the suffix draft or the scheduled draft model, whichever is worth more
    auto_no_model    ``drafter="auto"`` as for a pair without a draft model (suffix trees alone)

The fixed-length model is by far the slowest configuration: it runs on every other turn, with 2-token
drafts, to keep the run short (its ratios are against plain on the same turns). Suffix, the scheduled
model and auto choose their own lengths up to their own cap, as a user gets them. Each configuration
has its own drafting memory (suffix tree of earlier outputs, calibrations, cost curve), filled as its
calls run, so none sees another's outputs.

Writes results/traces.json (per turn: the plain reply's text and ids and each configuration's figures;
per configuration and per domain: tokens/s, acceptance, mean accepted length, speed ratio to plain by
wall and CPU time; ``verdict``: auto against the best single drafter; ``calibration``: per configuration
whose drafts carry survival estimates, their ECE and Brier score per draft source and position,
``agentspec.bench.calibration``; ``observations``: each calibration's evidence in order) and
traces.png beside it. ``--replay`` runs no model: it scores this checkout's calibrations on a run's
recorded evidence (each configuration's, in order, through a fresh ``DraftMemory``), so a change to
a calibration is compared on the same evidence before it is measured in a run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import agentspec
from agentspec.bench import calibration
from agentspec.bench.conversation import prompt_ids
from agentspec.drafters import DraftMemory, HybridDrafter, build_drafter
from agentspec.drafters.schedule import Calibration
from benchmarks import harness, workloads
from benchmarks.workloads import calls

CONFIGS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto", "auto_no_model")
HYBRIDS = ("auto", "auto_no_model")
NUM_DRAFT_TOKENS = {"prompt_lookup": 4, "model": 2, "adaptive": None}  # None: the drafter's own cap
MODEL_EVERY = 2  # the fixed-length model runs on every 2nd turn
KINDS = ("suffix", "lookup", "model")  # a DraftMemory's calibrations: <kind>_calibration
SOURCES = ("source_steps", "source_draft_tokens", "source_accepted_tokens")
CONVENTIONS = {
    "tokens_per_s": "output tokens / wall time of the calls (prompt restored from the prefix cache)",
    "speed_ratio": "tokens_per_s / tokens_per_s of 'none' (plain decoding) over the same turns",
    "cpu_speed_ratio": "the same with CPU time of this process instead of wall time",
    "acceptance_rate": "accepted draft tokens / draft tokens verified",
    "mean_accepted_length": "(accepted + verify_steps) / verify_steps: tokens per target pass",
    "source_steps": "verify passes per draft source (auto: suffix / model / none)",
}


@dataclass
class Logged(Calibration):
    """A calibration that also keeps each verification it learns from, in order, so that other
    calibrators can be replayed offline on the same evidence (the JSON's ``observations``)."""

    log: list = field(default_factory=list)  # [confidences, accepted, groups] per verified draft

    def observe(self, confidences, n_accepted, groups=None) -> None:
        self.log.append([list(confidences), n_accepted, list(groups or [])])
        super().observe(confidences, n_accepted, groups)


def logged_memory() -> DraftMemory:
    """A fresh ``DraftMemory`` whose calibrations, each set up as the library sets it, keep their
    evidence too."""
    memory = DraftMemory()
    for kind in KINDS:
        made = getattr(memory, f"{kind}_calibration")
        logged = Logged(**{f.name: getattr(made, f.name) for f in fields(made)})
        setattr(memory, f"{kind}_calibration", logged)
    return memory


def run_call(pair, ids: list[int], config: str, memory: DraftMemory, n_new: int) -> dict[str, Any]:
    if config == "none":
        drafter = "none"
    elif config == "auto_no_model":  # what drafter="auto" is for a pair without a draft model
        drafter = HybridDrafter(memory)
    else:
        drafter = build_drafter(pair, config, memory)
    k = NUM_DRAFT_TOKENS.get(config, NUM_DRAFT_TOKENS["adaptive"])
    c0, t0 = time.process_time(), time.perf_counter()
    steps = list(agentspec.stream(pair, ids, drafter, max_new_tokens=n_new, num_draft_tokens=k))
    wall, cpu, s = time.perf_counter() - t0, time.process_time() - c0, steps[-1].stats
    return {
        "tokens": [t for step in steps for t in step.tokens], "survival": calibration.outcomes(steps),
        "seconds": wall, "cpu_seconds": cpu, "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens, "verify_steps": s.verify_steps,
        "acceptance_histogram": list(s.acceptance_histogram), "cached_tokens": s.cached_tokens,
        **{key: dict(getattr(s, key)) for key in SOURCES},
    }  # fmt: skip


def replayed(observations: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Each configuration's recorded evidence (a run's ``observations``) replayed through a fresh
    ``DraftMemory``'s calibrations, this checkout's, and scored as a run's estimates are."""
    out = {}
    for config, kinds in observations.items():
        memory, records = DraftMemory(), []
        for kind, log in kinds.items():
            source = kind if config in HYBRIDS else config  # as the run's steps name their drafts
            records += calibration.replay(log, getattr(memory, f"{kind}_calibration"), source)
        out[config] = calibration.report(records)
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n, secs = sum(r["output_tokens"] for r in rows), sum(r["seconds"] for r in rows)
    cpu = sum(r["cpu_seconds"] for r in rows)
    drafted, accepted = sum(r["draft_tokens"] for r in rows), sum(r["accepted_tokens"] for r in rows)
    steps = sum(r["verify_steps"] for r in rows)
    out: dict[str, Any] = {
        "tokens": n, "seconds": secs, "tokens_per_s": n / secs,
        "tokens_per_cpu_s": n / cpu if cpu else float("nan"), "draft_tokens": drafted,
        "accepted_tokens": accepted, "verify_steps": steps,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
        "mean_draft_length": drafted / steps if steps else 0.0,
    }  # fmt: skip
    for key in SOURCES:
        total: dict[str, int] = {}
        for r in rows:
            for src, v in r[key].items():
                total[src] = total.get(src, 0) + v
        out[key] = total
    return out


def aggregate(turns: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """Per configuration, over the turns it ran; ratios against plain on those same turns."""
    out = {}
    for c in configs:
        ran = [t for t in turns if c in t["configs"]]
        if ran:
            out[c] = summarise([t["configs"][c] | {"output_tokens": t["output_tokens"]} for t in ran])
            plain = summarise([t["configs"]["none"] | {"output_tokens": t["output_tokens"]} for t in ran])
            out[c]["turns"] = len(ran)
            out[c]["speed_ratio"] = out[c]["tokens_per_s"] / plain["tokens_per_s"]
            out[c]["cpu_speed_ratio"] = out[c]["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
    return out


def verdict(totals: dict[str, Any], configs: list[str]) -> dict[str, Any]:
    """The best single drafter's speed ratio, and each hybrid's against it (+0.05 = 5% faster)."""
    singles = [c for c in configs if c != "none" and c not in HYBRIDS]
    best_single = max(singles, key=lambda c: totals[c]["speed_ratio"]) if singles else None
    best = totals[best_single]["speed_ratio"] if best_single else None
    out: dict[str, Any] = {"best_single_drafter": best_single, "best_single_speed_ratio": best}
    for h in HYBRIDS:
        if h in totals:
            r = totals[h]["speed_ratio"]
            margin = r / best - 1 if best else None
            out[h] = {"speed_ratio": r, "reaches_2x": r >= 2.0, "margin_over_best_single": margin}
    return out


def replay(
    pair,
    traces,
    configs: list[str],
    memories: dict[str, DraftMemory],
    n_new: int,
    survival: dict[str, list],
    rounds: int = 1,
) -> list[dict]:
    """Every turn of every trace, ``rounds`` times: each configuration's reply, in rotated order, against
    plain's; each configuration's judged draft tokens with their survival estimates go to
    ``survival[config]``."""
    turns: list[dict[str, Any]] = []
    for r, trace in ((r, t) for r in range(rounds) for t in traces):
        tag = f"round {r}" if r else None  # a later round's histories differ from the first's
        for n, (history, recorded) in enumerate(calls(trace)):
            ids = prompt_ids(pair.tokenizer, workloads.tagged(history, tag))
            # the prompt into the prefix cache, for the target and the draft model alike
            agentspec.generate(pair, ids, "model", max_new_tokens=2, num_draft_tokens=1)
            i = len(turns)
            here = [c for c in configs if c != "model" or i % MODEL_EVERY == 0]
            rows = {c: run_call(pair, ids, c, memories[c], n_new) for c in harness.rotated(here, i)}
            for c in here:
                survival[c] += rows[c].pop("survival")
            ref = rows["none"]["tokens"]
            diff = [c for c in here if rows[c]["tokens"] != ref]
            turns.append({
                "trace": trace.name, "round": r, "domain": trace.domain, "turn": n, "prompt_tokens": len(ids),
                "output_tokens": len(ref), "output_text": pair.tokenizer.decode(ref),
                "output_token_ids": ref,  # before_after compares replies between commits by these
                "recorded_reply": recorded["content"], "identical": not diff, "different": diff,
                "configs": {c: {k: v for k, v in rows[c].items() if k != "tokens"} for c in here},
            })  # fmt: skip
            speeds = "  ".join(f"{c}={len(rows[c]['tokens']) / rows[c]['seconds']:.1f}" for c in here)
            flag = f"  DIFFERENT: {diff}" if diff else ""
            print(
                f"{trace.name}#{n}{f' ({tag})' if tag else ''} {len(ids)}+{len(ref)} tok/s: {speeds}{flag}",
                flush=True,
            )
    return turns


def draft_record(pair, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The draft model, and how often its first token was accepted: a fixed-model pass accepts its first
    draft token iff the draft's argmax equals the target's."""
    hists = [t["configs"]["model"]["acceptance_histogram"] for t in turns if "model" in t["configs"]]
    agreed, passes = sum(sum(h[1:]) for h in hists), sum(sum(h) for h in hists)
    return {
        "name": pair.draft_name,
        "kind": "the embedded pair's distilled draft (agentspec distill)",
        "draft_agreement": agreed / passes if passes else None,
        "draft_agreement_note": "share of the fixed-length model's verify passes whose first draft "
        "token was accepted: positions where the draft's argmax equals the target's",
    }


def plot(result: dict[str, Any], out) -> None:
    configs, totals, env = result["configs"], result["aggregate"], result["environment"]
    with harness.figure(out, 2, size=(7, 5)) as (ax1, ax2):
        ys = [totals[c]["tokens_per_s"] for c in configs]
        bars = ax1.bar(configs, ys, color=[f"C{j}" for j in range(len(configs))])
        for b, c in zip(bars, configs):
            a = totals[c]
            label = f"{a['speed_ratio']:.2f}x\nacc {a['acceptance_rate']:.2f}"
            label += f"\nlen {a['mean_accepted_length']:.2f}"
            top = (b.get_x() + b.get_width() / 2, b.get_height())
            ax1.annotate(label, top, ha="center", va="bottom", fontsize=7)
        ax1.set_ylabel("tokens/s (wall, per call)")
        ax1.set_title("all turns: speed, ratio to plain, acceptance, mean accepted length", fontsize=9)
        ax1.tick_params(axis="x", rotation=30, labelsize=8)
        ax1.set_ylim(top=max(ys) * 1.35)
        groups = {**result["by_domain"], "all": totals}
        width = 0.8 / len(configs)
        for j, c in enumerate(configs):
            xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(groups))]
            ratios = [g.get(c, {}).get("speed_ratio", 0.0) for g in groups.values()]
            ax2.bar(xs, ratios, width, label=c, color=f"C{j}")
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.axhline(2.0, color="r", lw=0.8, ls="--", label="2x plain")
        ax2.set_xticks(range(len(groups)), list(groups))
        ax2.set_ylabel("speed ratio to plain decoding")
        ax2.set_title(f"{env['model']} greedy, {env['device']} {env['dtype']}, {env['torch_threads']} "
                      f"thread(s); draft: distilled", fontsize=9)  # fmt: skip
        ax2.legend(fontsize=7, ncol=2)
        ax2.grid(axis="y", alpha=0.3)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("traces", __doc__, dtype=True)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--traces", default=None, help="comma-separated trace names (default: all)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, plain ('none') first")
    ap.add_argument("--rounds", type=int, default=1, help="replays of the traces (later ones tagged)")
    ap.add_argument("--replay", help="a run's JSON: score this checkout's calibrations on its evidence")
    args = ap.parse_args(argv)
    if args.replay:
        run = json.loads(Path(args.replay).read_text())
        result = {"benchmark": "traces: calibrations replayed", "evidence": args.replay,
                  "evidence_environment": run["environment"], "environment": harness.environment(),
                  "calibration": replayed(run["observations"])}  # fmt: skip
        harness.write(args.out, result)
        return 0
    harness.set_threads(args.threads)
    configs = [c for c in args.configs.split(",") if c]
    assert configs[0] == "none", "the first configuration must be the plain baseline"
    traces = workloads.traces_named(args.traces)
    t_start = time.perf_counter()
    pair = agentspec.load_pair(dtype=args.dtype)  # environment["dtype"] records what it resolved to
    assert pair.draft is not None, "the model configurations need the embedded pair's draft"
    env = harness.environment(pair)  # at the start: the git commit and dirty paths the run used
    warm = prompt_ids(pair.tokenizer, [{"role": "user", "content": "Hi"}])
    for c in configs:  # every code path once, outside the measurement and the memories
        run_call(pair, warm, c, DraftMemory(), 4)
    memories = {c: logged_memory() for c in configs}
    survival: dict[str, list] = {c: [] for c in configs}
    turns = replay(pair, traces, configs, memories, args.max_new_tokens, survival, args.rounds)
    totals = aggregate(turns, configs)
    auto = memories.get("auto")
    result = {
        "benchmark": "traces", "max_new_tokens": args.max_new_tokens, "num_draft_tokens": NUM_DRAFT_TOKENS,
        "model_every": MODEL_EVERY, "configs": configs, "traces": [t.name for t in traces],
        "rounds": args.rounds,
        "conventions": CONVENTIONS, "draft": draft_record(pair, turns),
        "learned_cost_curve": {
            "verify_ratio": [list(p) for p in auto.cost.curve()] if auto else None,
            "draft_step": auto.cost.draft_step if auto else None,
            "note": "auto's VerifyCost after the run: (n new tokens, T(n)/T(1)) and draft step / target step",
        },
        "environment": {**env, "load_average_end": list(os.getloadavg())},
        "all_identical": all(t["identical"] for t in turns), "verdict": verdict(totals, configs),
        "calibration": {c: calibration.report(r) for c, r in survival.items() if r},
        "observations": {c: {kind: cal.log for kind in KINDS
                             if (cal := getattr(m, f"{kind}_calibration")).log}
                         for c, m in memories.items()},
        "aggregate": totals,
        "by_domain": {d: aggregate([t for t in turns if t["domain"] == d], configs)
                      for d in dict.fromkeys(t["domain"] for t in turns)},
        "turns": turns, "runtime_s": time.perf_counter() - t_start,
    }  # fmt: skip
    harness.write(args.out, result)
    plot(result, args.out)
    for c, a in totals.items():
        print(f"{c:16s} {a['tokens_per_s']:6.2f} tok/s  ratio {a['speed_ratio']:5.2f} "
              f"(cpu {a['cpu_speed_ratio']:5.2f})  accept {a['acceptance_rate']:4.2f}  "
              f"len {a['mean_accepted_length']:4.2f}  {a['source_steps']}")  # fmt: skip
    print(f"verdict: {result['verdict']}; all identical: {result['all_identical']}")
    return 0 if result["all_identical"] else 1
