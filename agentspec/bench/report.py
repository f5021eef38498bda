"""From raw measurements to figures: summaries, goals, a Markdown table and PNG plots.

The agent loop's summary, goal and plot live with its rows (the loop suite, ``benchmarks/loop.py``),
which reuse ``goal_rows``, ``fmt`` and ``finish_plot``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The single-call goals, as (key, what, threshold): ratios measured in the same run.
GOALS = (
    ("single_vs_assisted", "single calls: agentspec auto vs transformers assisted (same draft)", 1.3),
    ("agent_turns_vs_generate", "agent turns: agentspec auto vs plain transformers generate()", 2.0),
)


def acceptance_by_position(passes: list[tuple[int, int]], positions: int = 16) -> list[float | None]:
    """P(draft token i accepted | the pass drafted at least i+1 tokens), i = 0..positions-1."""
    out: list[float | None] = []
    for i in range(positions):
        drafted = [a for d, a in passes if d > i]
        out.append(sum(a > i for a in drafted) / len(drafted) if drafted else None)
    return out


def summarise_single(rows: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    """tokens/s per system and prompt kind (total tokens over total seconds), ratios, acceptance."""
    out: dict[str, Any] = {}
    for kind in ("chat", "agent", "all"):
        part = [r for r in rows if kind == "all" or r["kind"] == kind]
        if not part:
            continue
        per: dict[str, Any] = {}
        for s in systems:
            tokens = sum(len(r["runs"][s]["tokens"]) for r in part)
            seconds = sum(r["runs"][s]["seconds"] for r in part)
            per[s] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        for s in systems:
            for ref in ("transformers generate", "transformers assisted"):
                if ref in per:
                    per[s][f"speedup_vs_{ref.split()[-1]}"] = per[ref]["seconds"] / per[s]["seconds"]
        out[kind] = per
    out["identical_to_generate"] = {s: all(r["runs"][s]["identical"] for r in rows) for s in systems}
    out["acceptance_by_position"] = {
        s: acceptance_by_position([tuple(p) for r in rows for p in r["runs"][s]["passes"]])
        for s in systems
        if any(r["runs"][s]["passes"] for r in rows)
    }
    return out


def goal_rows(goals: tuple[tuple[str, str, float], ...], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per goal: what, its threshold, the measured figure (None: not measured) and whether met."""
    return [
        {
            "goal": what,
            "threshold": t,
            "measured": measured[key],
            "met": measured[key] is not None and measured[key] >= t,
        }
        for key, what, t in goals
    ]


def goals(single: dict[str, Any]) -> list[dict[str, Any]]:
    measured = {
        "single_vs_assisted": single["all"].get("agentspec auto", {}).get("speedup_vs_assisted"),
        "agent_turns_vs_generate": single.get("agent", {})
        .get("agentspec auto", {})
        .get("speedup_vs_generate"),
    }
    return goal_rows(GOALS, measured)


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def where(env: dict[str, Any]) -> str:
    """The models, machine and commit a run measured, for a report's first line."""
    return (
        f"{env['model']} (draft {env.get('draft_model') or 'none'}) on {env['cpu_model']} "
        f"({env['device']}, {env['dtype']}, "
        f"{env['torch_threads']} threads), commit {env.get('git_commit') or '?'}"
        f"{' (dirty)' if env.get('git_dirty_paths') else ''}"
    )


def goals_table(rows: list[dict[str, Any]]) -> list[str]:
    """The "## Goals" section's lines, a table of ``goal_rows``."""
    lines = ["## Goals", "", "| goal | needed | measured | met |", "| --- | --- | --- | --- |"]
    for g in rows:
        lines.append(
            f"| {g['goal']} | {g['threshold']:.1f}x | {fmt(g['measured'])}x | {'yes' if g['met'] else 'no'} |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    single, settings = result["single"], result["settings"]
    lines = [
        "# agentspec bench",
        "",
        f"{where(result['environment'])}; mode {settings['mode']}, {settings['max_new_tokens']} new "
        "tokens per single call. Greedy throughout; systems interleaved per prompt.",
        "",
        *goals_table(result["goals"]),
        "",
        "## Single calls (tokens/s; speed-up = time of the reference / time of the row)",
        "",
        "| system | chat tok/s | agent tok/s | vs generate (agent) | vs assisted (all) "
        "| same tokens as generate |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in result["single_systems"]:
        chat, agent, allp = (single.get(k, {}).get(s, {}) for k in ("chat", "agent", "all"))
        lines.append(
            f"| {s} | {fmt(chat.get('tokens_per_s'), 1)} | {fmt(agent.get('tokens_per_s'), 1)} | "
            f"{fmt(agent.get('speedup_vs_generate'))}x | {fmt(allp.get('speedup_vs_assisted'))}x | "
            f"{'yes' if single['identical_to_generate'][s] else 'NO'} |"
        )
    if result.get("llama_cpp"):
        lc = result["llama_cpp"]
        lines += ["", "## llama.cpp (outside reference, not mixed into the rows above)", ""]
        if "tokens_per_s" in lc:
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in lc["tokens_per_s_by_kind"].items())
            same = lc["same_tokens_as_generate"]
            lines.append(
                f"{lc['tokens_per_s']:.1f} tokens/s on the same prompts ({kinds}; {lc['gguf']}, Q4_1 "
                f"weights, {lc['threads']} threads); the same tokens as `generate()` on {sum(same)} of "
                f"{len(same)} prompts (quantised arithmetic)."
            )
        else:
            lines.append(lc["status"])
    roof = result["roofline"]
    lines += [
        "",
        "## Roofline",
        "",
        f"Read bandwidth {roof['bandwidth']['median_gb_s']:.1f} GB/s "
        f"({roof['bandwidth']['threads']} threads).",
        "",
        "| model | MB read per step | bound ms | measured ms | fraction of bound |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, m in roof["models"].items():
        lines.append(
            f"| {name} | {m['bytes_per_step'] / 1e6:.0f} | {m['bound_ms']:.1f} | {m['step_ms']:.1f} | "
            f"{m['fraction_of_bound']:.2f} |"
        )
    curve = roof["models"]["target"]["verify_cost"]["points"]
    lines += [
        "",
        "Verify cost T(k)/T(1): " + ", ".join(f"k={p['new_tokens']}: {p['ratio_to_1']:.2f}" for p in curve),
    ]
    return "\n".join(lines) + "\n"


def finish_plot(fig, ax, title: str, xlabel: str | None, ylabel: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(result: dict[str, Any], folder: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    single, systems = result["single"], result["single_systems"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.4
    for j, kind in enumerate(("chat", "agent")):
        vals = [single.get(kind, {}).get(s, {}).get("tokens_per_s", 0) for s in systems]
        ax.bar([i + (j - 0.5) * width for i in range(len(systems))], vals, width, label=f"{kind} prompts")
    ax.set_xticks(range(len(systems)), [s.replace(" ", "\n", 1) for s in systems], fontsize=8)
    title, path = "Single calls: tokens/s per system", folder / f"{stem}_tokens_per_s.png"
    paths.append(finish_plot(fig, ax, title, None, "tokens/s (single calls, greedy)", path))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s, rates in single["acceptance_by_position"].items():
        xs = [i + 1 for i, r in enumerate(rates) if r is not None]
        ax.plot(xs, [r for r in rates if r is not None], marker=".", label=s)
    ax.set_ylim(0, 1)
    title, path = "Acceptance by draft position (single calls)", folder / f"{stem}_acceptance.png"
    paths.append(finish_plot(fig, ax, title, "draft position", "P(accepted | drafted)", path))
    return paths
