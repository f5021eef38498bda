"""The distilled default draft, measured: acceptance, draft cost, speed on open-ended chat.

Run from the repository root (about 15 minutes on 2 cores; --quick about 4):

    python -m benchmarks.bench_distilled                    # the embedded target and its default draft
    python -m benchmarks.bench_distilled --draft <folder>   # a folder written by `agentspec distill`

Three measurements, each on prompts no training step saw:

1. Acceptance against the target at temperature 0 and 0.7: ``drafter="model"`` with 4-token drafts
   on held-out prompts of ``agentspec.distill.prompts`` (chat and agent turns; the held-out split is
   the pipeline's, by a hash of each prompt's content). Reported per kind: ``token_acceptance``, the
   chance that a draft token is accepted once those before it were (alpha in Leviathan et al.:
   accepted / (accepted + passes that ended on a rejection)); ``acceptance_rate``, accepted /
   drafted tokens (with 4-token drafts at most (a + a^2 + a^3 + a^4) / 4); and mean tokens accepted
   per verify pass. At temperature 0 every output is also
   compared token for token with plain decoding; a difference is reported and fails the run.
2. Draft cost: the median time of one draft step and one target step, each after a 300-token
   cache, measured alternately; also the draft with its full LM head, to show what the cut head saves.
   With the verify-cost curve V(n) (a target pass over n new tokens / a one-token pass, from
   bench_core.verify_cost), the cost model of Leviathan et al. gives, per draft length k, the token
   acceptance a draft of this cost needs for 1x and for 1.5x: (1 - a^(k+1)) / (1 - a) tokens per
   pass against k c + V(k+1) target steps.
3. Speed on open-ended chat (where lookup-style drafters find nothing): the three chat prompts of
   ``bench_core.py`` (written apart from the generator) and held-out generator chat prompts, greedy,
   decoded plainly and with ``drafter="model"``, ``"model_scheduled"`` and ``"auto"``, and with auto
   as it is for a pair without a draft model (``auto_no_model``: suffix trees alone, the embedded
   pair before this draft), interleaved per prompt with a rotating order; the ratio is plain time /
   mode time over the same prompts.

Writes JSON (--out) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_core.py

import torch  # noqa: E402

import agentspec  # noqa: E402
from agentspec.distill.prompts import is_heldout, make_prompts, render  # noqa: E402
from agentspec.drafters import DraftMemory, HybridDrafter  # noqa: E402
from agentspec.drafters.eagle import is_eagle  # noqa: E402
from benchmarks.bench_core import PROMPTS as CORE_PROMPTS  # noqa: E402
from benchmarks.bench_core import environment, verify_cost  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NO_REUSE = {"prefix_cache": False}  # every call prefills its prompt: decoding alone is compared


def heldout_prompts(tokenizer, kinds: tuple[str, ...], per_kind: int, skip: int = 0) -> list[dict]:
    """Held-out prompts of the default recipe (2,000 prompts, seed 0, fraction 0.1), per kind.

    ``skip``: held-out prompts of each kind passed over first (the pipeline's own evaluation uses the
    first 48 held-out prompts; the speed part takes later ones so the parts do not share prompts).
    """
    from agentspec.distill.config import DistillConfig

    cfg = DistillConfig()
    out: dict[str, list[dict]] = {k: [] for k in kinds}
    seen: dict[str, int] = {k: 0 for k in kinds}
    for spec in make_prompts(cfg.n_prompts, cfg.seed):
        if spec.kind not in out or not is_heldout(spec.key(), cfg.heldout_fraction):
            continue
        seen[spec.kind] += 1
        if seen[spec.kind] > skip and len(out[spec.kind]) < per_kind:
            out[spec.kind].append({"name": f"{spec.kind}_{seen[spec.kind]}", "kind": spec.kind,
                                   "ids": render(tokenizer, spec)})  # fmt: skip
    return [p for k in kinds for p in out[k]]


def acceptance(pair, prompts: list[dict], temperature: float, n: int, k: int) -> dict[str, Any]:
    rows = []
    for i, p in enumerate(prompts):
        opts: dict[str, Any] = {"max_new_tokens": n, "temperature": temperature, **NO_REUSE}
        if temperature > 0:
            opts["seed"] = 1000 + i
        spec = agentspec.generate(pair, p["ids"], drafter="model", num_draft_tokens=k, **opts)
        row = {"name": p["name"], "kind": p["kind"], "output_tokens": spec.stats.output_tokens,
               "draft_tokens": spec.stats.draft_tokens, "accepted_tokens": spec.stats.accepted_tokens,
               "verify_steps": spec.stats.verify_steps,
               "histogram": list(spec.stats.acceptance_histogram)}  # fmt: skip
        if temperature == 0:
            plain = agentspec.generate(pair, p["ids"], speculative=False, **opts)
            row["identical_to_plain"] = plain.token_ids == spec.token_ids
        rows.append(row)
        print(f"  T={temperature} {p['name']}: {row['accepted_tokens']}/{row['draft_tokens']}", flush=True)
    return {"rows": rows, "by_kind": _rates(rows), "all": _rates(rows, by_kind=False)["all"]}


def _rates(rows: list[dict], by_kind: bool = True) -> dict[str, dict]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["kind"] if by_kind else "all", []).append(r)
    out = {}
    for key, rs in groups.items():
        drafted, accepted = sum(r["draft_tokens"] for r in rs), sum(r["accepted_tokens"] for r in rs)
        steps = sum(r["verify_steps"] for r in rs)
        # passes that ended on a rejected token: all but those that accepted a full 4-token draft
        # (a draft cut short by the token limit counts as rejected: slightly pessimistic)
        rejections = sum(sum(r["histogram"][:4]) for r in rs)
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

    An EAGLE head's step is its own (one token and the target's feature in, its LM head out): the
    feature comes free with the target's verify pass.
    """
    from transformers import DynamicCache

    eagle = is_eagle(pair.draft)
    full = pair.target.get_output_embeddings()
    cut = pair.draft.get_output_embeddings()
    x = torch.tensor([ids], device=pair.device)
    one = torch.tensor([[ids[-1]]], device=pair.device)
    with torch.inference_mode():
        caches = {"target": DynamicCache()}
        pair.target(input_ids=x, cache=caches["target"], use_cache=True)
        if eagle:
            caches["draft"] = DynamicCache(config=pair.draft.decoder.config)
            feats = torch.zeros((1, len(ids), pair.draft.config.hidden_size), dtype=pair.dtype)
            pair.draft.hidden(feats, x, caches["draft"])
        else:
            caches["draft"] = DynamicCache()
            pair.draft(input_ids=x, cache=caches["draft"], use_cache=True)

        def draft_step() -> None:
            if eagle:
                pair.draft(feats[:, -1:], one, caches["draft"])
            else:
                pair.draft(input_ids=one, cache=caches["draft"], use_cache=True)

        times: dict[str, list[float]] = {"target": [], "draft": [], "draft_full_head": []}
        for _ in range(repeats):
            for name in times:
                if name == "draft_full_head":
                    pair.draft.set_output_embeddings(full)
                t = time.perf_counter()
                if name == "target":
                    pair.target(input_ids=one, cache=caches["target"], use_cache=True)
                else:
                    draft_step()
                times[name].append(time.perf_counter() - t)
                caches["target" if name == "target" else "draft"].crop(-1)
                pair.draft.set_output_embeddings(cut)
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    return {
        **{f"{name}_ms": v for name, v in ms.items()},
        "draft_per_target": ms["draft"] / ms["target"],
        "draft_full_head_per_target": ms["draft_full_head"] / ms["target"],
    }


