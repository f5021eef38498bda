"""The device check: whether the loop is right and fast on one GPU, in one command of under 5 minutes.

    python -m benchmarks gpu-check [--device cuda|cpu] [--quick] [--budget-s 210] [--out FILE]

On a lent GPU machine, from a copy of the checkout: ``--device cuda --out $OUT/gpu_check.json``
(set-up in docs/benchmarks.md, "gpu-check"; ``python3 benchmarks/gpu_check.py`` runs it as a file too).
``--device cpu --quick`` runs the same phases on toy sizes (1-3 minutes on 2 cores), as the tests do.

No real weights reach such a machine, so every model has random weights from a config: small ones
with sharpened LM heads (clear argmaxes) for identity, the shapes of Qwen2.5-7B-Instruct and
-0.5B-Instruct for speed; the tokenizer is built at run time, one word per id. The JSON is rewritten
after every phase (status, error, seconds), so a cut run still reports what it measured; phases past
``--budget-s`` are skipped. The phases, in order:

- identity: tokens against ``generate()`` for every drafter (``model``, ``auto`` also with the static
  draft cache), with and without the prefix cache, in float32 and bfloat16; each divergence with the
  float32 target's logit margin top1 - top2 there (near-ties may flip in bfloat16).
- syncs: host syncs per verify pass (``HostSyncs``; on CUDA also CUDA's own count).
- verify_cost: T(n)/T(1) of the 7B-shaped target's eager pass, the 0.5B-shaped draft's step, and the
  cost model's projected speed-up.
- profile: the target's pass over 1, 5 and 17 new rows and the draft's step, and where a pass's time
  goes by op category (``agentspec.bench.passes``; "outside_ops": the device waiting for launches).
- compiled_verify: those target passes compiled over ``StaticState(width=k)`` (CUDA graphs on a GPU)
  against the eager ones, logits compared; before the slow phases, as the question a GPU answers best.
- end_to_end: tokens/s of ``generate()``, agentspec without drafts and with a replay drafter of
  acceptance 0.6 / 0.8 / 0.95; transformers assisted generation cannot take that drafter, so its cost
  per pass is compared instead (``assisted_per_pass``).
- prefix_cache: restore times, time to first token cold and cached, and peak memory.
- batched: K = 1, 8, 32 calls sharing the pair's passes: tokens/s against K = 1, calls and host reads
  per pass, the first call's output against the same prompt alone.
- compiled: the compiled baselines, last because compiling is slow: static-cache ``generate()`` under
  ``torch.compile(mode="reduce-overhead")`` end to end, the draft's step and the target's passes.

``goals`` holds the figures a full CUDA run is judged by ("met" is null for any other run).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: the checkout's packages

import torch

import agentspec
from agentspec.bench import passes
from agentspec.bench.divergence import first_diff, logit_margin
from agentspec.bench.replay import ReplayDrafter, expected_tokens_per_pass
from agentspec.bench.roofline import synchronize
from agentspec.bench.syncs import HostSyncs
from agentspec.bench.systems import StaticCompiled
from agentspec.cache import PrefixCache
from agentspec.drafters import DraftMemory, build_drafter
from agentspec.kv import ModelState
from agentspec.static_kv import StaticState
from benchmarks import harness

DRAFTERS = ("none", "prompt_lookup", "suffix", "model", "model_scheduled", "auto")
STATIC_DRAFTERS = ("model", "auto")  # also run with the pair's static draft cache (draft_cache="static")
ACCEPTANCES = (0.6, 0.8, 0.95)
VERIFY_SIZES = (1, 2, 3, 4, 5, 8, 16)
PROFILE_ROWS = [1, 5, 17]  # new rows of the profiled and compiled target passes
PROFILE_PASSES = 3  # passes under the profiler per row count
BATCH_SIZES = (1, 8, 32)  # concurrent calls on the 7B-shaped pair
COMPILE_GUESS_S = 60.0  # what a first compile on a GPU machine is assumed to take, before one is timed
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
    e2e_tokens: int  # per call in end_to_end and compiled
    prompt_tokens: int  # the speed phases' prompt (its cached prefix in verify_cost)
    repeats: int
    k: int  # draft tokens per pass of the replay drafter and of transformers assisted

    @classmethod
    def make(cls, device: torch.device, quick: bool, budget_s: float) -> Plan:
        if quick:
            return cls(device, True, budget_s, identity=dict(TINY_TARGET, num_hidden_layers=1),
                       target=TINY_TARGET, draft=TINY_DRAFT, new_tokens=12, e2e_tokens=16,
                       prompt_tokens=48, repeats=3, k=4)  # fmt: skip
        return cls(device, False, budget_s, identity=IDENTITY_TARGET, target=QWEN_7B, draft=QWEN_05B,
                   new_tokens=32, e2e_tokens=96, prompt_tokens=512, repeats=10, k=4)  # fmt: skip

    @property
    def speed_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


class Report:
    """The run's JSON, rewritten whole after every phase (a cut run keeps what it measured)."""

    def __init__(self, path: Path, plan: Plan):
        self.path, self.plan, self.t0 = path, plan, time.perf_counter()
        env = harness.environment() | {"device": str(plan.device)}
        if plan.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(plan.device)
            env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32  # float32 identity assumes False
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


