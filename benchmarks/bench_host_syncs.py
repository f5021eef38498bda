"""Host syncs per verify pass, per drafter, on the embedded pair: this checkout against others.

    python -m benchmarks.bench_host_syncs [--before ../base] [--max-new-tokens 48] \
        [--out benchmarks/results/host_syncs.json]

A host sync is a read of a tensor value (``agentspec.bench.syncs.HostSyncs``): on a GPU each one
makes the host wait for the device. Each drafter decodes the same chat prompt greedily and sampled
(temperature 0.7, seed 0), without and with the prefix cache (the cached call restores the first
call's prompt), after a warm-up; the count is divided by the calls' target passes. With
``--before``, the same measurement runs in that checkout too (a fresh process whose ``agentspec``
is the checkout's own), so both sets of numbers come from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DRAFTERS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto")
QUESTION = "List the squares of 1 to 12 as a Python list, then say which of them are even."

# what each checkout runs: its own agentspec, this file's measurement (HostSyncs is in both)
MEASURE = """
import json, sys
import agentspec
from agentspec.bench.syncs import HostSyncs
from agentspec.cache import PrefixCache
n, drafters, question = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
pair = agentspec.load_pair()
ids = pair.tokenizer.apply_chat_template(
    [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
)
modes = {"greedy": {}, "sampled": {"temperature": 0.7, "seed": 0}}
out = {}
for d in drafters:
    for mode, options in modes.items():
        for cached in (False, True):
            cache = PrefixCache(1 << 30) if cached else False
            agentspec.generate(pair, ids, drafter=d, prefix_cache=cache, max_new_tokens=n, **options)
            with HostSyncs(pair) as syncs:
                steps = list(
                    agentspec.stream(pair, ids, drafter=d, prefix_cache=cache, max_new_tokens=n, **options)
                )
            passes = sum(s.target_pass for s in steps)
            out[f"{d} {mode} {'cached' if cached else 'uncached'}"] = {
                "syncs": syncs.count, "passes": passes, "per_pass": syncs.count / passes,
                "tokens": sum(len(s.tokens) for s in steps), "sites": dict(syncs.where.most_common(4)),
            }
from agentspec.bench.run import environment
print(json.dumps({"environment": environment(pair), "rows": out}))
"""


def measure(tree: Path, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [sys.executable, "-c", MEASURE, str(n), ",".join(DRAFTERS), QUESTION]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, help="another checkout to measure beside this one")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/host_syncs.json"))
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    after = measure(here, args.max_new_tokens)
    result = {
        "environment": after["environment"],
        "max_new_tokens": args.max_new_tokens,
        "after": after["rows"],
    }
    if args.before is not None:
        before = measure(args.before.resolve(), args.max_new_tokens)
        result["before_environment"], result["before"] = before["environment"], before["rows"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for key, row in result["after"].items():
        before = result.get("before", {}).get(key)
        was = f"{before['per_pass']:.2f} -> " if before else ""
        print(f"{key:36s} {was}{row['per_pass']:.2f} syncs/pass ({row['passes']} passes)")


if __name__ == "__main__":
    main()