def expected_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Tokens per pass over its cost in target steps: (1 - a^(k+1)) / (1 - a) / (k c + V(k+1))."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


def alpha_needed(goal: float, k: int, c: float, v: float) -> float | None:
    """The token acceptance at which ``expected_speedup`` reaches ``goal`` (None: not even at 1)."""
    if expected_speedup(1.0, k, c, v) < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_speedup(mid, k, c, v) < goal else (lo, mid)
    return hi


def cost_model(curve: dict[str, Any], c: float) -> dict[str, Any]:
    """Per draft length: the acceptance a draft of cost ``c`` needs for 1x and 1.5x, given V(k+1)."""
    ratio = {p["new_tokens"]: p["ratio_to_1"] for p in curve["points"]}
    rows = []
    for k in sorted(ratio):
        if k - 1 < 1:
            continue
        v = ratio[k]  # a pass verifying k - 1 draft tokens feeds k new tokens
        rows.append({"draft_tokens": k - 1, "verify_ratio": v, "alpha_for_1x": alpha_needed(1.0, k - 1, c, v),
                     "alpha_for_1.5x": alpha_needed(1.5, k - 1, c, v)})  # fmt: skip
    return {"draft_per_target": c, "rows": rows}


def speed(pair, prompts: list[dict], n: int, modes: list[str]) -> dict[str, Any]:
    runs: dict[str, list[dict]] = {m: [] for m in ["plain", *modes]}
    no_model_memory = DraftMemory()  # its own suffix tree and calibrations, filled as its calls run
    for i, p in enumerate(prompts):
        order = ["plain", *modes]
        order = order[i % len(order) :] + order[: i % len(order)]
        outputs = {}
        for mode in order:
            opts = {"max_new_tokens": n, **NO_REUSE}
            t = time.perf_counter()
            if mode == "plain":
                r = agentspec.generate(pair, p["ids"], speculative=False, **opts)
            elif mode == "auto_no_model":  # auto as for a pair without a draft model (suffix trees)
                r = agentspec.generate(pair, p["ids"], drafter=HybridDrafter(no_model_memory), **opts)
            else:
                r = agentspec.generate(pair, p["ids"], drafter=mode, **opts)
            seconds = time.perf_counter() - t
            outputs[mode] = r.token_ids
            runs[mode].append({"name": p["name"], "seconds": seconds, "tokens": len(r.token_ids),
                               "draft_tokens": r.stats.draft_tokens,
                               "accepted_tokens": r.stats.accepted_tokens,
                               "verify_steps": r.stats.verify_steps})  # fmt: skip
        differ = [m for m in modes if outputs[m] != outputs["plain"]]
        print(f"  {p['name']}: " + ", ".join(f"{m} {runs[m][-1]['seconds']:.1f}s" for m in order)
              + (f"  DIFFERS: {differ}" if differ else ""), flush=True)  # fmt: skip
        for m in differ:
            runs[m][-1]["differs_from_plain"] = True
    plain_s = sum(r["seconds"] for r in runs["plain"])
    summary = {}
    for m, rs in runs.items():
        s = sum(r["seconds"] for r in rs)
        drafted, accepted = sum(r["draft_tokens"] for r in rs), sum(r["accepted_tokens"] for r in rs)
        summary[m] = {
            "seconds": s,
            "tokens": sum(r["tokens"] for r in rs),
            "speedup_vs_plain": plain_s / s,
            "acceptance_rate": accepted / drafted if drafted else None,
            "differs_from_plain": sum(bool(r.get("differs_from_plain")) for r in rs),
        }
    return {"runs": runs, "summary": summary}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for t_key, offset in (("t0", -0.2), ("t0.7", 0.2)):
        by_kind = result["acceptance"][t_key]["by_kind"]
        kinds = sorted(by_kind)
        a1.bar([i + offset for i in range(len(kinds))], [by_kind[k]["token_acceptance"] or 0 for k in kinds],
               width=0.4, label=f"temperature {t_key[1:]}")  # fmt: skip
        a1.set_xticks(range(len(kinds)), kinds)
    a1.axhline(0.6, color="grey", linestyle="--", linewidth=1, label="goal 0.6")
    a1.set_ylabel("token acceptance alpha (4-token drafts)")
    a1.set_title("Held-out acceptance of the distilled draft")
    a1.legend()
    s = result["speed"]["summary"]
    modes = list(s)
    a2.bar(modes, [s[m]["speedup_vs_plain"] for m in modes], color="tab:green")
    a2.axhline(1.0, color="grey", linewidth=1)
    a2.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="goal 1.5x")
    a2.set_ylabel("speed vs plain decoding")
    a2.set_title("Open-ended chat, greedy")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="a distilled draft folder (default: the embedded one)")
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    ap.add_argument("--per-kind", type=int, help="held-out prompts per kind (default 8; --quick 3)")
    ap.add_argument("--max-new-tokens", type=int, help="default 96 (--quick 48)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/distilled.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pair = agentspec.load_pair(draft_model=args.draft) if args.draft else agentspec.load_pair()
    if pair.draft is None:
        raise SystemExit("no draft model in the pair: pass --draft <folder>")
    tok = pair.tokenizer
    per_kind, n = (3, 48) if args.quick else (8, 96)
    per_kind, n = args.per_kind or per_kind, args.max_new_tokens or n
    kinds = ("chat", "agent", "tool_result", "instruction")
    acc_prompts = heldout_prompts(tok, kinds, per_kind)
    result: dict[str, Any] = {"environment": environment(pair), "draft": pair.draft_name,
                              "max_new_tokens": n, "draft_tokens_per_pass": 4}  # fmt: skip
    t0 = time.perf_counter()
    result["acceptance"] = {f"t{t:g}": acceptance(pair, acc_prompts, t, n, 4) for t in (0.0, 0.7)}
    result["step_costs"] = step_costs(pair, acc_prompts[0]["ids"][:300], 10 if args.quick else 30)
    print("step costs:", {k: round(v, 3) for k, v in result["step_costs"].items()}, flush=True)
    result["verify_cost"] = verify_cost(pair, [1, 2, 3, 4, 5, 7, 9], 300, 5 if args.quick else 15)
    result["cost_model"] = cost_model(result["verify_cost"], result["step_costs"]["draft_per_target"])
    print("acceptance needed:", result["cost_model"]["rows"], flush=True)
    chat = [{"name": name, "kind": "chat",
             "ids": tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]}
            for name, kind, msgs in CORE_PROMPTS if kind == "chat"]  # fmt: skip
    chat += heldout_prompts(tok, ("chat",), 2 if args.quick else 5, skip=per_kind)
    modes = ["model", "model_scheduled", "auto", "auto_no_model"]
    result["speed"] = speed(pair, chat, n, modes)
    result["seconds"] = time.perf_counter() - t0
    bad = sum(not r.get("identical_to_plain", True) for r in result["acceptance"]["t0"]["rows"])
    bad += sum(v["differs_from_plain"] for v in result["speed"]["summary"].values())
    result["outputs_differing_from_plain"] = bad
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for t_key, a in result["acceptance"].items():
        print(f"token acceptance {t_key}: all {a['all']['token_acceptance']:.3f}; "
              + ", ".join(f"{k} {v['token_acceptance']:.3f}" for k, v in a["by_kind"].items())
              + f"; accepted/drafted {a['all']['acceptance_rate']:.3f}")  # fmt: skip
    summary = result["speed"]["summary"]
    print("speed vs plain:", {m: round(v["speedup_vs_plain"], 3) for m, v in summary.items()})
    print(f"wrote {out} ({result['seconds']:.0f} s); outputs differing from plain: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
