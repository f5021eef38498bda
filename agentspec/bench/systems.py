"""The systems measured, each as a function that runs one piece of work and times it.

Single calls take prompt ids and return a ``Call``: plain transformers ``generate``, the same with
a static KV cache and its decode step compiled (``StaticCompiled``, where asked: the strongest plain
baseline), its assisted generation with the pair's draft model (``assistant_model=``) and with
prompt lookup (``prompt_lookup_num_tokens=``), and agentspec with each drafter. All greedy, all from
a cold prompt (agentspec with ``prefix_cache=False``), so their tokens must agree.

llama.cpp (``llama-cpp-python``, an optional extra) runs the same GGUF file as an outside
reference. The agent loop's systems are LangChain chat models: they live beside the other
benchmarks (the loop suite, ``python -m benchmarks loop``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

import agentspec
from agentspec.bench.roofline import synchronize
from agentspec.drafters import DraftMemory, build_drafter
from agentspec.drafters.eagle import is_feature_head

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens
AGENTSPEC_DRAFTERS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto")
STATIC_COMPILED = "transformers static compiled"


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


class StaticCompiled:
    """Plain ``generate()`` with a static KV cache and its one-token step under ``torch.compile``
    (``mode="reduce-overhead"``: CUDA graphs on CUDA), as transformers documents for fast greedy
    decoding: ``cache_implementation="static"`` with a ``CompileConfig``.

    transformers compiles that step by itself on CUDA (and XPU, ...); elsewhere only where the
    config's ``_compile_all_devices`` is set, its own switch for compiling on a CPU, which this row
    sets so that it measures the same path wherever it is asked for. Every call gets a cache of
    ``cache_len`` entries, so one compiled graph (kept on the model; the prefill runs eager) serves
    every prompt: a run compiles it in its warm-up (minutes on a small CPU).
    """

    def __init__(self, device: torch.device, cache_len: int):
        from transformers import CompileConfig

        self.cache_len = cache_len
        self.compile_config = CompileConfig(mode="reduce-overhead")
        if device.type != "cuda":
            self.compile_config._compile_all_devices = True

    def options(self, model, prompt_len: int, max_new_tokens: int) -> dict[str, Any]:
        """``generate()`` options for one call: a fresh static cache and the compile config."""
        from transformers import StaticCache

        need = prompt_len + max_new_tokens
        assert need <= self.cache_len, f"{prompt_len=} {max_new_tokens=} {self.cache_len=}"
        return {"cache": StaticCache(config=model.config, max_cache_len=self.cache_len),
                "compile_config": self.compile_config}  # fmt: skip


def different_widths(pair) -> bool:
    """Target and draft logits of different widths (one tokenizer, embeddings padded apart:
    Qwen2.5-7B's 152,064 rows against 0.5B's 151,936)."""
    return pair.target.config.get_text_config().vocab_size != pair.draft.config.get_text_config().vocab_size


def single_call_systems(pair, static_compiled: bool = False, drafter: str | None = None) -> list[str]:
    """The single-call rows for ``pair``; ``static_compiled`` adds ``STATIC_COMPILED``; ``drafter``
    keeps agentspec's rows to "agentspec none" and that drafter's (None: every drafter the pair has)."""
    names = ["transformers generate", *[STATIC_COMPILED] * static_compiled]
    if pair.draft is not None and not is_feature_head(pair.draft):  # assisted generation takes a token model
        names.append("transformers assisted")
    names.append("transformers prompt lookup")
    wanted = AGENTSPEC_DRAFTERS if drafter is None else ("none", drafter)
    drafters = [
        d
        for d in AGENTSPEC_DRAFTERS
        if d in wanted and (pair.draft is not None or d not in ("model", "model_scheduled"))
    ]
    return names + [f"agentspec {d}" for d in drafters]


def own_state(pair, system: str, cache_len: int | None = None):
    """What a system keeps across its calls: an agentspec system's drafter with a drafting memory
    of its own (earlier outputs, calibrations, cost curve), so no system drafts from the replies
    another system wrote to the same prompt; ``StaticCompiled`` for that row, its cache holding
    ``cache_len`` tokens (the longest prompt and reply of the run); else None."""
    if system == STATIC_COMPILED:
        if cache_len is None:
            raise ValueError(f"{STATIC_COMPILED!r} needs cache_len: the most tokens a call holds")
        return StaticCompiled(pair.device, cache_len)
    name = system.removeprefix("agentspec ")
    if not system.startswith("agentspec") or name == "none":
        return None
    return build_drafter(pair, name, memory=DraftMemory())


def transformers_options(pair, system: str, ids: list[int], max_new_tokens: int, state) -> dict[str, Any]:
    """The ``generate()`` options of a transformers row.

    Assisted generation of a pair whose logits widths differ takes transformers' universal
    assisted decoding, which asks for both tokenizers (here the same one twice): the draft's
    tokens go to text and back into the target's ids, and the target verifies every token as
    usual, so greedy output stays the target's own; the round trip only costs time per pass.
    """
    if system == "transformers assisted":
        options: dict[str, Any] = {"assistant_model": pair.draft}
        if different_widths(pair):
            options |= {"tokenizer": pair.tokenizer, "assistant_tokenizer": pair.tokenizer}
        return options
    if system == "transformers prompt lookup":
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    if system == STATIC_COMPILED:
        return state.options(pair.target, len(ids), max_new_tokens)
    return {}


def run_single(pair, system: str, ids: list[int], max_new_tokens: int, state=None) -> Call:
    """Greedy decode of ``ids`` by ``system`` (a name from ``single_call_systems``) with the
    system's ``own_state`` (an agentspec system's drafter)."""
    drafter = state if system.startswith("agentspec") else None
    if system.startswith("transformers"):
        options = transformers_options(pair, system, ids, max_new_tokens, state)
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
