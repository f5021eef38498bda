"""The device check: how fast the product runs on one GPU and whether it is right, in one command of
at most 5 minutes by its own budget, the most valuable figures first.

    python -m benchmarks gpu-check [--device cuda|cpu] [--quick] [--budget-s 270] [--out FILE]

On a lent GPU machine: ``bash scripts/gpu_check.sh`` (``make gpu-check``) installs the carried wheels,
runs this and then trains the embedded pair's EAGLE-3 head (docs/benchmarks.md, "gpu-check").
``--device cpu --quick`` runs every phase on toy sizes (a minute or two on 2 cores), as the tests do.

The models have random weights of Qwen2.5-7B's and -0.5B's shapes (``benchmarks.gpu_setup``); a
replay drafter stands in for a trained draft, at a set acceptance per position, paying a real draft
step per token through the pair's own draft forward. The JSON is rewritten as each phase starts and
ends, so a run cut short keeps what it measured; phases past ``--budget-s`` skip themselves. In order:

- end_to_end: batch 1. Tokens/s of ``generate()``, agentspec without drafts, and with the replay
  drafter at acceptance 0.8 and 0.5 (identical outputs checked); then what a replay call ran, per
  pass: host reads (``HostSyncs``), CUDA's own synchronisations (its sync debug mode and the
  profiler's runtime calls), kernels launched, the attention kernel SDPA took.
- batched: batch 8 drafting. Eight calls at once share each pass, plain and with replay drafters at
  0.8: tokens/s, drafted and accepted tokens, calls per pass, outputs against the plain batch; and
  what a pass ran, as above.
- identity: tokens against ``generate()`` for every drafter (``model``, ``auto`` also with the static
  draft cache), with and without the prefix cache, in float32 (full-precision products pinned) and
  bfloat16, on a small target with a sharpened head; each divergence with the float32 target's logit
  margin top1 - top2 there (near-ties may flip in bfloat16).
- syncs: host reads per verify pass for each drafter the product ships.
- roofline: the verify-cost curve of the 7B-shaped target's pass against its floor, weight bytes over
  the read bandwidth measured on the device, and the draft's step against its own.
- profile: each kind of pass (prefill, decode, verify, the draft's step) by op category, kernels, the
  attention kernel.
- prefix_cache: restore times, time to first token cold and cached, peak memory.
- assisted: transformers assisted generation's cost per pass (it cannot take the replay drafter), set
  beside the replay rows at equal acceptance.
- compiled_verify, compiled: the target's verify pass compiled over agentspec's static state, then
  compiled static-cache ``generate()`` and compiled steps: last, since a first compile takes a minute.

``goals`` holds the figures a full CUDA run is judged by ("met" is null for any other run).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: the checkout's packages

import torch

from agentspec.bench import runs
from agentspec.bench.replay import ReplayDrafter, expected_tokens_per_pass
from agentspec.bench.syncs import HostSyncs
from agentspec.bench.together import start_together
from benchmarks import gpu_phases, harness
from benchmarks.gpu_phases import ACCEPTANCES
from benchmarks.gpu_setup import Plan, Report, Speed, hf_greedy, speculate, timed

BATCH = 8  # calls at once in the batched phase
RAN_TOKENS = 16  # tokens per call of the runs that count what a pass ran (profiled, not timed)


def what_ran(pair, run) -> dict[str, Any]:
    """What ``run()`` (a function returning Steps, or lists of them) ran in the pair's passes, per pass:
    host reads by tensor method, the syncs CUDA reported, and the profiler's counts."""
    with HostSyncs(pair) as syncs, runs.in_passes(pair) as ran:
        before = pair.scheduler.stats.passes
        run()
    n = max(pair.scheduler.stats.passes - before, 1)
    cuda = pair.device.type == "cuda"
    return ran.per(n) | {
        "host_reads_per_pass": syncs.count / n,
        "cuda_reported_syncs_per_pass": syncs.cuda / n if cuda else None,
        "host_reads_where": dict(syncs.where.most_common(6)),
    }


def replay_drafter(speed: Speed, reference: list[int], acceptance: float, seed: int = 0) -> ReplayDrafter:
    """A replay drafter on the pair's own draft forward (the lean one the product's draft steps run)."""
    p = speed.plan
    return ReplayDrafter(speed.pair.draft_forward, reference, acceptance, seed, p.k, p.draft["vocab_size"])


