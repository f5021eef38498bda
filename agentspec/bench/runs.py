"""What ran during some passes, read from ``torch.profiler``: kernels launched, the runtime calls that
made the host wait, the attention kernel each SDPA call took, and the versions and flags behind them.

A speed figure means little without what produced it: on a GPU a pass's time is set by how many
kernels it launches and how often the host waits for the device, and SDPA picks its kernel (flash,
cuDNN, memory-efficient, math) per call from the inputs' shapes, dtype and mask. The profiler names
the kernel SDPA dispatched to as an op (``aten::_scaled_dot_product_flash_attention`` ...), so a
profile of a few passes tells which one each kind of pass took.
"""

from __future__ import annotations

import platform
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from agentspec.numerics import float32_flags

# the op SDPA dispatched to -> the kernel's name (``aten::`` left off)
ATTENTION = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_fused_attention_overrideable": "fused (overrideable)",
}
# CUDA runtime calls after which the host has waited for the device (a blocking memcpy: pageable)
SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cuMemcpy"}
)


@dataclass
class Ran:
    """What a profiled stretch ran, in all and per pass (``per(passes)``)."""

    ops: int = 0  # ops called from Python (not from inside another op): each at least one launch on a GPU
    kernels: int | None = None  # device kernels (CUDA; None on a CPU)
    copies: dict[str, int] = field(default_factory=dict)  # device memcpy/memset events by kind (CUDA)
    syncs: int | None = None  # runtime calls that made the host wait (SYNC_CALLS; CUDA)
    attention: dict[str, int] = field(default_factory=dict)  # SDPA kernel -> calls

    def add(self, other: Ran) -> None:
        self.ops += other.ops
        if other.kernels is not None:
            self.kernels = (self.kernels or 0) + other.kernels
        if other.syncs is not None:
            self.syncs = (self.syncs or 0) + other.syncs
        for mine, theirs in ((self.copies, other.copies), (self.attention, other.attention)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v

    def per(self, passes: int) -> dict[str, Any]:
        """The counts, and each per pass over ``passes`` passes."""
        n = max(passes, 1)
        out = asdict(self) | {"passes": passes, "ops_per_pass": self.ops / n}
        out["kernels_per_pass"] = None if self.kernels is None else self.kernels / n
        out["syncs_per_pass"] = None if self.syncs is None else self.syncs / n
        return out


class Profiled:
    """A block under ``torch.profiler`` (CPU and, on CUDA, the device); ``ran``: what it ran, once
    the block is left (the device's queue drained first, so every kernel it launched is counted)."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        self.cuda = device.type == "cuda"
        self.device = device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profile = profile(activities=activities)
        self.ran = Ran()

    def __enter__(self) -> Profiled:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._profile.__exit__(*exc)
        self.ran = read(self._profile.events(), self.cuda)
        if self.cuda and self.ran.syncs:
            self.ran.syncs -= 1  # the drain above


def profiled(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Ran]:
    """``fn()``'s result and what it ran."""
    with Profiled(device) as block:
        out = fn()
    return out, block.ran


@contextmanager
def in_passes(pair: Any) -> Iterator[Ran]:
    """Within the block, each of ``pair``'s passes runs under a profiler of its own, in the pass thread
    (a profiler sees the thread that started it only; the calls' drafting runs there too); the
    yielded ``Ran`` sums them."""
    cuda = pair.device.type == "cuda"
    total = Ran(kernels=0 if cuda else None, syncs=0 if cuda else None)

    @contextmanager
    def one_pass() -> Iterator[None]:
        with Profiled(pair.device) as block:
            yield
        total.add(block.ran)

    with pair.scheduler.observing(one_pass):
        yield total


def read(events, cuda: bool) -> Ran:
    """A ``Ran`` from a profile's events."""
    ran = Ran(kernels=0 if cuda else None, syncs=0 if cuda else None)
    attention: Counter[str] = Counter()
    copies: Counter[str] = Counter()
    for ev in events:
        name = ev.name
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if name.startswith(("Memcpy", "Memset")):
                copies[name.split(" (")[0]] += 1
            elif ran.kernels is not None:
                ran.kernels += 1
            continue
        if name in SYNC_CALLS and ran.syncs is not None:
            ran.syncs += 1
        if name.startswith("aten::"):
            if ATTENTION.get(name[6:]):
                attention[ATTENTION[name[6:]]] += 1
            parent = ev.cpu_parent
            if parent is None or not parent.name.startswith("aten::"):
                ran.ops += 1
    ran.attention, ran.copies = dict(attention), dict(copies)
    return ran


def versions() -> dict[str, Any]:
    """torch, CUDA, cuDNN and transformers versions, SDPA's enabled kernels and the float32 flags."""
    import transformers

    backends = torch.backends.cuda
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "float32_flags": float32_flags(),
    }
    if torch.cuda.is_available():
        out["sdpa_enabled"] = {
            "flash": backends.flash_sdp_enabled(),
            "cudnn": backends.cudnn_sdp_enabled(),
            "memory-efficient": backends.mem_efficient_sdp_enabled(),
            "math": backends.math_sdp_enabled(),
        }
    return out
