"""Shared fixtures for every rung: tiny random Llama models and a fake tokenizer.

The tests form a ladder, one folder a rung, all collected by ``make test``:

- ``unit/``: no model weights (hand-written token arrays, tiny random models, byte and fake
  tokenizers, the embedded tokenizer's files): the algorithms, the equivalence and sampling tests;
- ``model/``: the embedded SmolLM2-135M-Instruct (``pytest.mark.model``): the engine and the
  LangChain chat model on a real model;
- ``standard/``: LangChain's standard chat-model suites;
- ``e2e/``: end to end, a real trace backend (Arize Phoenix) and agents.

Everything here runs on a CPU with no downloads. Models are built from a ``LlamaConfig`` under a
fixed ``torch.manual_seed``, so every test sees the same weights on every run. Helpers that tests
call directly are exposed as fixtures (``hf_greedy``, ``tiny_llama``) rather than imported, so the
test files work whatever import mode pytest uses.
"""

from __future__ import annotations

import os

# Before torch loads: OpenMP threads that spin while waiting starve each other on a busy 2-core
# machine (one decode step of the real model measured 700-830 ms spinning, ~200 ms passive).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy  # noqa: E402
import random  # noqa: E402

import pytest
import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from agentspec.cache import PrefixCache
from agentspec.linears import cpu_has_bf16
from agentspec.models import ModelPair, ensure_default_model

VOCAB = 64  # vocabulary of the greedy-equivalence models
MAX_POSITIONS = 128  # their context window (max_position_embeddings)

# bfloat16 passes are held to one-row steps' bits only where the CPU has bf16 instructions: elsewhere
# oneDNN emulates bfloat16 and nothing is prepacked (linears.PassLinears)
needs_bf16 = pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bfloat16 instructions")


class FakeTokenizer:
    """The two things the decoding loop asks of a tokenizer: ``eos_token_id`` and ``decode``.

    Token ``i`` decodes to ``pieces[i]``; by default ``"t{i} "``, so every id has its own text and
    no piece is a substring of another piece's start (stop strings can be written from ids).
    """

    def __init__(self, vocab_size: int = VOCAB, eos_token_id: int | None = None, pieces=None):
        self.eos_token_id = eos_token_id
        self.pieces = list(pieces) if pieces is not None else [f"t{i} " for i in range(vocab_size)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


def build_llama(
    seed: int,
    vocab_size: int = VOCAB,
    *,
    hidden: int = 32,
    layers: int = 2,
    max_positions: int = MAX_POSITIONS,
    logit_scale: float = 1.0,
) -> LlamaForCausalLM:
    """A random Llama; ``logit_scale`` multiplies the LM head (random inits give near-uniform p)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,  # no EOS unless a test asks for one
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


def build_qwen(family: str, seed: int, vocab_size: int = VOCAB, *, layers: int = 2, **overrides):
    """A random Qwen2 or Qwen3 with random q/k/v biases (and, Qwen3, q/k norm weights): they initialise
    to zeros and ones, which would test nothing of what the family adds to Llama."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, **overrides)).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, attention_bias=True, **overrides)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.normal_(0, 0.5)
            for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
    return model


def noisy_copy(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """The model with Gaussian noise (``noise`` x each tensor's std) added: a draft that mostly agrees.

    A draft that is a second random model almost never agrees with the target, so long drafts would
    never be accepted and the accept paths of the loop would go untested.
    """
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return draft


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread (no sync overhead, no fight for busy cores).

    Module-scoped so that module fixtures which run models (references, exact distributions) can
    depend on it too; the setting is restored after the module.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama():
    """The model builder, for tests that need a model of their own (a vocabulary, a context...)."""
    return build_llama


@pytest.fixture(scope="session")
def perturbed():
    """``noisy_copy``: a draft model that mostly agrees with a given target."""
    return noisy_copy


@pytest.fixture(scope="session")
def tiny_qwen():
    """``build_qwen``: a random Qwen2 or Qwen3 (``tiny_qwen("qwen3", seed, vocab_size)``)."""
    return build_qwen


@pytest.fixture(scope="session")
def fake_tokenizer():
    """The FakeTokenizer class, for tests that need one with their own EOS or pieces."""
    return FakeTokenizer


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return build_llama(0)


@pytest.fixture(scope="session")
def draft(target) -> LlamaForCausalLM:
    # noise 0.07 accepts ~85% of 1-token drafts, ~55% of 8-token drafts' tokens: every path runs
    return noisy_copy(target, seed=1, noise=0.07)


@pytest.fixture(scope="session")
def tokenizer() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture(scope="session")
def pair(target, draft, tokenizer) -> ModelPair:
    """Target + draft of one vocabulary, no EOS (tests that want one pass ``eos_token_ids``)."""
    return ModelPair(target=target, draft=draft, tokenizer=tokenizer, name="tiny")


@pytest.fixture(scope="module")
def tiny_smol(one_thread) -> ModelPair:
    """A tiny random Llama behind the embedded tokenizer: the chat template, real grammars, fast (the
    server's tests: the app needs a real tokenizer, not its replies' sense)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_default_model())
    model = build_llama(5, vocab_size=len(tokenizer), max_positions=1024)
    return ModelPair(target=model, tokenizer=tokenizer, name="tiny-smol", prefix_cache=PrefixCache(64 << 20))


@pytest.fixture
def spans():
    """(exporter, provider): an OpenTelemetry provider keeping every ended span in memory."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider
    provider.shutdown()


@pytest.fixture(scope="module")
def tiny_app(tiny_smol):
    """``agentspec serve``'s app on ``tiny_smol``, in this process (FastAPI's TestClient)."""
    from fastapi.testclient import TestClient

    from agentspec.serve import create_app

    with TestClient(create_app(tiny_smol)) as client:
        yield client


def sse_events(text: str) -> list:
    """A streamed response's ``data:`` events: JSON bodies, and "[DONE]"."""
    import json

    bodies = [line[len("data: ") :] for line in text.strip().split("\n\n")]
    return [b if b == "[DONE]" else json.loads(b) for b in bodies]


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers' own greedy decoding: the reference every speculative output must equal.

    Results are memoised per (model, prompt, max_new_tokens, eos): several tests share references.
    """
    memo: dict[tuple, list[int]] = {}

    @torch.inference_mode()
    def run(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
        key = (id(model), tuple(prompt), max_new_tokens, eos_token_id)
        if key not in memo:
            x = torch.tensor([prompt])
            config = transformers.GenerationConfig(
                do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0
            )
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            memo[key] = out[0, len(prompt) :].tolist()
        return list(memo[key])

    return run


@pytest.fixture(scope="session")
def greedy_cases(hf_greedy):
    """Builds (prompt, the target's ``n_new``-token greedy continuation) for ``n`` random prompts.

    Prompts are 1-40 tokens; every ``every``-th repeats a short pattern, so suffix drafts and prompt
    lookup have something to find; ``seed`` fixes the prompts.
    """

    def make(target, n: int, n_new: int, every: int, seed: int) -> list[tuple[list[int], list[int]]]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            if i % every == 0:
                pattern = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
                prompt = (pattern * 10)[: rng.randint(len(pattern) + 1, 40)]
            else:
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
            out.append((prompt, hf_greedy(target, prompt, n_new)))
        return out

    return make
