"""What the device check runs on: its plan, its report, and random models of known shapes.

No real weights reach a GPU machine lent without a network, so every model has random weights from a
config: small ones with sharpened LM heads (clear argmaxes) for identity, the shapes of
Qwen2.5-7B-Instruct and -0.5B-Instruct for speed; the tokenizer is built at run time, one word per id.
"""

from __future__ import annotations

import copy
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import agentspec
from agentspec.bench import runs
from agentspec.bench.roofline import synchronize
from agentspec.drafters import DraftMemory, build_drafter
from benchmarks import harness

EOS = 0  # the built tokenizer's "<eos>"; its LM-head row is zeroed, so outputs run to full length


def qwen2(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool):
    """A Qwen2 config's fields; the rest as Qwen2.5's config.json has them."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                tie_word_embeddings=tied, max_position_embeddings=32768, rope_theta=1000000.0,
                rms_norm_eps=1e-6)  # fmt: skip


# Qwen2.5-7B-Instruct and Qwen2.5-0.5B-Instruct (embeddings padded to 152,064 and 151,936 rows; one
# tokenizer of 151,665 tokens); --quick: the same structure at toy sizes, the draft narrower than the
# target as there; the identity phase's target: the 7B's widths, small enough for float32 anywhere
QWEN_7B = qwen2(152064, 3584, 18944, 28, 28, 4, tied=False)
QWEN_05B = qwen2(151936, 896, 4864, 24, 14, 2, tied=True)
TINY_TARGET = qwen2(4224, 128, 256, 2, 4, 2, tied=False)
TINY_DRAFT = qwen2(4096, 64, 128, 1, 2, 1, tied=True)
IDENTITY_TARGET = qwen2(152064, 512, 1024, 4, 8, 2, tied=False)


@dataclass
class Plan:
    """What one run does: sizes of the work per phase (``--quick``: the toy run)."""

    device: torch.device
    quick: bool
    budget_s: float  # past this, later phases and parts are skipped (recorded as such)
    identity: dict  # the identity phase's target config
    target: dict  # the speed phases' configs
    draft: dict
    new_tokens: int  # per call in the identity and syncs phases
    e2e_tokens: int  # per call at batch 1, and in the compiled phase
    batch_tokens: int  # per call at batch 8
    prompt_tokens: int  # the speed phases' prompt (its cached prefix in the roofline)
    repeats: int
    k: int  # draft tokens per pass of the replay drafter and of transformers assisted

    @classmethod
    def make(cls, device: torch.device, quick: bool, budget_s: float) -> Plan:
        if quick:
            return cls(device, True, budget_s, identity=dict(TINY_TARGET, num_hidden_layers=1),
                       target=TINY_TARGET, draft=TINY_DRAFT, new_tokens=12, e2e_tokens=16,
                       batch_tokens=12, prompt_tokens=48, repeats=3, k=4)  # fmt: skip
        return cls(device, False, budget_s, identity=IDENTITY_TARGET, target=QWEN_7B, draft=QWEN_05B,
                   new_tokens=32, e2e_tokens=96, batch_tokens=64, prompt_tokens=512, repeats=10,
                   k=4)  # fmt: skip

    @property
    def speed_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


class Report:
    """The run's JSON, rewritten whole as each phase starts and ends (a cut run keeps what it measured)."""

    def __init__(self, path: Path, plan: Plan):
        self.path, self.plan, self.t0 = path, plan, time.perf_counter()
        env = harness.environment() | {"device": str(plan.device), "what_runs": runs.versions()}
        if plan.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(plan.device)
        plan_fields = {k: str(v) if isinstance(v, torch.device) else v for k, v in vars(plan).items()}
        self.data: dict[str, Any] = {"environment": env, "plan": plan_fields, "phases": {}}
        harness.write(path, self.data)

    def left(self) -> float:
        return self.plan.budget_s - (time.perf_counter() - self.t0)

    def phase(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if self.left() <= 0:
            self.data["phases"][name] = {"status": "skipped", "error": "out of time", "seconds": 0.0}
            harness.write(self.path, self.data)
            return
        t0 = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        self.data["phases"][name] = {"status": "running", "error": None, "seconds": None}  # if cut here
        harness.write(self.path, self.data)
        try:
            record = {"status": "ok", "error": None, **fn()}
        except Exception as exc:  # a failed phase is reported; the next ones still run
            error = f"{type(exc).__name__}: {exc}"
            record = {"status": "error", "error": error, "traceback": traceback.format_exc(limit=8)}
        record["seconds"] = time.perf_counter() - t0
        self.data["phases"][name] = record
        self.data["wall_s"] = time.perf_counter() - self.t0
        harness.write(self.path, self.data)
        print(f"gpu_check: {name} {record['status']} in {record['seconds']:.1f} s", flush=True)


# ---- models, tokenizer, calls ------------------------------------------------------------------
def word_tokenizer(width: int):
    """A real fast tokenizer of ``width`` ids, one word each ("<eos>", "<unk>", "t2", "t3", ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS, "<unk>": 1, **{f"t{i}": i for i in range(2, width)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def random_model(config: dict, dtype, device, seed: int, width: int, logit_std: float | None = None):
    """A Qwen2 of ``config`` with random weights, built on ``device``. LM-head rows at and past
    ``width`` (the padding rows a real model never emits) and EOS's are zeroed; ``logit_std``
    scales the head so logits have about that spread (a clear argmax at every position)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**config, eos_token_id=EOS, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.generation_config.pad_token_id = EOS
    with torch.no_grad():
        head = model.lm_head.weight
        if logit_std is not None:
            head.mul_(logit_std / (head.float().std().item() * cfg.hidden_size**0.5))
        head[width:] = 0
        head[EOS] = 0
    return model


def noisy_copy(model, width: int, noise: float, seed: int):
    """The draft of the identity phase: ``model`` cut to ``width`` logits, every weight perturbed
    by ``noise`` of its spread (it agrees with the target often, not always)."""
    draft = copy.deepcopy(model)
    draft.resize_token_embeddings(width)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * p.std() * noise)
    return draft