# ---- identity and host syncs -------------------------------------------------------------------
def identity_pairs(plan: Plan):
    """(dtype, pair) for float32 then bfloat16, the same weights (the draft a noisy copy); the
    float32 pair stays alive while the bfloat16 one runs (its target gives the margins)."""
    width = plan.draft["vocab_size"]
    tok = word_tokenizer(width)
    base = random_model(plan.identity, torch.float32, plan.device, seed=0, width=width, logit_std=8.0)
    draft = noisy_copy(base, width, noise=0.1, seed=1)
    assert draft.config.vocab_size == width, f"{draft.config.vocab_size=} {width=}"
    yield torch.float32, agentspec.load_pair(base, draft, tokenizer=tok)
    low = [copy.deepcopy(m).to(torch.bfloat16) for m in (base, draft)]
    yield torch.bfloat16, agentspec.load_pair(low[0], low[1], tokenizer=tok)


def identity_row(pair, calls, name: str, cached: bool, n: int, reference_model) -> dict[str, Any]:
    """One drafter's calls against ``generate()``'s; each divergence with ``reference_model``'s
    (the float32 target's) logit margin at that position."""
    cache = PrefixCache(1 << 30) if cached else False
    row: dict[str, Any] = {"identical": True, "divergences": [], "drafted": 0, "accepted": 0, "restored": 0}
    for ids, ref in calls:
        out, steps = speculate(pair, ids, name, n, cache)
        row["drafted"] += sum(s.drafted for s in steps)
        row["accepted"] += sum(s.accepted for s in steps)
        row["restored"] += steps[0].restored
        i = first_diff(out, ref)
        if i is not None:
            row["identical"] = False
            d = {"position": i, "prompt_tokens": len(ids)}
            if i < len(ref):  # how near a tie it was, in float32
                d["float32_margin"] = logit_margin(reference_model, ids + ref[:i])
            row["divergences"].append(d)
    return row


