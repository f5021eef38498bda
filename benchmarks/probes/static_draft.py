"""The draft's one-token step and a verify-width pass: DynamicCache vs static cache, eager vs compiled.

Run from the repository root (a few minutes on a CPU: compiling the 135M model is most of it):

    OMP_NUM_THREADS=1 python -m benchmarks.probes.static_draft [--context 256] [--repeats 20] [--device cpu] \
        [--capacities 0 512] [--widths 1 5]

For a tiny random Llama and the embedded draft (SmolLM2-135M-Instruct), after a prefill of
``--context`` tokens, times one-token steps of ``ModelState`` (DynamicCache, eager),
``StaticState`` eager, and ``StaticState(compiled=True)`` (``mode="reduce-overhead"``: CUDA graphs
on a GPU, inductor's code on a CPU), each step rolled back after it so every step sees the same
context, interleaved repeat by repeat (the order rotating) so drift hits all alike; then the
same for passes of ``--widths`` tokens (k + 1: a verify pass, compiled at that width). Reports
median step times, the compiled step's speed-up over each eager one, the time of the first
compiled call (compiling), and the largest logit difference from the DynamicCache step. Each
model is timed at each of ``--capacities`` (0: ``StaticState``'s default, the model's context up
to ``MAX_CAPACITY``): an eager static step attends over the rows it holds, a compiled one over the
whole capacity (fixed shapes), so the capacity decides whether compiling pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from agentspec.attention import use_grouped_sdpa
from agentspec.kv import ModelState
from agentspec.models import ensure_default_model
from agentspec.static_kv import StaticState

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("dynamic", "static", "compiled")


def tiny_llama(device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(config)
    use_grouped_sdpa(model)
    return model.eval().to(device)


def embedded_135m(device: torch.device):
    """The embedded 135M model as a draft (the embedded pair's own draft is an EAGLE head).

    Loaded with transformers alone: the static and compiled states run transformers' forward (a pair's
    lean forward feeds growing caches only).
    """
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    use_grouped_sdpa(model)
    return model.eval().to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_model(name: str, model, capacity: int | None, width: int, args, device: torch.device) -> dict:
    """Median times of passes of ``width`` tokens after the context, for each kind of state."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.context,)).tolist()
    states = {
        "dynamic": ModelState(model),
        "static": StaticState(model, capacity=capacity),
        "compiled": StaticState(model, capacity=capacity, compiled=True, width=width),
    }
    for s in states.values():
        s.forward(prompt, keep=1)
    t0 = time.perf_counter()
    states["compiled"].forward([1] * width, keep=width)  # the first call compiles
    sync(device)
    compile_s = time.perf_counter() - t0
    states["compiled"].truncate(args.context)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    diff = 0.0
    for r in range(args.repeats + 1):  # the first round warms up
        tokens = torch.randint(0, vocab, (width,)).tolist()
        logits = {}
        for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
            sync(device)
            t0 = time.perf_counter()
            logits[kind] = states[kind].forward(tokens, keep=width)
            sync(device)
            if r:
                times[kind].append(time.perf_counter() - t0)
            states[kind].truncate(args.context)
        diff = max(diff, max(float((logits[k] - logits["dynamic"]).abs().max()) for k in KINDS))
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    row = {
        "model": name,
        "context": args.context,
        "tokens_per_pass": width,
        "capacity": states["static"].capacity,
        **{f"{k}_ms": med[k] for k in KINDS},
        "compiled_vs_dynamic": med["dynamic"] / med["compiled"],
        "compiled_vs_static": med["static"] / med["compiled"],
        "static_vs_dynamic": med["dynamic"] / med["static"],
        "compile_s": compile_s,
        "max_abs_logit_diff": diff,
    }
    print(
        f"{name}, capacity {row['capacity']}, {width} tokens: dynamic {med['dynamic']:.2f} ms  static "
        f"{med['static']:.2f} ms  compiled {med['compiled']:.2f} ms "
        f"(x{row['compiled_vs_dynamic']:.2f} vs dynamic; compiling {compile_s:.0f} s)  "
        f"max|dlogit| {diff:.2g}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--capacities", type=int, nargs="+", default=[0, 512], help="0: StaticState's default")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 5], help="tokens per pass: 1, or k + 1")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=["tiny", "draft"], choices=["tiny", "draft"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/static_draft.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    rows = []
    for name in args.models:
        if name == "tiny":
            label, model = "tiny random Llama (2 layers, hidden 64)", tiny_llama(device)
        else:
            label, model = "SmolLM2-135M-Instruct (embedded draft)", embedded_135m(device)
        for capacity in args.capacities:
            for width in args.widths:
                rows.append(time_model(label, model, capacity or None, width, args, device))
    result = {
        "benchmark": "static_draft",
        "dtype": "float32",
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "load_average_end": list(os.getloadavg()),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
