"""The benchmark runs end to end on a small model (its numbers are not checked: tests check
correctness, the benchmark measures)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

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
    assert "worker thread per version, compact" in result.stdout
    for encoding in ("raw", "compact"):
        background = report["background"][encoding]
        assert background["alone_seconds"] > 0 and background["beside_python_seconds"] > 0
        assert background["python_thread_pace"] > 0


def run_gpu_check(tmp_path, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| blocked x clone |" in result.stdout
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_tensors(tmp_path):
    """The GPU check's own code, on CPU tensors: detection of both kinds of masters checked
    against the compiled pass, compact streams from the host mirror against a snapshot copy."""
    report = run_gpu_check(tmp_path, "--device", "cpu", "--sizes", "5e6", "--check-size", "5e6", "--steps", "2")
    assert [check["master"] for check in report["checks"]] == [False, True]
    assert all(check["streams"] > 0 and min(check["changed_fraction"]) > 0 for check in report["checks"])
    # Per kind of masters: raw and compact with the snapshot by the weights, raw with a host
    # snapshot (on a CPU run both are the host).
    assert [(row["master"], row["encoding"]) for row in report["costs"]] == [
        (master, encoding) for master in (False, True) for encoding in ("raw", "compact", "raw")
    ]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the check itself, at 1B and 8B)")
def test_the_gpu_check_passes_on_a_gpu(tmp_path):
    report = run_gpu_check(tmp_path)
    # With the snapshot on the GPU only the changes cross: within 1.2x of their positions and
    # new values, and no full-model copy.
    on_device = [row for row in report["costs"] if row["snapshot_device"] != "cpu"]
    assert on_device and all(row["device_to_host_x_changes"] <= 1.2 for row in on_device), on_device
