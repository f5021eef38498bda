"""Drafters on recorded agent traces: plain, prompt lookup, suffix, draft model (fixed / scheduled), auto.

Run from the repository root (about 11 minutes on 2 shared CPU cores, one thread):

    OMP_NUM_THREADS=1 python -m benchmarks.bench_agent_traces [--max-new-tokens 48] [--traces a,b] \
        [--dtype auto|float32|bfloat16]

Replays the conversations of ``agent_traces.py`` (inventory x2, SQL analytics, code editing,
document Q&A: 22 assistant turns over 300-1,100-token prompts) with the embedded pair, greedily.
At every assistant turn each configuration generates a reply (at most --max-new-tokens), side by
side, in an order that rotates from turn to turn so machine drift hits all alike; every reply
must equal plain decoding's token for token. Before the timed calls the turn's prompt is put in
the prefix cache (target and draft), so every configuration restores it the same way and the
timings compare decoding.

    none             plain decoding (our loop without a draft)
    prompt_lookup    n-gram lookup in the context, fixed length --k-lookup (4, the default)
    suffix           suffix trees over the request and earlier outputs (SuffixDecoding), up to --k
    model            the draft model, fixed length --k-model (2), on every --model-every (2nd) turn
    model_scheduled  the draft model, length from calibrated confidence and the verify-cost curve
    auto             per pass: the suffix draft or the scheduled draft model, whichever is worth more
    auto_no_model    ``drafter="auto"`` for a pair without a draft model (the embedded pair before its
                     distilled draft)

The fixed-length model is the slowest configuration by far; it runs on every other turn, with
length 2, to keep the run short (its ratio is against plain on the same turns; length 4 measured
0.32x on all turns in an earlier run). Auto, suffix and the scheduled model choose their own
lengths, up to --k (default: the drafter's own cap, 16, as a user gets it).

The draft model: the embedded pair's own, distilled by ``agentspec distill`` (issue 8; 2 layers on
the target's embeddings, its head cut to 8,192 ids). With --draft-layers N > 0 it is instead a
layer-skip self-draft: the target's embeddings, its first N decoder layers, final norm and LM head,
untrained, which agrees with the target on about 1-2% of tokens (``draft_agreement`` in the JSON;
untrained early exit does not work, shared/reference/anchors.md): it shows what the schedule does
with a bad draft. The earlier runs in the README used --draft-layers 4.

Each configuration has its own drafting memory (suffix tree of earlier outputs, calibrations, cost
curve), filled as its calls proceed, so no configuration sees another's outputs. Writes JSON
(--out) and a bar chart PNG next to it: tokens/s, acceptance, mean accepted length (including the
target's own token per pass), speed ratio to plain (wall and CPU time).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import torch  # noqa: E402

import agentspec  # noqa: E402
from agentspec.bench.run import add_dtype_argument, environment  # noqa: E402
from agentspec.drafters import DraftMemory, HybridDrafter, build_drafter  # noqa: E402
from agentspec.models import ModelPair  # noqa: E402
from benchmarks.agent_traces import TRACES, calls  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto", "auto_no_model")
HYBRIDS = ("auto", "auto_no_model")


def layer_skip_draft(target, n_layers: int):
    """The target's embeddings, first ``n_layers`` decoder layers, final norm and LM head (shared tensors)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    draft = AutoModelForCausalLM.from_config(config).to(target.device, target.dtype).eval()
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:n_layers])
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    draft.config.name_or_path = f"{target.config.name_or_path}:layers[:{n_layers}]"
    return draft


