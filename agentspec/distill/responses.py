"""The target's own responses as token ids: a training set small enough to commit, grown run after run.

A head learns to predict its target, so its training data is the target answering prompts as broad
as an agent's (``agentspec.distill.prompts``: chat, instructions, code, tool calls, tool results,
agent turns). Features and the target's distributions are not stored: a trainer recomputes them by
prefill (they would take 3 x 576 floats a token for SmolLM2, the ids 4 bytes). The responses come from
the pair's own batched passes: ``concurrency`` calls at once on one pair share each target pass.

A responses file (safetensors): ``ids`` int32 [total] (each example's prompt then response, back to
back), ``starts`` int64 [n + 1] (where each example starts), ``prompt_lengths`` int64 [n], and in its
metadata the target, each example's prompt index, kind, whether it was greedy and whether it is held
out. A run adds the
prompts of indices the file does not hold yet, so the set grows without repeating one.

    python -m agentspec.distill.responses OUT.safetensors --prompts 2000 [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HELDOUT = 0.1  # the fraction of prompts (by a hash of their content) no training step sees
SAMPLED = 0.5  # the fraction of prompts answered by sampling (temperature 0.7), the rest greedily


@dataclass
class Example:
    index: int  # the prompt's index in ``make_prompts``' sequence (seed 0)
    kind: str
    greedy: bool
    heldout: bool  # in the held-out split (by a hash of the prompt's content): for measuring only
    prompt: list[int]
    response: list[int]


def read(path: str | Path) -> list[Example]:
    """The examples a responses file holds (none for a missing file)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        return []
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["examples"])
        ids, starts, prompts = (f.get_tensor(k) for k in ("ids", "starts", "prompt_lengths"))
    out = []
    for i, (index, kind, greedy, heldout) in enumerate(meta):
        seq = ids[starts[i] : starts[i + 1]].tolist()
        n = int(prompts[i])
        out.append(Example(index, kind, bool(greedy), bool(heldout), seq[:n], seq[n:]))
    return out


def write(path: str | Path, examples: list[Example], target: str) -> None:
    from safetensors.torch import save_file

    seqs = [e.prompt + e.response for e in examples]
    starts = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.long)
    tensors = {
        "ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "starts": starts,
        "prompt_lengths": torch.tensor([len(e.prompt) for e in examples], dtype=torch.long),
    }
    meta = {
        "target": target,
        "examples": json.dumps([[e.index, e.kind, e.greedy, e.heldout] for e in examples]),
    }
    tmp = Path(path).with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def grow(
    pair: Any, path: str | Path, prompts: int, *, concurrency: int = 16, max_new_tokens: int = 192, log=print
) -> list[Example]:
    """Answer prompts 0..``prompts``-1 the file does not hold yet, ``concurrency`` at once on ``pair``;
    the file is rewritten every ``concurrency`` x 4 answers, so a stopped run keeps what it did."""
    from agentspec.decode import generate
    from agentspec.distill.prompts import is_heldout, make_prompts, render

    have = read(path)
    done = {e.index for e in have}
    todo = [(i, spec) for i, spec in enumerate(make_prompts(prompts)) if i not in done]
    start, tokens = time.perf_counter(), 0

    def answer(item):
        index, spec = item
        greedy = (index * 2654435761) % 1000 >= SAMPLED * 1000
        ids = render(pair.tokenizer, spec)
        options = {} if greedy else {"temperature": 0.7, "seed": index}
        out = generate(pair, ids, "none", False, max_new_tokens=max_new_tokens, **options)
        return Example(index, spec.kind, greedy, is_heldout(spec.key(), HELDOUT), ids, out.token_ids)

    with ThreadPoolExecutor(concurrency) as pool:
        for at in range(0, len(todo), concurrency * 4):
            new = list(pool.map(answer, todo[at : at + concurrency * 4]))
            have += new
            tokens += sum(len(e.response) for e in new)
            write(path, sorted(have, key=lambda e: e.index), pair.name)
            rate = tokens / (time.perf_counter() - start)
            total = sum(len(e.response) for e in have)
            log(f"{len(have)} examples, {total} response tokens ({rate:.0f}/s now)")
    return have


def main(argv: list[str] | None = None) -> None:
    from agentspec.models import load_pair

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the responses file (grown if it exists)")
    parser.add_argument("--prompts", type=int, required=True, help="answer prompts 0..N-1")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--dtype", help="the pair's dtype (default: agentspec's for the device)")
    args = parser.parse_args(argv)
    pair = load_pair(draft_model=False, dtype=args.dtype)
    grow(pair, args.out, args.prompts, concurrency=args.concurrency, max_new_tokens=args.max_new_tokens)


if __name__ == "__main__":
    main()
