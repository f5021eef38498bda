"""``python -m benchmarks <suite> [options]``: run one suite; ``python -m benchmarks`` lists them.

Each suite is a module of this package with a ``main(argv)``; ``python -m benchmarks <suite> --help``
gives its options. Every suite writes ``benchmarks/results/<suite>.json`` (a suite of several parts
keeps each part under its own key) and a plot beside it where a person would rather look.
"""

from __future__ import annotations

import importlib
import os
import sys

# OpenMP threads that spin while they wait (libgomp's default) turn a busy machine's slowdown from
# its share of the CPUs into several times that: one decode step with 2 threads took 700 ms under a
# load of 3.5 on 2 cores, 200 ms with passive waiting. It must be set before torch loads; export
# OMP_WAIT_POLICY=ACTIVE to measure with spinning threads (the environment record keeps it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SUITES = {
    "core": ("core", "the decode loop on chat prompts: generate, plain, speculative; the distilled draft"),
    "traces": ("traces", "each drafter on 22 recorded tool-calling agent turns against plain decoding"),
    "loop": ("loop", "a LangChain agent loop against ChatHuggingFace; tracing's estimate and overhead"),
    "prefix-cache": ("prefix_cache", "a tool-binding conversation with and without the prefix cache"),
    "grammar": ("grammar", "tool calls and structured output under a grammar against free decoding"),
    "serve": ("serve", "agentspec serve over HTTP against in process; what logprobs and n cost"),
    "concurrency": ("concurrency", "K agent sessions at once: in process, serve, fleet, vLLM; joins"),
    "soak": ("soak", "hundreds of calls in process and through serve: memory, latency and cache drift"),
    "vllm": ("vs_vllm", "a 12-call agent conversation against a vLLM worker; first calls"),
    "pass": ("forward_pass", "one target pass and one decode step against the bound and vLLM's step"),
    "gpu-check": ("gpu_check", "the device check: identity, syncs, verify cost, compiled pass, speed"),
    "before-after": ("before_after", "two checkouts side by side: traces, the loop, the pass"),
    "route": (
        "route",
        "the functions and files one call runs, counted by a profiler, in this and other checkouts",
    ),
}


def usage() -> str:
    width = max(map(len, SUITES))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in SUITES.items())
    return f"{__doc__}\nsuites:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in SUITES:
        print(f"no suite {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    suite = importlib.import_module(f"benchmarks.{SUITES[argv[0]][0]}")
    return suite.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