def prompts(width: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (so prompt lookup and suffix drafts have matches to find)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seg = torch.randint(2, width, (12,), generator=gen).tolist()
        out.append(seg * 3 + torch.randint(2, width, (6,), generator=gen).tolist() + seg[:4])
    return out


def hf_greedy(model, ids: list[int], n: int, **options) -> list[int]:
    """``generate()``'s greedy ``n`` tokens after ``ids`` (``options``: more of its arguments)."""
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, **options)  # fmt: skip
    return out[0, len(ids) :].tolist()


def speculate(pair, ids: list[int], name: str, n: int, cache=False, drafter=None) -> tuple[list[int], list]:
    """agentspec's greedy output and its steps, drafting with ``name`` (a fresh drafting memory)."""
    if drafter is None and name != "none":
        drafter = build_drafter(pair, name, memory=DraftMemory())
    speculative = drafter is not None
    steps = list(
        agentspec.stream(pair, ids, drafter, prefix_cache=cache, max_new_tokens=n, speculative=speculative)
    )
    return [t for s in steps for t in s.tokens], steps


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


class Speed:
    """The 7B- and 0.5B-shaped pair of the speed phases, built once on first use, and what one
    phase leaves for a later one (the prompt, ``generate``'s output and the end-to-end rows)."""

    def __init__(self, plan: Plan):
        self.plan, self._pair = plan, None
        self.ids: list[int] = []
        self.ref: list[int] = []
        self.rows: dict[str, Any] = {}

    @property
    def pair(self):
        if self._pair is None:
            p = self.plan
            width = p.draft["vocab_size"]
            # sharpened heads: no near-ties, so bfloat16 verify passes give generate()'s tokens and
            # the replay drafter's reference stays the output
            target = random_model(p.target, p.speed_dtype, p.device, seed=10, width=width, logit_std=8.0)
            draft = random_model(p.draft, p.speed_dtype, p.device, seed=11, width=width, logit_std=8.0)
            self._pair = agentspec.load_pair(target, draft, tokenizer=word_tokenizer(width))
            gen = torch.Generator().manual_seed(12)
            self.ids = torch.randint(2, width, (p.prompt_tokens,), generator=gen).tolist()
        return self._pair
