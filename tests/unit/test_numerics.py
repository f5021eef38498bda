"""Float32 identity's preconditions (``agentspec.numerics``): full-precision products pinned by a
float32 pair's load, and a transformers older than the cache API refused at import."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import agentspec
from agentspec.numerics import MIN_TRANSFORMERS, check_transformers, float32_flags

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lowered_precision():
    """PyTorch's float32 flags lowered as a training script might leave them; restored after."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


def test_a_float32_pair_pins_full_precision_products(lowered_precision, target, tokenizer):
    assert float32_flags()["float32_matmul_precision"] == "high"
    agentspec.load_pair(target, False, tokenizer=tokenizer, warm_up=False)
    flags = float32_flags()
    assert flags["float32_matmul_precision"] == "highest"
    assert flags["cudnn_allow_tf32"] is False
    assert flags["mkldnn_matmul_fp32_precision"] != "tf32"


def test_a_bfloat16_pair_leaves_the_flags(lowered_precision, tiny_llama, tokenizer):
    low = tiny_llama(0).to(torch.bfloat16)
    agentspec.load_pair(low, False, tokenizer=tokenizer, warm_up=False)
    assert float32_flags()["float32_matmul_precision"] == "high"


def test_flags_set_through_the_newer_spelling_read_and_pin():
    """PyTorch refuses to read ``allow_tf32`` once ``fp32_precision`` was set: recorded, not raised."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        flags = float32_flags()
        assert flags["cuda_matmul_fp32_precision"] == "tf32"
        assert isinstance(flags["cuda_matmul_allow_tf32"], str)  # "unreadable: ...", not an exception
        agentspec.numerics.pin_float32()
        assert float32_flags()["float32_matmul_precision"] == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("version", ["5.17.0", "5.23.1", "4.57.1"])
def test_an_older_transformers_is_refused_naming_the_version_needed(version):
    needed = r"transformers >= 5\.24 .*found transformers " + re.escape(version)
    with pytest.raises(ImportError, match=needed):
        check_transformers(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.24.0.dev0", "5.30.2", "6.0.0"])
def test_a_recent_transformers_passes(version):
    check_transformers(version)


def test_importing_agentspec_under_an_older_transformers_fails_with_the_message():
    code = "import transformers; transformers.__version__ = '5.17.0'; import agentspec"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "agentspec needs transformers >= 5.24" in done.stderr, done.stderr[-2000:]


def test_the_floor_is_the_distribution_pin():
    pin = re.search(r'"transformers>=([\d.]+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tuple(int(p) for p in pin.split(".")) == MIN_TRANSFORMERS
