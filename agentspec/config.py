"""Options of one generation call, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


@dataclass(frozen=True)
class GenerationConfig:
    """What one call asks for. Every field is checked in ``__post_init__``."""

    max_new_tokens: int = 256  # hard cap on generated tokens (finish_reason "length")
    temperature: float = 0.0  # 0 = greedy; > 0 samples from softmax(logits / temperature)
    top_k: int | None = None  # keep the k most likely tokens before sampling (None = all)
    top_p: float | None = None  # nucleus: keep the smallest set with mass >= top_p (None = 1)
    stop: tuple[str, ...] = ()  # stop strings; the output text ends before the first one
    seed: int | None = None  # seeds the sampler: same seed, same output
    # the most draft tokens verified per target pass; None: the drafter's own cap (``draft_cap``:
    # 4 for a fixed-length draft model and prompt lookup, 16 for drafters that schedule their length)
    num_draft_tokens: int | None = None
    speculative: bool = True  # False = the same loop with no draft (the honest baseline)
    # with a grammar: append tokens it forces without a model pass, and propose the text it forces
    # as draft tokens (verified like any draft)
    jump_forward: bool = True
    eos_token_ids: frozenset[int] | None = None  # None = the model's own EOS ids
    # seconds the call may take, the wait for the pair's lock included (None = no limit); checked
    # between passes (a pass is atomic, and the first one always runs, so a retry restores what it
    # prefilled from the prefix cache); past it the call raises ``agentspec.DecodeTimeout``
    timeout: float | None = None
    # the target's log-probabilities of every output token, with this many most likely alternatives
    # (0: the output token's alone; None: none, and nothing computed for them); ``Step.logprobs``
    logprobs: int | None = None
    # where the pair's scheduler has a choice (prompts competing for a pass's rows), lower goes first
    # (vLLM's order); calls of one priority share the rows as before
    priority: int = 0
    # sampled calls: draw each output position with noise keyed by (seed, position) (the Gumbel-max
    # trick: exactly the target's distribution), so the output is a function of the seed and the
    # prompt alone, the same whatever was drafted, cached or decoded beside it, and equal to plain
    # sampling's with that seed; drafts are then proposed and verified as greedy ones (a draft
    # model's sampled q, which rejection sampling would use, is not). No seed: a random one.
    reproducible: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        if self.num_draft_tokens is not None:
            _check_int("num_draft_tokens", self.num_draft_tokens, low=0)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(t).__name__}")
        if math.isnan(t) or math.isinf(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        if self.top_p is not None:
            if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
                raise TypeError(f"top_p must be a number, got {type(self.top_p).__name__}")
            if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, low=1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
            if self.seed >= 2**64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if self.timeout is not None:
            _check_seconds("timeout", self.timeout)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"priority must be an int, got {type(self.priority).__name__}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs: at most {MAX_LOGPROBS} alternatives, got {self.logprobs}")
        if not all(isinstance(v, bool) for v in (self.speculative, self.jump_forward, self.reproducible)):
            raise TypeError("speculative, jump_forward and reproducible must be bools")
        for s in self.stop:
            if not isinstance(s, str):
                raise TypeError(f"stop: every stop sequence must be a string, got {type(s).__name__}")
            if s == "":
                raise ValueError("stop: empty strings are not valid stop sequences")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
