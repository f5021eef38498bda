"""The numbers a float32 pair computes with: full float32 products, and the transformers it needs.

Greedy speculation is promised token-identical to plain decoding in float32. That holds only when a
pass over k rows and a pass over one row round alike, which TF32 (CUDA's matmuls and cuDNN) and
oneDNN's bfloat16 products for float32 (``torch.set_float32_matmul_precision("medium")`` on a CPU)
break: their rounding depends on the product's shape. So ``load_pair`` pins full precision for a
float32 pair (``pin_float32``), process-wide since these are PyTorch's global flags, and says so in
the log when it changed one a caller had set. bfloat16 pairs are lossless in distribution only and
are left alone.

PyTorch has two spellings of these flags (``allow_tf32`` and ``fp32_precision``); reading one after a
caller set the other raises, so ``float32_flags`` reads each under its own guard.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import transformers

log = logging.getLogger(__name__)

# the first transformers whose models take the KV cache as ``cache=``, as every agentspec pass passes
# it; older ones take ``past_key_values=`` and silently ignore ``cache=`` (each pass would recompute
# the whole sequence with no cache, and the KV states would stay empty)
MIN_TRANSFORMERS = (5, 24)


def check_transformers(version: str) -> None:
    """Raise ImportError, naming the version needed, when ``version`` is older than MIN_TRANSFORMERS."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(
            f"agentspec needs transformers >= {need} (its passes hand models the KV cache as `cache=`, "
            f"which older releases ignore); found transformers {version}: pip install 'transformers>={need}'"
        )


def _read(read) -> Any:
    try:
        return read()
    except (RuntimeError, AttributeError) as exc:  # the other spelling was set first; or an older torch
        return f"unreadable: {str(exc).split(',')[0]}"


def float32_flags() -> dict[str, Any]:
    """PyTorch's float32 precision flags as they stand: what the check records beside each run."""
    backends = torch.backends
    return {
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "cuda_matmul_allow_tf32": _read(lambda: backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": _read(lambda: backends.cudnn.allow_tf32),
        "cuda_matmul_fp32_precision": _read(lambda: backends.cuda.matmul.fp32_precision),
        "cudnn_conv_fp32_precision": _read(lambda: backends.cudnn.conv.fp32_precision),
        "mkldnn_matmul_fp32_precision": _read(lambda: backends.mkldnn.matmul.fp32_precision),
    }


def pin_float32() -> dict[str, Any]:
    """Full float32 products in every backend (no TF32 on CUDA, no bfloat16 on oneDNN); returns the
    flags as they were where this changed them (empty: they already were)."""
    before = float32_flags()
    torch.set_float32_matmul_precision("highest")  # CUDA's matmuls and oneDNN's alike
    torch.backends.cudnn.allow_tf32 = False
    after = float32_flags()
    changed = {k: v for k, v in before.items() if after[k] != v}
    # PyTorch's own default leaves cuDNN's TF32 on (for convolutions): turning it off is routine; a
    # matmul precision lowered by the caller is worth a warning
    lowered = before["float32_matmul_precision"] != "highest"
    if changed:
        say = log.warning if lowered else log.info
        say("float32 pair: full-precision products pinned (were %s)", changed)
    return changed


check_transformers(transformers.__version__)  # at import: before any pass hands a model `cache=`
