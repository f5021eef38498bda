"""Training data from the target itself: its responses and, per position, its top-k log-probs.

For each prompt the target writes a response with ``model.generate`` (left-padded batches; greedy
for a share of the prompts, sampled at a temperature for the rest, seeded per batch). The teacher
distribution at every response position is the target's raw, unprocessed logits of that same
generation step (``output_logits``), reduced to the top-k ids and their log-probs (float16): the
distribution of the target given the prompt and the response so far, which is what a teacher-forced
pass over prompt + response would give, without paying for that second pass. The log-probs are the
target's at temperature 1, whatever temperature chose the tokens. Only prompt positions need an
extra forward pass (``store_prompt_positions``).

Shards: ``<folder>/{split}-{i:05d}.pt``, each ``torch.save`` of a dict of lists of tensors, written
to a temporary name and renamed, so a shard is either whole or absent and an interrupted run starts
again at the first missing shard. Shard ``i`` of a split holds that split's prompts
``[i * shard_prompts, (i + 1) * shard_prompts)`` and its sampling seeds depend only on ``(seed,
split, i)``: a resumed run writes the shards a complete run would have written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentspec.distill.config import DATA_FIELDS, DistillConfig


@dataclass
class PromptItem:
    ids: list[int]  # the rendered prompt's token ids
    kind: str  # its category (agentspec.distill.prompts.KINDS, or "custom")
    greedy: bool  # answered greedily (else sampled)


@dataclass
class Example:
    """One prompt and the target's response, with the teacher distributions to learn from.

    ``topk_ids[j]``/``topk_logp[j]`` are the teacher's top-k for the token at ``ids[first + j]``,
    predicted from ``ids[: first + j]``. ``first`` is ``start`` (the response) or 1 when prompt
    positions were stored.
    """

    ids: torch.Tensor  # [L] prompt + response, int64
    start: int  # length of the prompt
    first: int  # position of the first token that has a teacher distribution
    topk_ids: torch.Tensor  # [L - first, k] int32, sorted by probability (column 0: the argmax)
    topk_logp: torch.Tensor  # [L - first, k] float16
    kind: str
    greedy: bool
    features: torch.Tensor | None = None  # [L, H] float16: the target's features (EAGLE heads only)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (ids [..., k] int32, log-probs [..., k] float16), most probable first."""
    logp = F.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] ids, [B, T] attention mask) with each sequence right-aligned."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        if s:
            ids[row, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[row, width - len(s) :] = 1
    return ids, mask


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """The response up to and including its first EOS (later tokens are generate's padding)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def respond(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    greedy: bool,
    temperature: float,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    k: int,
    seed: int,
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """(response, top-k ids, top-k log-probs) of the target for each prompt, from one generate call."""
    from transformers import GenerationConfig

    ids, mask = left_pad(prompts, pad_id)
    device = model.device
    config = GenerationConfig(
        do_sample=not greedy,
        temperature=temperature if not greedy else None,
        top_k=0 if not greedy else None,  # sample from the whole (tempered) distribution
        top_p=1.0 if not greedy else None,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos_ids) or None,
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    torch.manual_seed(seed)  # generate samples from the global generator
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    new = out.sequences[:, ids.shape[1] :].cpu()
    # out.logits: one [B, V] tensor per generated step, raw (before temperature or any processor)
    steps = [topk_logprobs(step_logits, k) for step_logits in out.logits]
    top_ids = torch.stack([s[0].cpu() for s in steps], dim=1)  # [B, T, k]
    top_logp = torch.stack([s[1].cpu() for s in steps], dim=1)
    results = []
    for row in range(len(prompts)):
        response = cut_at_eos(new[row].tolist(), eos_ids)
        n = len(response)
        results.append((response, top_ids[row, :n].clone(), top_logp[row, :n].clone()))
    return results


@torch.inference_mode()
def prompt_topk(model, ids: Sequence[int], start: int, k: int, chunk: int = 512):
    """The teacher's top-k for prompt positions 1..start-1 (one forward pass over the prompt)."""
    x = torch.tensor([list(ids[:start])], dtype=torch.long, device=model.device)
    hidden = model.model(input_ids=x).last_hidden_state[0, :-1]  # [start - 1, H]
    head = model.get_output_embeddings()  # in chunks: a [start, V] logits tensor can be large
    parts = [topk_logprobs(head(hidden[i : i + chunk]), k) for i in range(0, len(hidden), chunk)]
    if not parts:
        return torch.zeros((0, k), dtype=torch.int32), torch.zeros((0, k), dtype=torch.float16)
    return torch.cat([p[0] for p in parts]).cpu(), torch.cat([p[1] for p in parts]).cpu()


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def shard_path(folder: Path, split: str, index: int) -> Path:
    return folder / f"{split}-{index:05d}.pt"


def generation_batches(items: Sequence[PromptItem], max_prompts: int, max_tokens: int) -> list[list[int]]:
    """Indices of ``items`` in generate calls: one mode each, by length, at most ``max_prompts``
    prompts and ``max_tokens`` padded prompt tokens (a longer prompt goes alone).

    Left padding makes every prompt of a call as long as its longest: the built-in prompts run from
    ~40 tokens (chat) to ~700 (agent turns with tool schemas), so one call over both would prefill
    several times the real prompt tokens. Short prompts share a call, long ones take small calls.
    """
    order = sorted(range(len(items)), key=lambda i: (not items[i].greedy, len(items[i].ids)))
    batches: list[list[int]] = []
    for i in order:
        cur = batches[-1] if batches else None
        if (
            cur is None
            or items[cur[0]].greedy != items[i].greedy
            or len(cur) + 1 > max_prompts
            or len(items[i].ids) * (len(cur) + 1) > max_tokens  # sorted: i is the longest
        ):
            batches.append([i])
        else:
            cur.append(i)
    return batches


def make_shard(
    model, items: Sequence[PromptItem], cfg: DistillConfig, split_seed: int, eos_ids, pad_id
) -> dict:
    """Answer ``items`` and collect the shard dict (lists of per-example tensors)."""
    t0 = time.perf_counter()
    shard: dict[str, list] = {
        k: [] for k in ("ids", "start", "first", "topk_ids", "topk_logp", "kind", "greedy")
    }
    done: dict[int, tuple] = {}
    for b, batch in enumerate(generation_batches(items, cfg.gen_batch_size, cfg.gen_batch_tokens)):
        results = respond(
            model,
            [items[i].ids for i in batch],
            greedy=items[batch[0]].greedy,
            temperature=cfg.sample_temperature,
            max_new_tokens=cfg.max_new_tokens,
            eos_ids=eos_ids,
            pad_id=pad_id,
            k=cfg.top_k,
            seed=split_seed * 1_000_003 + b,
        )
        done.update(zip(batch, results))
    for i, item in enumerate(items):  # back in prompt order
        response, top_ids, top_logp = done[i]
        start, first = len(item.ids), len(item.ids)
        if cfg.prompt_positions and start > 1:
            p_ids, p_logp = prompt_topk(model, item.ids, start, cfg.top_k)
            top_ids, top_logp, first = torch.cat([p_ids, top_ids]), torch.cat([p_logp, top_logp]), 1
        shard["ids"].append(torch.tensor(item.ids + response, dtype=torch.long))
        shard["start"].append(start)
        shard["first"].append(first)
        shard["topk_ids"].append(top_ids)
        shard["topk_logp"].append(top_logp)
        shard["kind"].append(item.kind)
        shard["greedy"].append(item.greedy)
    shard["seconds"] = time.perf_counter() - t0
    return shard


def check_meta(folder: Path, meta: dict) -> None:
    """Write ``meta.json`` on a fresh folder; refuse a folder made with other data options."""
    path = folder / "meta.json"
    if path.exists():
        old = json.loads(path.read_text())
        for name in meta:
            if old.get(name) != meta[name]:
                raise ValueError(
                    f"{name}: {meta[name]!r} differs from {old.get(name)!r} used for the data in {folder}; "
                    "use the same value, another --out folder, or resume=False to start over"
                )
    else:
        atomic_write_text(path, json.dumps(meta, indent=1))


def data_meta(cfg: DistillConfig, target_name: str, n_train: int, n_eval: int) -> dict:
    meta = {name: getattr(cfg, name) for name in DATA_FIELDS}
    return {**meta, "target": target_name, "train_prompts": n_train, "eval_prompts": n_eval}


@dataclass
class SplitResult:
    shards: int  # shards present (written now or before)
    prompts: int  # prompts they hold
    seconds: float  # time spent generating them (this run and earlier ones)

    @property
    def seconds_per_prompt(self) -> float | None:
        return self.seconds / self.prompts if self.prompts else None


def build_split(
    model,
    items: Sequence[PromptItem],
    folder: Path,
    split: str,
    cfg: DistillConfig,
    *,
    eos_ids: set[int],
    pad_id: int,
    deadline: float | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> SplitResult:
    """Write the shards of ``split`` still missing, in order.

    With a ``deadline`` (``time.monotonic()``), a shard is not started when it would end after the
    deadline at the time per prompt measured so far: the data stage ends early, with complete
    shards only, and at least one. ``on_shard(n_prompts)`` is called after each shard (a progress bar).
    """
    size = cfg.shard_prompts
    n_shards = (len(items) + size - 1) // size
    done = SplitResult(0, 0, 0.0)
    split_salt = {"train": 0, "eval": 1}.get(split, 2)
    for index in range(n_shards):
        path = shard_path(folder, split, index)
        chunk = items[index * size : (index + 1) * size]
        if path.exists():
            seconds = float(torch.load(path, map_location="cpu", weights_only=False)["seconds"])
        else:
            rate = done.seconds_per_prompt or 0.0
            # the first shard is always written: a run without training data is no use at all
            if deadline is not None and done.shards and time.monotonic() + rate * len(chunk) > deadline:
                break
            split_seed = (cfg.seed * 4 + split_salt) * 100_003 + index
            shard = make_shard(model, chunk, cfg, split_seed, eos_ids, pad_id)
            atomic_save(shard, path)
            seconds = shard["seconds"]
        done = SplitResult(done.shards + 1, done.prompts + len(chunk), done.seconds + seconds)
        if on_shard:
            on_shard(len(chunk))
    return done


def load_examples(folder: Path, split: str) -> list[Example]:
    """Every example of ``split``'s shards, in shard order (stops at the first missing shard)."""
    out: list[Example] = []
    index = 0
    while (path := shard_path(folder, split, index)).exists():
        shard = torch.load(path, map_location="cpu", weights_only=False)
        for j in range(len(shard["ids"])):
            out.append(
                Example(
                    ids=shard["ids"][j],
                    start=int(shard["start"][j]),
                    first=int(shard["first"][j]),
                    topk_ids=shard["topk_ids"][j],
                    topk_logp=shard["topk_logp"][j],
                    kind=shard["kind"][j],
                    greedy=bool(shard["greedy"][j]),
                )
            )
        index += 1
    return out