def run_call(pair, ids, config: str, memory: DraftMemory, n_new: int, ks: dict[str, int]) -> dict[str, Any]:
    if config == "none":
        drafter = "none"
    elif config == "auto_no_model":  # what drafter="auto" is for a pair without a draft model
        drafter = HybridDrafter(memory)
    else:
        drafter = build_drafter(pair, config, memory)
    k_draft = ks.get(config, ks["adaptive"])
    c0, t0 = time.process_time(), time.perf_counter()
    r = agentspec.generate(pair, ids, drafter, max_new_tokens=n_new, num_draft_tokens=k_draft)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = r.stats
    return {
        "tokens": r.token_ids,
        "seconds": wall,
        "cpu_seconds": cpu,
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "verify_steps": s.verify_steps,
        "acceptance_histogram": list(s.acceptance_histogram),
        "cached_tokens": s.cached_tokens,
        "source_steps": dict(s.source_steps),
        "source_draft_tokens": dict(s.source_draft_tokens),
        "source_accepted_tokens": dict(s.source_accepted_tokens),
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = sum(len(r["tokens"]) for r in rows)
    secs = sum(r["seconds"] for r in rows)
    cpu = sum(r["cpu_seconds"] for r in rows)
    drafted = sum(r["draft_tokens"] for r in rows)
    accepted = sum(r["accepted_tokens"] for r in rows)
    steps = sum(r["verify_steps"] for r in rows)
    out: dict[str, Any] = {
        "tokens": n,
        "seconds": secs,
        "tokens_per_s": n / secs,
        "tokens_per_cpu_s": n / cpu if cpu else float("nan"),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": steps,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
        "mean_draft_length": drafted / steps if steps else 0.0,
    }
    for key in ("source_steps", "source_draft_tokens", "source_accepted_tokens"):
        total: dict[str, int] = {}
        for r in rows:
            for src, v in r[key].items():
                total[src] = total.get(src, 0) + v
        out[key] = total
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    agg = result["aggregate"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1.2, 2]})
    ys = [agg[c]["tokens_per_s"] for c in configs]
    bars = ax1.bar(configs, ys, color=[f"C{j}" for j in range(len(configs))])
    for b, c in zip(bars, configs):
        a = agg[c]
        ax1.annotate(
            f"{a['speed_ratio']:.2f}x\nacc {a['acceptance_rate']:.2f}\nlen {a['mean_accepted_length']:.2f}",
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax1.set_ylabel("tokens/s (wall, per call)")
    ax1.set_title("all turns: speed, ratio to plain, acceptance, mean accepted length", fontsize=9)
    ax1.tick_params(axis="x", rotation=30, labelsize=8)
    ax1.set_ylim(top=max(ys) * 1.35)
    domains = [*result["by_domain"], "all"]
    groups = {**result["by_domain"], "all": agg}
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        vals = [groups[d].get(c, {}).get("speed_ratio", 0.0) for d in domains]
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(domains))]
        ax2.bar(xs, vals, width, label=c, color=f"C{j}")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(2.0, color="r", lw=0.8, ls="--", label="2x plain")
    ax2.set_xticks(range(len(domains)), domains)
    ax2.set_ylabel("speed ratio to plain decoding")
    env = result["environment"]
    ax2.set_title(
        f"{env['model']} greedy, {env['device']} {env['dtype']}, {env['torch_threads']} thread(s); "
        f"draft: {result['draft']['kind'].split(':')[0]}",
        fontsize=9,
    )
    ax2.legend(fontsize=7, ncol=2)
    ax2.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k-lookup", type=int, default=4, help="draft length of prompt_lookup (the default k)")
    ap.add_argument("--k-model", type=int, default=2, help="draft length of the fixed-length model")
    ap.add_argument("--k", type=int, default=None, help="cap of suffix, scheduled, auto (default: theirs)")
    ap.add_argument(
        "--draft-layers", type=int, default=0, help="> 0: an untrained layer-skip self-draft instead"
    )
    ap.add_argument(
        "--model-every", type=int, default=2, help="run the fixed-length model on every n-th turn"
    )
    ap.add_argument("--traces", default=None, help="comma-separated trace names (default: all)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/agent_traces.json")
    add_dtype_argument(ap)
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    assert configs[0] == "none", "the first configuration must be the plain baseline"
    traces = [t for t in TRACES if args.traces is None or t.name in args.traces.split(",")]
    t_start = time.perf_counter()

    base = agentspec.load_pair(dtype=args.dtype)  # environment["dtype"] records what it resolved to
    if args.draft_layers > 0 or base.draft is None:
        draft = layer_skip_draft(base.target, args.draft_layers or 4)
        kind = f"layer-skip self-draft: embeddings + first {args.draft_layers or 4} layers + norm + LM head"
        pair = ModelPair(
            target=base.target,
            tokenizer=base.tokenizer,
            draft=draft,
            name=base.name,
            draft_name=draft.config.name_or_path,
            key=(base.name, draft.config.name_or_path, str(base.dtype), str(base.device)),
            prefix_cache=base.prefix_cache,
        )
    else:
        pair, draft, kind = base, base.draft, "the embedded pair's distilled draft (agentspec distill)"
    tok = pair.tokenizer
    memories = {c: DraftMemory() for c in configs}
    env = environment(pair)  # at the start: the git commit and dirty paths the run used

    def ids_of(history):
        return list(
            tok.apply_chat_template(history, add_generation_prompt=True, return_dict=True)["input_ids"]
        )

    warm = ids_of([{"role": "user", "content": "Hi"}])
    ks = {"prompt_lookup": args.k_lookup, "model": args.k_model, "adaptive": args.k}
    for c in configs:  # warm every code path once (outside the measurement and the memories)
        run_call(pair, warm, c, DraftMemory(), 4, ks)

    turns: list[dict[str, Any]] = []
    mismatches = 0
    i = 0
    for trace in traces:
        for n, (history, recorded) in enumerate(calls(trace)):
            ids = ids_of(history)
            # the prompt into the prefix cache, for the target and the draft model alike
            agentspec.generate(pair, ids, "model", max_new_tokens=2, num_draft_tokens=1)
            here = [c for c in configs if c != "model" or i % args.model_every == 0]
            order = here[i % len(here) :] + here[: i % len(here)]
            i += 1
            rows = {c: run_call(pair, ids, c, memories[c], args.max_new_tokens, ks) for c in order}
            ref = rows["none"]["tokens"]
            diff = [c for c in here if rows[c]["tokens"] != ref]
            mismatches += len(diff)
            turns.append(
                {
                    "trace": trace.name,
                    "domain": trace.domain,
                    "turn": n,
                    "prompt_tokens": len(ids),
                    "output_tokens": len(ref),
                    "output_text": tok.decode(ref),
                    "output_token_ids": ref,  # before_after compares replies between commits by these
                    "recorded_reply": recorded["content"],
                    "identical": not diff,
                    "different": diff,
                    "configs": {c: {k: v for k, v in rows[c].items() if k != "tokens"} for c in here},
                }
            )
            line = "  ".join(f"{c}={len(rows[c]['tokens']) / rows[c]['seconds']:.1f}" for c in here)
            flag = "" if not diff else f"  DIFFERENT: {diff}"
            print(f"{trace.name}#{n} {len(ids)}+{len(ref)} tok/s: {line}{flag}", flush=True)

    def agg(selected: list[dict[str, Any]]) -> dict[str, Any]:
        """Per configuration, over the turns it ran; ratios against plain on those same turns."""
        out = {}
        for c in configs:
            ran = [t for t in selected if c in t["configs"]]
            if not ran:
                continue
            out[c] = summarise([dict(t["configs"][c], tokens=[0] * t["output_tokens"]) for t in ran])
            plain = summarise([dict(t["configs"]["none"], tokens=[0] * t["output_tokens"]) for t in ran])
            out[c]["turns"] = len(ran)
            out[c]["speed_ratio"] = out[c]["tokens_per_s"] / plain["tokens_per_s"]
            out[c]["cpu_speed_ratio"] = out[c]["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
        return out

    aggregate = agg(turns)
    by_domain = {
        d: agg([t for t in turns if t["domain"] == d]) for d in dict.fromkeys(t["domain"] for t in turns)
    }
    singles = [c for c in configs if c != "none" and c not in HYBRIDS]
    best_single = max(singles, key=lambda c: aggregate[c]["speed_ratio"]) if singles else None
    best = aggregate[best_single]["speed_ratio"] if best_single else None
    verdict: dict[str, Any] = {"best_single_drafter": best_single, "best_single_speed_ratio": best}
    for h in HYBRIDS:
        if h in aggregate:
            r = aggregate[h]["speed_ratio"]
            verdict[h] = {
                "speed_ratio": r,
                "reaches_2x": r >= 2.0,
                "margin_over_best_single": r / best - 1 if best else None,  # +0.05 = 5% faster
            }
    auto_memory = memories.get("auto")
    # the draft's first token is accepted iff its argmax equals the target's: fixed-model passes
    first = [0, 0]
    for t in turns:
        hist = t["configs"].get("model", {}).get("acceptance_histogram", [])
        first[0] += sum(hist[1:])
        first[1] += sum(hist)

    result = {
        "benchmark": "agent_traces",
        "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": ks,
        "model_every": args.model_every,
        "configs": configs,
        "traces": [t.name for t in traces],
        "conventions": {
            "tokens_per_s": "output tokens / wall time of the calls (prompt restored from the prefix cache)",
            "speed_ratio": "tokens_per_s / tokens_per_s of 'none' (plain decoding) over the same turns",
            "cpu_speed_ratio": "the same with CPU time of this process instead of wall time",
            "acceptance_rate": "accepted draft tokens / draft tokens verified",
            "mean_accepted_length": "(accepted + verify_steps) / verify_steps: tokens per target pass",
            "source_steps": "verify passes per draft source (auto: suffix / model / none)",
        },
        "draft": {
            "name": draft.config.name_or_path,
            "kind": kind,
            "draft_agreement": first[0] / first[1] if first[1] else None,
            "draft_agreement_note": "share of the fixed-length model's verify passes whose first draft "
            "token was accepted: positions where the draft's argmax equals the target's",
        },
        "learned_cost_curve": {
            "verify_ratio": [list(p) for p in auto_memory.cost.curve()] if auto_memory else None,
            "draft_step": auto_memory.cost.draft_step if auto_memory else None,
            "note": "auto's VerifyCost after the run: (n new tokens, T(n)/T(1)) and draft step / target step",
        },
        "environment": {**env, "load_average_end": list(os.getloadavg())},
        "all_identical": mismatches == 0,
        "verdict": verdict,
        "aggregate": aggregate,
        "by_domain": by_domain,
        "turns": turns,
        "runtime_s": time.perf_counter() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))

    print(f"\n{'config':16s} {'tok/s':>6s} {'ratio':>6s} {'cpu':>6s} {'accept':>6s} {'len':>5s} sources")
    for c in configs:
        a = aggregate[c]
        print(
            f"{c:16s} {a['tokens_per_s']:6.2f} {a['speed_ratio']:6.2f} {a['cpu_speed_ratio']:6.2f} "
            f"{a['acceptance_rate']:6.2f} {a['mean_accepted_length']:5.2f} {a['source_steps']}"
        )
    print(f"verdict: {verdict}")
    print(f"draft agreement {result['draft']['draft_agreement']}; identical outputs: {mismatches == 0}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {result['runtime_s']:.0f} s")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
