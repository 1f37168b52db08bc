"""`benchmarks/bench_prepare.py` end to end on a small model: a well-formed report, every
delta prepared into the node snapshot while the stand-in generator ran. Timings are
reported, not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark needs two CPUs")
def test_a_quick_run_reports_each_delta_and_the_generators_rounds(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_prepare.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [u["version"] for u in results["updates"]] == [2, 3]
    for update in results["updates"]:
        assert update["prepared_version"] == update["version"]  # the snapshot holds it
        assert update["prepare_seconds"] > 0
        assert update["longest_x_quiet"] >= 0 and update["lost_seconds"] >= 0
    assert results["generator"]["quiet_median_seconds"] > 0
    assert set(results["summary"]) == {"longest_x_quiet", "lost_seconds_per_update", "prepare_seconds_per_update"}
    assert "| version |" in result.stdout
