"""The roofline of one decode step: weights read per step over the machine's memory bandwidth.

A batch-1 decode step reads every weight once and does about two flops per weight, so on a CPU (and
on a GPU at small batch) its floor is ``bytes of weights / memory bandwidth``. A verify pass over k
tokens reads the same weights once for all k, which is why verifying costs little more than one
step until compute catches up: the verify-cost curve T(k)/T(1) says where.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from agentspec.bench.workloads import CODE, SEARCH, WEATHER
from agentspec.drafters.eagle import is_eagle
from agentspec.kv import ModelState


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a timer sees all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, mib: int = 512, repeats: int = 7) -> dict[str, Any]:
    """Bytes per second of a full read of a ``mib`` MiB float32 tensor (``sum``), median of repeats.

    Reading, as a decode step reads its weights; the tensor is far larger than the CPU's caches.
    """
    x = torch.ones(mib << 18, dtype=torch.float32, device=device)  # mib MiB of 4-byte floats
    x.sum()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    bytes_read = x.numel() * x.element_size()
    del x
    return {
        "bytes": bytes_read,
        "threads": torch.get_num_threads(),
        "median_gb_s": bytes_read / statistics.median(times) / 1e9,
        "best_gb_s": bytes_read / min(times) / 1e9,
    }


def bytes_per_step(model, shared_with=None) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer once, except the input
    embedding matrix (one row is read) unless the LM head reads it too (tied weights); tensors
    shared with ``shared_with`` (a draft on its target's embeddings) are not counted."""
    shared = [*shared_with.parameters(), *shared_with.buffers()] if shared_with is not None else []
    skip = {t.data_ptr() for t in shared}
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    if head_weight is None or head_weight.data_ptr() != embed.data_ptr():
        skip.add(embed.data_ptr())
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in skip:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def eagle_bytes_per_step(head) -> int:
    """Bytes an EAGLE head's step reads: its own weights and the LM-head rows it scores (one
    embedding row aside); the target's feature comes with the verify pass."""
    head_weight = head.get_output_embeddings().weight
    own = sum(t.numel() * t.element_size() for t in head.parameters())
    return own + head_weight.numel() * head_weight.element_size()


def eagle_step_ms(head, cache_len: int, repeats: int) -> list[float]:
    """Times (ms) of one EAGLE head step (one token, its LM head) after ``cache_len`` cached entries."""
    from transformers import DynamicCache

    d = head.config.hidden_size
    feats = torch.zeros((1, cache_len + 1, d), device=head.device, dtype=head.dtype)
    ids = torch.arange(cache_len + 1, device=head.device)[None] % 1000
    cache = DynamicCache(config=head.decoder.config)
    times = []
    with torch.inference_mode():
        head.hidden(feats[:, :cache_len], ids[:, :cache_len], cache)
        for r in range(repeats + 1):  # round 0 warms up and is dropped
            t0 = time.perf_counter()
            head(feats[:, -1:], ids[:, -1:], cache)
            synchronize(head.device)
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
            cache.crop(cache_len - cache.get_seq_length())  # transformers 5.x: a count to remove
    return times


def verify_cost(model, tokenizer, sizes: list[int], cache_len: int, repeats: int) -> dict[str, Any]:
    """Median time of one forward pass over k new tokens after a cache_len-token cache, per k."""
    text = (WEATHER + CODE + SEARCH) * 4
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= cache_len + max(sizes), f"{len(ids)=} too short"
    prefix, new = ids[:cache_len], ids[cache_len : cache_len + max(sizes)]
    state = ModelState(model)
    state.forward(prefix, keep=1)
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for r in range(repeats + 1):  # round 0 warms up and is dropped
        order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]  # rotate: drift hits every k
        for k in order:
            t0 = time.perf_counter()
            state.forward(new[:k], keep=k)  # a verify pass keeps a logits row per new token
            synchronize(model.device)
            dt = time.perf_counter() - t0
            state.truncate(cache_len)
            if r:
                times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "cache_tokens": cache_len,
        "repeats": repeats,
        "points": [
            {
                "new_tokens": k,
                "median_ms": med[k] * 1e3,
                "min_ms": min(times[k]) * 1e3,
                "max_ms": max(times[k]) * 1e3,
                "ratio_to_1": med[k] / med[sizes[0]],
            }
            for k in sizes
        ],
    }


def roofline(pair, sizes: list[int], repeats: int, cache_len: int = 300) -> dict[str, Any]:
    """Bandwidth, bytes per step and measured step times of target (verify-cost curve) and draft."""
    bw = read_bandwidth(pair.device)
    out: dict[str, Any] = {"bandwidth": bw, "models": {}}
    models = {"target": (pair.target, None, sizes)}
    if pair.draft is not None:
        models["draft"] = (pair.draft, pair.target, [1])
    for name, (model, shared, ks) in models.items():
        if is_eagle(model):
            n_bytes = eagle_bytes_per_step(model)
            times = eagle_step_ms(model, cache_len, repeats)
            point = {"new_tokens": 1, "median_ms": statistics.median(times), "min_ms": min(times),
                     "max_ms": max(times), "ratio_to_1": 1.0}  # fmt: skip
            curve = {"cache_tokens": cache_len, "repeats": repeats, "points": [point]}
        else:
            n_bytes = bytes_per_step(model, shared)
            curve = verify_cost(model, pair.tokenizer, ks, cache_len, repeats)
        bound_ms = n_bytes / (bw["median_gb_s"] * 1e9) * 1e3
        step_ms = curve["points"][0]["median_ms"]
        out["models"][name] = {
            "bytes_per_step": n_bytes,
            "bound_ms": bound_ms,
            "step_ms": step_ms,
            "fraction_of_bound": bound_ms / step_ms,  # 1.0 = at the memory-bandwidth floor
            "verify_cost": curve,
        }
    return out