def replay_row(speed: Speed, acceptance: float) -> dict[str, Any]:
    pair, p = speed.pair, speed.plan
    drafter = replay_drafter(speed, speed.ids + speed.ref, acceptance)
    call = lambda: speculate(pair, speed.ids, "replay", p.e2e_tokens, drafter=drafter)  # noqa: E731
    (out, steps), s = timed(call, p.device)
    n = sum(st.target_pass for st in steps)
    # "acceptance" is per position; a pass stops at its first miss, so accepted/drafted is lower
    return {
        "seconds": s,
        "tokens_per_s": len(out) / s,
        "identical": out == speed.ref,
        "passes": n,
        "per_pass_ms": s / n * 1e3,
        "tokens_per_pass": len(out) / n,
        "tokens_per_pass_expected": expected_tokens_per_pass(acceptance, p.k),
        "drafted": sum(st.drafted for st in steps),
        "accepted": sum(st.accepted for st in steps),
    }


def phase_end_to_end(speed: Speed) -> dict[str, Any]:
    pair, p = speed.pair, speed.plan
    hf_greedy(pair.target, speed.ids[:16], 4)  # warm-up
    speculate(pair, speed.ids[:16], "none", 4)
    speed.ref, s = timed(lambda: hf_greedy(pair.target, speed.ids, p.e2e_tokens), p.device)
    rows: dict[str, Any] = {"transformers generate": {"seconds": s, "tokens_per_s": len(speed.ref) / s}}
    (out, _), s = timed(lambda: speculate(pair, speed.ids, "none", p.e2e_tokens), p.device)
    rows["agentspec none"] = {"seconds": s, "tokens_per_s": len(out) / s, "identical": out == speed.ref}
    speculate(pair, speed.ids, "replay", 4, drafter=replay_drafter(speed, speed.ids + speed.ref, 1.0))
    for a in ACCEPTANCES:
        row = rows[f"agentspec replay {a}"] = replay_row(speed, a)
        row["speedup_vs_generate"] = rows["transformers generate"]["seconds"] / row["seconds"]
    speed.rows = rows
    drafter = replay_drafter(speed, speed.ids + speed.ref, ACCEPTANCES[0])
    ran = what_ran(pair, lambda: speculate(pair, speed.ids, "replay", RAN_TOKENS, drafter=drafter))
    return {"rows": rows, "k": p.k, "ran_replay": ran}


