"""``load_pair``'s default dtype: ``$AGENTSPEC_DTYPE``, else bfloat16 on a GPU and float32 on a CPU
(``agentspec.models.default_dtype``)."""

from __future__ import annotations

import pytest
import torch

from agentspec import models

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_a_cpu_defaults_to_float32_and_a_gpu_to_bfloat16(monkeypatch):
    monkeypatch.delenv("AGENTSPEC_DTYPE", raising=False)
    assert models.default_dtype(CPU) == torch.float32  # every path token-identical (default_dtype's doc)
    assert models.default_dtype(CUDA) == torch.bfloat16


def test_the_environment_names_the_default(monkeypatch):
    monkeypatch.setenv("AGENTSPEC_DTYPE", "float16")
    assert models.default_dtype(CUDA) == torch.float16
    assert models._resolve_dtype("auto", CPU) == torch.float16
    assert models._resolve_dtype("bfloat16", CPU) == torch.bfloat16  # a dtype named in the call wins
    monkeypatch.setenv("AGENTSPEC_DTYPE", "float33")
    with pytest.raises(ValueError, match="float33"):
        models.default_dtype(CPU)
