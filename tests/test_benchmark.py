"""The benchmark runs end to end on a small model (its numbers are not checked: tests check
correctness, the benchmark measures)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO


def test_benchmark_runs_and_writes_its_table(tmp_path):
    output = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_sync.py"),
            "--params",
            "3e6",
            "--hidden",
            "128",
            "--vocab",
            "1024",
            "--steps",
            "2",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trainer: delta-sync detect+extract+encode+write" in result.stdout
    report = json.loads(output.read_text())
    assert set(report["ratios"]) == {
        "delta_sync / clone",
        "trl_v1 / delta_sync",
        "verify_apply / anchor_load",
        "load / anchor_load",
        "signature / verify_apply",
        "anchor_signature / anchor_load",
        "late_joiner_node / anchor_load",
        "late_joiner_fresh / anchor_load",
    }
    # Two worker processes on one node map one snapshot and hold nothing of it privately.
    node = report["node_memory"]
    assert node["shared_file_bytes"] == report["full_bf16_bytes"]
    assert max(node["shared_private_bytes_per_worker"]) <= 0.01 * node["shared_file_bytes"]
    assert node["shared_proportional_bytes_total"] <= 1.01 * node["shared_file_bytes"]
    assert node["private_bytes_per_worker"] == [report["full_bf16_bytes"]] * 2
    assert report["snapshot_bytes_trainer"] == report["snapshot_bytes_replica"] == report["full_bf16_bytes"]
    assert 5.9 < report["bytes_per_changed_element"] < 7.0