def batch_of(speed: Speed, prompts: list[list[int]], n: int, drafters=None) -> list[tuple[list[int], list]]:
    """``prompts`` decoded at once on the speed pair (each call joins before the first pass), each
    with its drafter where ``drafters`` gives one: (output, steps) per call."""
    calls = [
        lambda i=i: speculate(
            speed.pair,
            prompts[i],
            "replay" if drafters else "none",
            n,
            drafter=drafters[i] if drafters else None,
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    results = start_together(speed.pair, calls)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return results


def batch_row(speed: Speed, prompts, n: int, drafters=None) -> tuple[dict[str, Any], list[list[int]]]:
    pair = speed.pair
    before = dataclasses.replace(pair.scheduler.stats)
    results, s = timed(lambda: batch_of(speed, prompts, n, drafters), speed.plan.device)
    st = pair.scheduler.stats
    passes = st.passes - before.passes
    outs = [out for out, _ in results]
    steps = [step for _, call in results for step in call]
    row = {"seconds": s, "tokens_per_s": sum(map(len, outs)) / s, "passes": passes,
           "calls_per_pass": (st.members - before.members) / passes,
           "drafted": sum(x.drafted for x in steps), "accepted": sum(x.accepted for x in steps),
           "draft_passes": st.draft_passes - before.draft_passes}  # fmt: skip
    return row, outs


def phase_batched(speed: Speed) -> dict[str, Any]:
    """BATCH calls at once on the speed pair share each pass (one forward over all their rows), plain
    and with replay drafters at the first acceptance: tokens/s, drafted and accepted, calls per pass;
    the drafting batch's outputs against the plain batch's (bfloat16: packed passes of other shapes
    may round differently; counted), and what a pass of each ran."""
    pair, p = speed.pair, speed.plan
    n = p.batch_tokens
    prompts = [speed.ids[i:] + speed.ids[:i] for i in range(BATCH)]  # one length, all distinct
    batch_of(speed, prompts, 4)  # warm-up
    rows: dict[str, Any] = {}
    rows["plain"], plain = batch_row(speed, prompts, n)
    a = ACCEPTANCES[0]
    drafters = [replay_drafter(speed, prompts[i] + plain[i], a, seed=i) for i in range(BATCH)]
    rows[f"replay {a}"], outs = batch_row(speed, prompts, n, drafters)
    rows[f"replay {a}"]["identical_to_plain"] = sum(o == r for o, r in zip(outs, plain))
    rows[f"replay {a}"]["speedup_vs_plain"] = rows["plain"]["seconds"] / rows[f"replay {a}"]["seconds"]
    short = [q[:RAN_TOKENS] for q in plain]
    ran_plain = what_ran(pair, lambda: batch_of(speed, prompts, RAN_TOKENS))
    drafters = [replay_drafter(speed, prompts[i] + short[i], a, seed=i) for i in range(BATCH)]
    ran_replay = what_ran(pair, lambda: batch_of(speed, prompts, RAN_TOKENS, drafters))
    return {"calls": BATCH, "new_tokens": n, "prompt_tokens": len(prompts[0]), "rows": rows,
            "ran_plain": ran_plain, "ran_replay": ran_replay}  # fmt: skip


# the goals on one H200, at acceptance 0.8 with the 7B/0.5B-shaped pair: (what, threshold)
GOALS = {
    "vs_generate": ("agentspec replay 0.8 vs eager generate(), batch 1", 2.5),
    "vs_static_compiled": ("agentspec replay 0.8 vs compiled static-cache generate()", 1.8),
    "vs_assisted": ("agentspec replay 0.8 vs transformers assisted (per-pass costs, projected)", 1.3),
    "identity_float32": ("greedy float32 token-identical everywhere (measured: true or false)", 1.0),
}


def goals(phases: dict[str, Any], judged: bool) -> dict[str, Any]:
    """Each goal's measured figure (None where its phase did not run) and whether it is met;
    unless ``judged`` (a full run on CUDA), "met" is None: toy models on a CPU meet nothing."""
    e2e, compiled = phases.get("end_to_end", {}), phases.get("compiled", {})
    assisted = phases.get("assisted", {}).get("vs_assisted_at_equal_acceptance", {}).get("0.8", {})
    measured = {
        "vs_generate": e2e.get("rows", {}).get("agentspec replay 0.8", {}).get("speedup_vs_generate"),
        "vs_static_compiled": compiled.get("static_generate", {}).get("replay_0.8_speedup"),
        "vs_assisted": assisted.get("speedup_vs_assisted_projected"),
        "identity_float32": phases.get("identity", {}).get("identical_float32"),
    }
    out = {}
    for key, (what, t) in GOALS.items():
        m = measured[key]
        met = (m is not None and m >= t) if judged else None
        out[key] = {"goal": what, "threshold": t, "measured": m, "met": met}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("gpu_check", __doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="toy sizes: the same phases in 1-3 minutes on a CPU")
    ap.add_argument("--budget-s", type=float, default=270.0, help="phases and parts past this are skipped")
    args = ap.parse_args(argv)
    harness.set_threads(args.threads)
    plan = Plan.make(torch.device(args.device), args.quick, args.budget_s)
    report, speed = Report(args.out, plan), Speed(plan)
    report.phase("end_to_end", lambda: phase_end_to_end(speed))
    report.phase("batched", lambda: phase_batched(speed))
    report.phase("identity", lambda: gpu_phases.phase_identity(plan))
    report.phase("syncs", lambda: gpu_phases.phase_syncs(plan))
    report.phase("roofline", lambda: gpu_phases.phase_roofline(speed))
    report.phase("profile", lambda: gpu_phases.phase_profile(speed))
    report.phase("prefix_cache", lambda: gpu_phases.phase_prefix_cache(speed))
    report.phase("assisted", lambda: gpu_phases.phase_assisted(speed))
    report.phase("compiled_verify", lambda: gpu_phases.phase_compiled_verify(speed, report))
    report.phase("compiled", lambda: gpu_phases.phase_compiled(speed, report))
    phases = report.data["phases"]
    report.data["goals"] = goals(phases, judged=plan.device.type == "cuda" and not plan.quick)
    harness.write(args.out, report.data)
    print(json.dumps({k: v["status"] for k, v in phases.items()}))
    return 0 if all(v["status"] == "ok" for v in phases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
