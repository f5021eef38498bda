"""``python -m benchmarks gpu-check --device cpu --quick``: the device check's CPU mode in a fresh process,
its JSON read back: every phase's code path runs here, so a GPU lease is not spent finding a bug."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the product first (batch 1, then batch 8 drafting), then identity, ..., anything compiled last
PHASES = [
    "end_to_end", "batched", "identity", "syncs", "roofline", "profile", "prefix_cache", "assisted",
    "compiled_verify", "compiled",
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
    assert data["wall_s"] < data["plan"]["budget_s"]
    what_runs = data["environment"]["what_runs"]
    assert {"torch", "transformers", "cuda", "cudnn", "float32_flags"} <= set(what_runs)

    e2e = phases["end_to_end"]
    for a in (0.8, 0.5):
        row = e2e["rows"][f"agentspec replay {a}"]
        assert row["identical"] and row["drafted"] > 0 and row["passes"] > 0, row
    ran = e2e["ran_replay"]
    assert ran["host_reads_per_pass"] == 1.0, ran  # the verification's one read, the draft on the device
    assert ran["ops_per_pass"] > 0 and sum(ran["attention"].values()) > 0, ran

    batched = phases["batched"]
    replay = batched["rows"]["replay 0.8"]
    assert replay["drafted"] > 0 and replay["calls_per_pass"] > 1, replay
    assert batched["rows"]["plain"]["calls_per_pass"] == 8
    assert replay["identical_to_plain"] == 8  # float32 on a CPU
    for key in ("ran_plain", "ran_replay"):
        assert batched[key]["host_reads_per_pass"] >= 1 and batched[key]["attention"], batched[key]

    identity = phases["identity"]
    assert identity["identical_float32"], identity["float32"]["rows"]
    assert identity["float32"]["float32_flags"]["float32_matmul_precision"] == "highest"
    assert identity["float32"]["float32_flags"]["cudnn_allow_tf32"] is False
    rows = identity["float32"]["rows"]
    # six drafters and two on the static draft cache, with and without the prefix cache
    assert len(rows) == 16
    assert all(r["restored"] > 0 for key, r in rows.items() if key.endswith(" cached"))
    assert sum(r["accepted"] for r in rows.values()) > 0
    syncs = phases["syncs"]["rows"]
    assert syncs["none"]["per_pass"] > 0 and syncs["model"]["passes"] > 0

    roof = phases["roofline"]
    assert set(roof["target_ms"]) == {"1", "2", "3", "4", "5", "8", "16"}
    assert roof["bandwidth"]["best_gb_s"] > 0 and roof["verify_pass_over_floor"] > 1
    kinds = phases["profile"]["kinds"]
    assert set(kinds) == {"prefill", "decode_1", "verify_5", "verify_17", "draft_step"}
    assert all(k["ran"]["attention"] for k in kinds.values()), kinds
    assert "linear" in kinds["decode_1"]["categories_ms"]
    assert phases["prefix_cache"]["restored_tokens"] == phases["prefix_cache"]["prompt_tokens"] - 1
    assert phases["assisted"]["row"]["passes"] > 0
    verify = phases["compiled_verify"]
    assert set(verify["eager_ms"]) == set(verify["compiled"]) == {"1", "5", "17"} and not verify["skipped"]
    assert all(row["max_logit_diff"] < 1e-3 for row in verify["compiled"].values()), verify["compiled"]
    compiled = phases["compiled"]
    assert compiled["parts_skipped"] == [] and compiled["static_generate"]["identical"]