def phase_identity(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference_model = None
    for dtype, pair in identity_pairs(plan):
        reference_model = reference_model or pair.target  # the float32 one, first
        # two calls, the second extending the first and its output (so a cached call restores a prefix)
        first, more = prompts(plan.draft["vocab_size"], 2, seed=2)
        ref = hf_greedy(pair.target, first, plan.new_tokens)
        second = first + ref + more
        calls = [(first, ref), (second, hf_greedy(pair.target, second, plan.new_tokens))]
        static = dataclasses.replace(pair, draft_cache="static")  # the draft in one preallocated state
        rows = {}
        for label, on, names in (("", pair, DRAFTERS), (" static draft", static, STATIC_DRAFTERS)):
            for name in names:
                for cached in (False, True):
                    key = f"{name}{label} {'cached' if cached else 'uncached'}"
                    rows[key] = identity_row(on, calls, name, cached, plan.new_tokens, reference_model)
        identical = all(r["identical"] for r in rows.values())
        out[str(dtype).removeprefix("torch.")] = {"identical": identical, "rows": rows}
    out["identical_float32"] = out["float32"]["identical"]
    return out


def phase_syncs(plan: Plan) -> dict[str, Any]:
    _, pair = next(identity_pairs(plan))
    ids = prompts(plan.draft["vocab_size"], 1, seed=3)[0]
    rows = {}
    for name in ("model", "prompt_lookup", "suffix", "model_scheduled", "auto", "none"):
        speculate(pair, ids, name, 4)  # warm-up
        with HostSyncs(pair) as syncs:
            _, steps = speculate(pair, ids, name, 2 * plan.new_tokens)
        n = sum(s.target_pass for s in steps)
        rows[name] = {"passes": n, "count": syncs.count, "cuda": syncs.cuda, "per_pass": syncs.count / n,
                      "cuda_per_pass": syncs.cuda / n, "where": dict(syncs.where.most_common(8))}  # fmt: skip
    return {"rows": rows, "cuda_counted": plan.device.type == "cuda"}


# ---- the speed phases' pair, passes and profile --------------------------------------------------
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


def step_ms(forward, prefix: list[int], new: list[int], sizes, repeats: int) -> dict[int, float]:
    """Median ms of one eager pass over k new tokens after ``prefix``, per k (rounds rotate the k;
    round 0 warms up and is dropped); the cache rolls back after each pass."""
    state = ModelState(forward)
    state.forward(prefix, keep=1)
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for r in range(repeats + 1):
        for k in harness.rotated(sizes, r):
            _, s = timed(lambda k=k: state.forward(new[:k], keep=k), state.model.device)  # a row per token
            if r:
                times[k].append(s)
            state.truncate(len(prefix))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def phase_verify_cost(speed: Speed) -> dict[str, Any]:
    pair, p = speed.pair, speed.plan
    new = speed.ids[: max(VERIFY_SIZES)]
    target = step_ms(pair.target_forward, speed.ids, new, list(VERIFY_SIZES), p.repeats)
    draft = step_ms(pair.draft_forward, speed.ids, new, [1], p.repeats)[1]
    c = draft / target[1]
    curve = {k: v / target[1] for k, v in target.items()}
    # the cost model's speed-up over plain decoding: E(a, k) / (V(k + 1) + k c)
    projected = {str(a): expected_tokens_per_pass(a, p.k) / (curve[p.k + 1] + p.k * c) for a in ACCEPTANCES}
    return {"target_ms": target, "verify_cost_curve": curve, "draft_step_ms": draft, "draft_over_target": c,
            "cache_tokens": len(speed.ids), "k": p.k, "projected_speedup_eager": projected}  # fmt: skip


def phase_profile(speed: Speed) -> dict[str, Any]:
    """The target's pass over each PROFILE_ROWS and the draft's one-token step after the speed
    prompt's length of random cached tokens (median ms, rows interleaved), and each one's profile."""
    pair, p = speed.pair, speed.plan
    n = p.prompt_tokens
    target = passes.pass_times(pair.target_forward, n, PROFILE_ROWS, p.repeats)
    draft = passes.pass_times(pair.draft_forward, n, [1], p.repeats)[1]
    profiles = {
        str(k): passes.profile_passes(pair.target_forward, n, k, PROFILE_PASSES) for k in PROFILE_ROWS
    }
    return {
        "cache_tokens": n,
        "dtype": str(p.speed_dtype).removeprefix("torch."),
        "target": {str(k): passes.summary(v) for k, v in target.items()},
        "draft_step": passes.summary(draft),
        "target_profile": profiles,
        "draft_profile": passes.profile_passes(pair.draft_forward, n, 1, PROFILE_PASSES),
    }


def eager_logits(forward, prefix: list[int], new: list[int], sizes) -> dict[int, torch.Tensor]:
    """The logits [k, V] of the eager pass over each ``k`` new rows after ``prefix`` (prefilled once)."""
    state = ModelState(forward)
    state.forward(prefix, keep=1)
    out = {}
    for k in sizes:
        out[k] = state.forward(new[:k], keep=k)
        state.truncate(len(prefix))
    return out


def compiled_verify_ms(pair, prefix: list[int], new: list[int], want: torch.Tensor, repeats: int) -> dict:
    """The target's pass over ``k = len(want)`` new rows after ``prefix``, compiled over
    ``StaticState(width=k)`` (CUDA graphs on CUDA): compile seconds, median ms, and its logits' largest
    difference from ``want``, the eager pass's; each pass rolls back by moving the state's length."""
    k = len(want)
    state = StaticState(pair.target, capacity=len(prefix) + k, compiled=True, width=k)
    with torch.inference_mode():
        state.forward(prefix, keep=1)  # longer than the width: eager

        def once() -> tuple[torch.Tensor, float]:
            torch.compiler.cudagraph_mark_step_begin()
            logits, s = timed(lambda: state.forward(new[:k], keep=k).clone(), pair.device)
            state.truncate(len(prefix))
            return logits, s

        got, compile_s = once()
        once(), once()  # CUDA graphs record on the calls after the compiling one
        times = [once()[1] for _ in range(repeats)]
    diff = (got.float() - want.float()).abs().max().item()
    return {"compile_s": compile_s, "median_ms": statistics.median(times) * 1e3, "max_logit_diff": diff}


def phase_compiled_verify(speed: Speed, report: Report) -> dict[str, Any]:
    """The target's verify pass at each PROFILE_ROWS size, eager (the pair's lean forward) and
    compiled over our static state, while the budget leaves time for one more compile."""
    pair, p = speed.pair, speed.plan
    new = speed.ids[: max(PROFILE_ROWS)]
    eager = step_ms(pair.target_forward, speed.ids, new, PROFILE_ROWS, p.repeats)
    want = eager_logits(pair.target_forward, speed.ids, new, PROFILE_ROWS)
    out: dict[str, Any] = {"eager_ms": {str(k): v for k, v in eager.items()}, "compiled": {}, "skipped": []}
    need = COMPILE_GUESS_S if p.device.type == "cuda" else 0.0
    for k in PROFILE_ROWS:
        if report.left() <= need:
            out["skipped"].append(k)
            continue
        row = compiled_verify_ms(pair, speed.ids, new, want[k], p.repeats)
        row["eager_over_compiled"] = eager[k] / row["median_ms"]
        out["compiled"][str(k)] = row
        need = row["compile_s"]
    return out


# ---- end to end ----------------------------------------------------------------------------------
def replay_row(speed: Speed, acceptance: float) -> dict[str, Any]:
    pair, p = speed.pair, speed.plan
    drafter = ReplayDrafter(
        pair.draft, speed.ids + speed.ref, acceptance, seed=0, k=p.k, width=p.draft["vocab_size"]
    )
    (out, steps), s = timed(
        lambda: speculate(pair, speed.ids, "replay", p.e2e_tokens, drafter=drafter), p.device
    )
    n = sum(st.target_pass for st in steps)
    # "acceptance" is per position; a pass stops at its first miss, so accepted/drafted is lower
    return {
        "seconds": s,
        "tokens_per_s": len(out) / s,
        "identical": out == speed.ref,
        "passes": n,
        "tokens_per_pass": len(out) / n,
        "tokens_per_pass_expected": expected_tokens_per_pass(acceptance, p.k),
        "accepted_per_drafted": sum(st.accepted for st in steps) / max(1, sum(st.drafted for st in steps)),
    }


def assisted_per_pass(speed: Speed) -> dict[str, Any]:
    """transformers assisted generation with the 0.5B-shaped draft, k tokens per pass, timed per pass.
    It cannot take the replay drafter (``generate()`` builds its own candidate generator; the public
    ``custom_generate`` replaces the whole loop, ours then), so its random draft gets about no
    acceptance and the rows compare costs per pass: at acceptance a a pass adds E(a, k) tokens. The
    pair's logits widths differ: universal assisted decoding, as a user of this pair runs it."""
    from transformers import StoppingCriteriaList

    pair, p = speed.pair, speed.plan
    pair.draft.generation_config.update(
        num_assistant_tokens=p.k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0
    )
    assisted = dict(assistant_model=pair.draft, tokenizer=pair.tokenizer, assistant_tokenizer=pair.tokenizer)
    hf_greedy(pair.target, speed.ids[:16], 4, **assisted)  # warm-up
    calls = []

    def count(input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        calls.append(1)  # a stopping criterion that stops nothing: generate() calls it once per pass
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    stop = StoppingCriteriaList([count])
    tokens, s = timed(
        lambda: hf_greedy(pair.target, speed.ids, p.e2e_tokens, stopping_criteria=stop, **assisted), p.device
    )
    n = len(calls)
    return {"seconds": s, "passes": n, "per_pass_ms": s / n * 1e3, "tokens_per_pass": len(tokens) / n,
            "identical": tokens == speed.ref}  # fmt: skip


def phase_end_to_end(speed: Speed) -> dict[str, Any]:
    pair, p = speed.pair, speed.plan
    hf_greedy(pair.target, speed.ids[:16], 4)  # warm-up
    speculate(pair, speed.ids[:16], "none", 4)
    speed.ref, s = timed(lambda: hf_greedy(pair.target, speed.ids, p.e2e_tokens), p.device)
    rows: dict[str, Any] = {"transformers generate": {"seconds": s, "tokens_per_s": len(speed.ref) / s}}
    (out, _), s = timed(lambda: speculate(pair, speed.ids, "none", p.e2e_tokens), p.device)
    rows["agentspec none"] = {"seconds": s, "tokens_per_s": len(out) / s, "identical": out == speed.ref}
    for a in ACCEPTANCES:
        rows[f"agentspec replay {a}"] = replay_row(speed, a)
    rows["transformers assisted"] = assisted = assisted_per_pass(speed)
    comparison = {}
    for a in ACCEPTANCES:
        row = rows[f"agentspec replay {a}"]
        row["speedup_vs_generate"] = rows["transformers generate"]["seconds"] / row["seconds"]
        row["per_pass_ms"] = row["seconds"] / row["passes"] * 1e3
        projected = expected_tokens_per_pass(a, p.k) / (assisted["per_pass_ms"] / 1e3)
        comparison[str(a)] = {
            "agentspec_per_pass_ms": row["per_pass_ms"],
            "assisted_per_pass_ms": assisted["per_pass_ms"],
            "assisted_tokens_per_s_projected": projected,
            "speedup_vs_assisted_projected": row["tokens_per_s"] / projected,
        }
    speed.rows = rows
    return {"rows": rows, "vs_assisted_at_equal_acceptance": comparison, "k": p.k,
            "assisted_takes_replay_drafter": False}  # fmt: skip


# ---- prefix cache, batched calls ---------------------------------------------------------------
def peak(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """``fn()`` and the most device memory allocated above what was allocated before (CUDA only)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - before


def phase_prefix_cache(speed: Speed) -> dict[str, Any]:
    pair, p = speed.pair, speed.plan
    ids = (speed.ids * 4)[: 4 * p.prompt_tokens]
    cache = PrefixCache(1 << 36)

    def first_step(prompt: list[int]):
        calls = agentspec.stream(pair, prompt, None, prefix_cache=cache, max_new_tokens=2, speculative=False)
        step = next(calls)
        calls.close()  # a closed stream saves what it verified: the prompt's KV goes into the cache
        return step

    def restore():
        return cache.restore(pair, ids, {"target": pair.target})

    cold, cold_peak = peak(p.device, lambda: first_step(ids))
    restores = [timed(restore, p.device)[1] * 1e3 for _ in range(p.repeats)]
    states, restore_peak = peak(p.device, restore)
    restored = states["target"]
    warm, warm_peak = peak(p.device, lambda: first_step(ids + speed.ids[:8]))
    kv = sum(
        t.numel() * t.element_size() for layer in restored.cache.layers for t in (layer.keys, layer.values)
    )
    return {
        "prompt_tokens": len(ids),
        "restored_tokens": len(restored.ids),
        "restore_ms_median": statistics.median(restores),
        "restore_ms_min": min(restores),
        "ttft_cold_ms": cold.seconds * 1e3,
        "ttft_cached_ms": warm.seconds * 1e3,
        "cached_restored": warm.restored,
        "kv_bytes_restored": kv,
        "cache_bytes_used": cache.bytes_used,
        "peak_bytes": {"cold_call": cold_peak, "restore": restore_peak, "cached_call": warm_peak},
        "peak_measured": "torch.cuda.max_memory_allocated above the allocation before"
        if p.device.type == "cuda"
        else "not on this device: KV tensor bytes instead",
    }


def together(pair, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy outputs of ``prompts`` decoded at once: threads that all join the pair's scheduler before
    its first pass (the pair's lock is held until every one waits to join), plain decoding."""
    outs: list[Any] = [None] * len(prompts)

    def call(i: int) -> None:
        outs[i] = agentspec.generate(pair, prompts[i], None, False, max_new_tokens=n, speculative=False)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    waiting0 = pair.scheduler.stats.waiting
    with pair.lock:
        for t in threads:
            t.start()
        while pair.scheduler.stats.waiting - waiting0 < len(prompts):
            time.sleep(0.001)
    for t in threads:
        t.join()
    return [o.token_ids for o in outs]


def phase_batched(speed: Speed, report: Report) -> dict[str, Any]:
    """K calls at once on the 7B-shaped target share each pass (one forward over all their rows):
    tokens/s against K = 1, calls per pass, host reads per pass, and each call's output against the
    same prompt decoded alone (bfloat16: a packed pass's linears may round differently; counted)."""
    pair, p = speed.pair, speed.plan
    n = max(8, p.e2e_tokens // 2)
    prompts = [speed.ids[i:] + speed.ids[:i] for i in range(max(BATCH_SIZES))]  # one length, all distinct
    together(pair, prompts[:1], 4)  # warm-up
    alone = together(pair, prompts[:1], n)[0]
    rows: dict[str, Any] = {}
    for k in BATCH_SIZES:
        if report.left() < 30:
            rows[str(k)] = {"status": "skipped", "error": "out of time"}
            continue
        before = dataclasses.replace(pair.scheduler.stats)
        with HostSyncs(pair) as syncs:
            outs, s = timed(lambda k=k: together(pair, prompts[:k], n), p.device)
        st = pair.scheduler.stats
        n_passes = st.passes - before.passes
        rows[str(k)] = {
            "seconds": s,
            "tokens_per_s": k * n / s,
            "passes": n_passes,
            "calls_per_pass": (st.members - before.members) / n_passes,
            "host_reads_per_pass": syncs.count / n_passes,
            "first_identical_to_alone": outs[0] == alone,
        }
    base = rows["1"].get("tokens_per_s")
    for row in rows.values():
        if base and "tokens_per_s" in row:
            row["throughput_vs_k1"] = row["tokens_per_s"] / base
    return {"rows": rows, "new_tokens": n, "prompt_tokens": len(prompts[0])}


# ---- compiled baselines --------------------------------------------------------------------------
def compiled_step_ms(model, prefix: list[int], new: list[int], k: int, repeats: int) -> dict[str, float]:
    """transformers' StaticCache with the model's forward under ``torch.compile(mode="reduce-overhead")``
    (CUDA graphs on CUDA): compile seconds and median ms of a pass over k new tokens after
    ``prefix``; each pass rolls back by moving the cache's length (``crop``), not by copying."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=len(prefix) + max(VERIFY_SIZES))
    x = torch.tensor([new[:k]], device=model.device)
    step = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)  # one graph per part
    with torch.inference_mode():
        prefill = torch.tensor([prefix], device=model.device)
        model(input_ids=prefill, cache=cache, use_cache=True, logits_to_keep=1)

        def once() -> float:
            torch.compiler.cudagraph_mark_step_begin()
            _, s = timed(
                lambda: step(input_ids=x, cache=cache, use_cache=True, logits_to_keep=k), model.device
            )
            cache.crop(-k)
            return s

        compile_s = once()
        once(), once()  # CUDA graphs record on the calls after the compiling one
        times = [once() for _ in range(repeats)]
    return {"compile_s": compile_s, "median_ms": statistics.median(times) * 1e3}


def static_generate(speed: Speed) -> dict[str, Any]:
    """Compiled static-cache ``generate()`` (``agentspec.bench.systems.StaticCompiled``), timed after
    a compiling call, and agentspec's replay rows against it."""
    pair, p = speed.pair, speed.plan
    compiled = StaticCompiled(p.device, len(speed.ids) + p.e2e_tokens)

    def run(n: int) -> list[int]:
        return hf_greedy(pair.target, speed.ids, n, **compiled.options(pair.target, len(speed.ids), n))

    _, compile_s = timed(lambda: run(4), p.device)
    tokens, s = timed(lambda: run(p.e2e_tokens), p.device)
    row = {"compile_s": compile_s, "seconds": s, "tokens_per_s": len(tokens) / s,
           "identical": tokens == speed.ref}  # fmt: skip
    for a in ACCEPTANCES:
        replay = speed.rows.get(f"agentspec replay {a}")
        if replay:
            row[f"replay_{a}_speedup"] = s / replay["seconds"]
    return row


def phase_compiled(speed: Speed, report: Report) -> dict[str, Any]:
    """Each part runs while the budget leaves time for one more compile (as long as the last one
    took): compiled static-cache ``generate()`` end to end first (the goals' baseline), then the
    draft's one-token step and the target's (k+1)- and 1-token passes."""
    pair, p = speed.pair, speed.plan
    out: dict[str, Any] = {"parts_skipped": []}
    need = COMPILE_GUESS_S if p.device.type == "cuda" else 0.0
    if report.left() > need and speed.ref:
        out["static_generate"] = static_generate(speed)
        need = out["static_generate"]["compile_s"]
    else:
        out["parts_skipped"].append("static_generate")
    new = speed.ids[: max(VERIFY_SIZES)]
    for name, model, k in [("draft_step", pair.draft, 1), (f"target_{p.k + 1}", pair.target, p.k + 1),
                           ("target_1", pair.target, 1)]:  # fmt: skip
        if report.left() <= need:
            out["parts_skipped"].append(name)
            continue
        out[name] = compiled_step_ms(model, speed.ids, new, k, p.repeats)
        need = out[name]["compile_s"]
    if "draft_step" in out and "target_1" in out:
        out["draft_over_target"] = out["draft_step"]["median_ms"] / out["target_1"]["median_ms"]
    if f"target_{p.k + 1}" in out and "target_1" in out:
        out["verify_cost_k_plus_1"] = out[f"target_{p.k + 1}"]["median_ms"] / out["target_1"]["median_ms"]
    return out


# the goals on one H200, at acceptance 0.8 with the 7B/0.5B-shaped pair: (what, threshold)
GOALS = {
    "vs_generate": ("agentspec replay 0.8 vs eager generate()", 2.5),
    "vs_static_compiled": ("agentspec replay 0.8 vs compiled static-cache generate()", 1.8),
    "vs_assisted": ("agentspec replay 0.8 vs transformers assisted (per-pass costs, projected)", 1.3),
    "identity_float32": ("greedy float32 token-identical everywhere (measured: true or false)", 1.0),
}


def goals(phases: dict[str, Any], judged: bool) -> dict[str, Any]:
    """Each goal's measured figure (None where its phase did not run) and whether it is met;
    unless ``judged`` (a full run on CUDA), "met" is None: toy models on a CPU meet nothing."""
    e2e, compiled = phases.get("end_to_end", {}), phases.get("compiled", {})
    assisted = e2e.get("vs_assisted_at_equal_acceptance", {}).get("0.8", {})
    measured = {
        "vs_generate": e2e.get("rows", {}).get("agentspec replay 0.8", {}).get("speedup_vs_generate"),
        "vs_static_compiled": compiled.get("static_generate", {}).get("replay_0.8_speedup"),
        "vs_assisted": assisted.get("speedup_vs_assisted_projected"),
        "identity_float32": phases.get("identity", {}).get("identical_float32"),
    }
    out = {}
    for key, (what, t) in GOALS.items():
        m = measured[key]
        met = (m is not None and m >= t) if judged else None
        out[key] = {"goal": what, "threshold": t, "measured": m, "met": met}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("gpu_check", __doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="toy sizes: the same phases in 1-3 minutes on a CPU")
    ap.add_argument("--budget-s", type=float, default=210.0, help="phases and parts past this are skipped")
    args = ap.parse_args(argv)
    harness.set_threads(args.threads)
    plan = Plan.make(torch.device(args.device), args.quick, args.budget_s)
    report, speed = Report(args.out, plan), Speed(plan)
    report.phase("identity", lambda: phase_identity(plan))
    report.phase("syncs", lambda: phase_syncs(plan))
    report.phase("verify_cost", lambda: phase_verify_cost(speed))
    report.phase("profile", lambda: phase_profile(speed))
    report.phase("compiled_verify", lambda: phase_compiled_verify(speed, report))
    report.phase("end_to_end", lambda: phase_end_to_end(speed))
    report.phase("prefix_cache", lambda: phase_prefix_cache(speed))
    report.phase("batched", lambda: phase_batched(speed, report))
    report.phase("compiled", lambda: phase_compiled(speed, report))
    phases = report.data["phases"]
    report.data["goals"] = goals(phases, judged=plan.device.type == "cuda" and not plan.quick)
    harness.write(args.out, report.data)
    print(json.dumps({k: v["status"] for k, v in phases.items()}))
    return 0 if all(v["status"] == "ok" for v in phases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
