"""``python -m benchmarks gpu-check --device cpu --quick``: the device check's CPU mode in a fresh process,
its JSON read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = [
    "identity", "syncs", "verify_cost", "profile", "compiled_verify", "end_to_end", "prefix_cache", "batched",
    "compiled",
]  # fmt: skip


def test_the_quick_cpu_run_reports_every_phase(tmp_path):
    """In the default suite: a phase that errors fails CI, not a later GPU lease."""
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "-m", "benchmarks", "gpu-check", "--device", "cpu", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    phases = data["phases"]
    assert list(phases) == PHASES
    for name, record in phases.items():
        assert record["status"] == "ok" and record["error"] is None, f"{name}: {record}"
        assert record["seconds"] > 0
    identity = phases["identity"]
    assert identity["identical_float32"], identity["float32"]["rows"]
    rows = identity["float32"]["rows"]
    # six drafters and two on the static draft cache, with and without the prefix cache
    assert len(rows) == 16
    assert all(r["restored"] > 0 for key, r in rows.items() if key.endswith(" cached"))
    assert sum(r["accepted"] for r in rows.values()) > 0
    syncs = phases["syncs"]["rows"]
    assert syncs["none"]["per_pass"] > 0 and syncs["model"]["passes"] > 0
    assert set(phases["verify_cost"]["target_ms"]) == {"1", "2", "3", "4", "5", "8", "16"}
    profile = phases["profile"]
    assert set(profile["target"]) == set(profile["target_profile"]) == {"1", "5", "17"}
    assert "linear" in profile["target_profile"]["1"]["categories_ms"]
    verify = phases["compiled_verify"]
    assert set(verify["eager_ms"]) == set(verify["compiled"]) == {"1", "5", "17"} and not verify["skipped"]
    assert all(row["max_logit_diff"] < 1e-3 for row in verify["compiled"].values()), verify["compiled"]
    e2e = phases["end_to_end"]["rows"]
    assert all(e2e[f"agentspec replay {a}"]["identical"] for a in (0.6, 0.8, 0.95))
    assert e2e["transformers assisted"]["passes"] > 0
    assert phases["prefix_cache"]["restored_tokens"] == phases["prefix_cache"]["prompt_tokens"] - 1
    batched = phases["batched"]["rows"]
    assert batched["8"]["calls_per_pass"] > 1 and batched["32"]["calls_per_pass"] > 1
    assert all(row["first_identical_to_alone"] for row in batched.values())  # float32 on a CPU
    compiled = phases["compiled"]
    assert compiled["parts_skipped"] == [] and compiled["static_generate"]["identical"]
