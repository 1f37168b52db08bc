"""`benchmarks/bench_models.py --quick` runs end to end and writes a well-formed report: a
tiny Qwen3-MoE published in its checkpoint layout (one tensor per expert) and in its run-time
layout (fused experts). Its byte counts are checked for what must hold whatever the machine;
its timings are reported, not asserted (tests check correctness, the benchmark measures).
`benchmarks/bench_routers.py --quick` likewise: a tiny DeepSeek-V3's float32 routers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO

ENCODINGS = ("raw", "compact")
LAYOUTS = ("checkpoint", "runtime")


@pytest.mark.timeout(600)
def test_bench_models_quick_writes_results(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_models.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CPU figures" in result.stdout and "run-time reference:" in result.stdout
    assert "| delta file (mean) |" in result.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["machine"]["device"] == "cpu"
    model = report["model"]
    # Each layer's two fused tensors are 3 x experts checkpoint tensors.
    assert model["checkpoint_tensors"] - model["runtime_tensors"] == model["layers"] * (3 * model["experts"] - 2)
    assert 0 < model["expert_parameters"] < model["parameters"]

    steps = report["steps"]
    assert [row["version"] for row in steps] == [2, 3]
    for row in steps:
        assert 0 < row["changed_fraction"] < 1
        for encoding in ENCODINGS:
            for layout in LAYOUTS:
                cell = row[encoding][layout]
                assert cell["changed_elements"] == row["changed_elements"]
                assert cell["file"] == cell["payload"] + cell["header"] and cell["payload"] > 0 < cell["header"]
                # What the publisher stored is what the encoders make of the detector's changes.
                assert cell["payload"] == cell["direct_payload"], (encoding, layout)
                for key in ("blocking_seconds", "synchronous_seconds", "worker_seconds"):
                    assert cell[key] > 0, key
            # A checkpoint-layout delta names more tensors than a run-time one, at most all of them.
            checkpoint, runtime = row[encoding]["checkpoint"], row[encoding]["runtime"]
            assert runtime["tensors"] < checkpoint["tensors"] <= model["checkpoint_tensors"]
            assert checkpoint["header"] > runtime["header"]
        # Raw: int32 position + bf16 value per changed element, in either layout.
        assert row["raw"]["checkpoint"]["payload"] == row["raw"]["runtime"]["payload"] == 6 * row["changed_elements"]
        for layout in LAYOUTS:
            assert row["compact"][layout]["file"] < row["raw"][layout]["file"], layout
        experts = row["experts"]
        assert experts["experts"] == model["layers"] * model["experts"] == len(experts["fractions"])
        assert all(0 <= f <= 1 for f in experts["fractions"])
        assert experts["min"] <= experts["median"] <= experts["max"] and experts["max"] > 0
        assert experts["unchanged"] == sum(f == 0 for f in experts["fractions"]) == len(experts["unchanged_ids"])
        assert 0 <= experts["unrouted_but_changed"] <= experts["unrouted"] < experts["experts"]
        assert row["map_changes_seconds"] > 0

    summary = report["summary"]
    for encoding in ENCODINGS:
        per = summary[encoding]
        assert per["file_ratio"] > 0 and per["blocking_ratio"] > 0 and per["synchronous_ratio"] > 0
        assert all(per[layout]["payload_matches_direct_encoding"] for layout in LAYOUTS)
    assert summary["raw"]["payload_ratio"] == 1
    assert 0 <= summary["experts"]["min"] <= summary["experts"]["median"] <= summary["experts"]["max"] <= 1
    thread = summary["training_thread"]
    assert thread["calls"] == 2 * len(steps)
    assert 0 < thread["checkpoint"] <= thread["checkpoint_median"] and 0 < thread["runtime"] <= thread["runtime_median"]
    targets = summary["targets"]
    assert len(targets) == 5
    for target in targets:
        assert target["met"] == (target["value"] <= target["limit"])
        assert f"target: {target['name']}" in result.stdout


@pytest.mark.timeout(600)
def test_bench_routers_quick_writes_results(tmp_path):
    """`benchmarks/bench_routers.py --quick`: a tiny DeepSeek-V3 whose routers travel in float32,
    against the same model with its routers published through their bf16 rounding."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_routers.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| per delta (mean) | float32 routers |" in result.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["model"]["float32_tensors"] == [
        "model.layers.0.mlp.gate.e_score_correction_bias",
        "model.layers.0.mlp.gate.weight",
    ]
    steps = report["steps"]
    assert [row["version"] for row in steps] == [2, 3]
    for row in steps:
        # AdamW moves nearly every float32 bit pattern of the router, few bf16 ones.
        assert 0 < row["router_changed_fraction"]["bf16"] < row["router_changed_fraction"]["float32"] <= 1
        float32 = {encoding: row[encoding]["float32"] for encoding in ENCODINGS}
        # A compact file holds float32 tensors as the raw file's entries.
        assert float32["raw"]["router_entries"] == float32["compact"]["router_entries"] > 0
        for encoding in ENCODINGS:
            assert float32[encoding]["file"] > row[encoding]["bf16"]["file"]
    (target,) = report["summary"]["targets"]
    assert target["met"] == (target["value"] <= target["limit"])
    assert f"target: {target['name']}" in result.stdout
