"""The systems measured, each as a function that runs one piece of work and times it.

Single calls take prompt ids and return a ``Call``: plain transformers ``generate``, its assisted
generation with the pair's draft model (``assistant_model=``) and with prompt lookup
(``prompt_lookup_num_tokens=``), and agentspec with each drafter. All greedy, all from a cold
prompt (agentspec with ``prefix_cache=False``), so their tokens must agree.

llama.cpp (``llama-cpp-python``, an optional extra) runs the same GGUF file as an outside
reference. The agent loop's systems are LangChain chat models: they live with the LangChain
integration (``integrations/langchain/langchain_agentspec/bench.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

import agentspec
from agentspec.bench.roofline import synchronize
from agentspec.drafters import DraftMemory, build_drafter
from agentspec.drafters.eagle import is_eagle

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens
AGENTSPEC_DRAFTERS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto")


@dataclass
class Call:
    """One single-call decode by one system."""

    system: str
    tokens: list[int]
    seconds: float
    passes: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verify pass

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


def single_call_systems(pair) -> list[str]:
    names = ["transformers generate", "transformers prompt lookup"]
    if pair.draft is not None and not is_eagle(pair.draft):  # assisted generation takes a token model
        names.insert(1, "transformers assisted")
    drafters = [
        d for d in AGENTSPEC_DRAFTERS if pair.draft is not None or d not in ("model", "model_scheduled")
    ]
    return names + [f"agentspec {d}" for d in drafters]


def own_drafter(pair, system: str):
    """An agentspec system's drafter with a drafting memory of its own (earlier outputs,
    calibrations, cost curve): no system drafts from the replies another system wrote to the
    same prompt. None for "agentspec none"."""
    name = system.removeprefix("agentspec ")
    return None if name == "none" else build_drafter(pair, name, memory=DraftMemory())


def run_single(pair, system: str, ids: list[int], max_new_tokens: int, drafter=None) -> Call:
    """Greedy decode of ``ids`` by ``system`` (a name from ``single_call_systems``); an agentspec
    system drafts with ``drafter`` (``own_drafter``)."""
    if system.startswith("transformers"):
        options: dict[str, Any] = {}
        if system == "transformers assisted":
            options["assistant_model"] = pair.draft
        elif system == "transformers prompt lookup":
            options["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        x = torch.tensor([ids], device=pair.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = pair.target.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                **options,
            )
        synchronize(pair.device)
        return Call(system, out[0, len(ids) :].tolist(), time.perf_counter() - t0)
    tokens: list[int] = []
    passes: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    options = {"prefix_cache": False, "max_new_tokens": max_new_tokens, "speculative": drafter is not None}
    for step in agentspec.stream(pair, ids, drafter, **options):
        tokens += step.tokens
        if step.drafted:
            passes.append((step.drafted, step.accepted))
    synchronize(pair.device)
    return Call(system, tokens, time.perf_counter() - t0, passes)


def llama_cpp(gguf_path: str, threads: int):
    """A ``llama_cpp.Llama`` on the GGUF file; None when ``llama-cpp-python`` is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=gguf_path, n_ctx=4096, n_threads=threads, verbose=False, seed=0)


def run_llama_cpp(llm, ids: list[int], max_new_tokens: int) -> Call:
    """Greedy decode of the same prompt ids (temperature 0, top-k 1) with llama.cpp."""
    tokens: list[int] = []
    t0 = time.perf_counter()
    llm.reset()  # a cold prompt, as every other row has (generate would reuse a matching prefix)
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        if tok == llm.token_eos() or len(tokens) >= max_new_tokens:
            break
    return Call("llama.cpp", tokens, time.perf_counter() - t0)
