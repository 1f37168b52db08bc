"""`benchmarks/bench_delta.py --quick` runs end to end and writes a well-formed report (its
numbers are checked for sanity, not speed: the benchmark measures, tests check correctness)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO

SUMMARY_KEYS = {
    "entropy_bound_B",
    "conditional_bound_B",
    "compact_B",
    "raw_B",
    "best_peer_B",
    "best_peer_name",
    "trainer_step_x_clone",
    "trl_v1_step_x_ours",
    "apply_verify_x_clone",
    "break_even_vs_raw_mbps",
    "break_even_vs_best_peer_mbps",
}


@pytest.mark.timeout(600)
def test_bench_delta_quick_writes_results(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_delta.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bytes per changed element" in result.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    assert {"qwen3-bf16", "qwen3-fp32"} <= set(report["variants"])
    for name, variant in report["variants"].items():
        summary = variant["summary"]
        assert SUMMARY_KEYS <= set(summary), name
        assert variant["steps"] and all(0 < row["changed_fraction"] < 1 for row in variant["steps"])
        # Bytes per changed element: raw is int32 + bf16; every bound and coder sits well below it.
        assert summary["raw_B"] == pytest.approx(6.0)
        assert 0 < summary["conditional_bound_B"] <= summary["entropy_bound_B"] < summary["raw_B"]
        assert 0 < summary["compact_B"] < summary["best_peer_B"] <= 4.5
        assert summary["best_peer_name"] in {"trl_raw", "trl_gap", "pulse", "nemo_xor"}
        for key in ("trainer_step_x_clone", "trl_v1_step_x_ours", "apply_verify_x_clone", "decode_ns_per_changed"):
            assert summary[key] > 0, key
        # Compact is smaller than raw and every peer here: it wins on slow enough links
        # (None: at any speed, where it also costs no more CPU).
        for key in ("break_even_vs_raw_mbps", "break_even_vs_best_peer_mbps"):
            assert summary[key] is None or summary[key] > 0, key
    for row in report["verify_scaling"]:
        assert row["verify_seconds"] > 0 and row["decode_seconds"] > 0
    speed = report["codec_speed"]
    assert 0 < speed["changed"] < speed["numel"] and 0 < speed["bytes_per_changed"] < 1.5
    for what in ("encode", "decode", "clone"):
        assert speed[what]["wall_seconds"] > 0 and speed[what]["wall_ns_per_element"] > 0, what
    # The device path's memory per changed element: the host buffer (6 B with a mirror, 8
    # without) and one tensor's temporaries, within the bound the path states.
    path = report["device_path"]
    assert set(path["rows"]) == {"bf16", "bf16-mirror", "fp32", "fp32-mirror"}
    for name, row in path["rows"].items():
        assert row["host_B_per_changed"] == pytest.approx(6.0 if name.endswith("-mirror") else 8.0), name
        assert 0 < row["device_peak_bytes"] <= row["bound_device_bytes"], name
        assert row["peak_B_per_changed"] <= row["bound_B_per_changed"] and row["seconds"] > 0, name
    assert "device path" in result.stdout
    gil = report["gil_check"]
    assert 0 < gil["progress"] and gil["encode_seconds"] > 0 and gil["cpus"] >= 1
    if any(name.startswith("minilm") for name in report["variants"]) or report["skipped"]:
        assert len(report["variants"]) + len(report["skipped"]) == 4
