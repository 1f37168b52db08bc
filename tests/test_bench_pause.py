"""`benchmarks/bench_pause.py`: its analysis of a token timeline, and one real run end to end.

The analysis is checked on synthetic timelines whose answers are known; the end-to-end run
(a real CPU `vllm serve`, real AdamW steps, the real client) is checked for a well-formed
report and for what must hold on any machine: tokens arrived while versions were prepared,
and every version was prepared ahead of its update. Timings are reported, not asserted.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from helpers import REPO

BENCH = REPO / "benchmarks" / "bench_pause.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_pause", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


#: A token every 0.1 s from 0 to 2 s, then nothing until 3.0 s (a 1 s pause), then every 0.1 s again.
TIMELINE = [round(0.1 * i, 1) for i in range(21)] + [round(3.0 + 0.1 * i, 1) for i in range(11)]


def test_tokens_between_counts_the_half_open_window(bench):
    assert bench.tokens_between(TIMELINE, 0.0, 1.0) == 10  # 0.0 .. 0.9
    assert bench.tokens_between(TIMELINE, 2.05, 2.95) == 0
    assert bench.tokens_between(TIMELINE, 2.05, 3.05) == 1


def test_a_pause_counts_whole_in_every_window_it_overlaps(bench):
    # A window inside the pause, one that opens just before it, one that closes just after it.
    for start, end in [(2.2, 2.8), (1.95, 2.5), (2.5, 3.05)]:
        assert bench.longest_gap(TIMELINE, start, end) == pytest.approx(1.0), (start, end)
    # A window in steady streaming sees only the regular cadence.
    assert bench.longest_gap(TIMELINE, 0.35, 1.25) == pytest.approx(0.1)
    # Counting only gaps that open inside: the pause opened at 2.0, inside (1.95, 2.5) but
    # before (2.5, 3.5), which then sees the regular cadence after it.
    assert bench.longest_gap(TIMELINE, 1.95, 2.5, opened_inside=True) == pytest.approx(1.0)
    assert bench.longest_gap(TIMELINE, 2.5, 3.5, opened_inside=True) == pytest.approx(0.1)
    assert bench.longest_gap(TIMELINE, 2.2, 2.8, opened_inside=True) is None
    # Before the first token or after the last there is no closed gap.
    assert bench.longest_gap([1.0, 2.0], 2.5, 3.0) is None
    assert bench.longest_gap([1.0, 2.0], 0.0, 0.5) is None


def test_the_median_gap_counts_tokens_read_together_as_one_arrival(bench):
    bursts = [0.0, 0.0, 0.0, 0.2, 0.2, 0.4, 0.4, 0.4, 0.6]
    assert bench.median_gap(bursts, 0.0, 1.0) == pytest.approx(0.2)
    assert bench.median_gap(TIMELINE, 0.0, 2.0) == pytest.approx(0.1)
    assert bench.median_gap([1.0], 0.0, 2.0) is None


def test_phases_come_from_the_routes_the_client_posted(bench):
    calls = [
        ("/collective_rpc", 1.0, 1.1),  # the hint
        ("/collective_rpc", 1.2, 1.3),  # a status poll: still in the prepare phase
        ("/start_weight_update", 2.0, 2.1),
        ("/update_weights", 2.1, 2.4),
        ("/pause", 2.4, 2.5),
        ("/finish_weight_update", 2.5, 3.0),
        ("/reset_prefix_cache", 3.0, 3.1),
        ("/resume", 3.1, 3.2),
        ("/collective_rpc", 3.2, 3.3),  # the status afterwards: outside every phase
    ]
    windows = bench.phase_windows(calls, 0.5, 0.9)
    assert windows == {
        "prepare": (0.5, 2.0),
        "prepare_trainer_idle": (0.5, 2.0),
        "hint_wait": (0.9, 2.0),
        "start": (2.0, 2.1),
        "update": (2.1, 2.4),
        "finish": (2.4, 3.2),
    }
    # A catch-up: its last version published at 0.7, once the trainer stopped training.
    assert bench.phase_windows(calls, 0.5, 0.9, 0.7)["prepare_trainer_idle"] == (0.7, 2.0)
    with pytest.raises(ValueError, match="without start, update and finish"):
        bench.phase_windows(calls[:3], 0.5, 0.9)


def test_tokens_and_gaps_are_attributed_to_each_phase(bench):
    windows = {"prepare": (0.0, 1.95), "start": (1.95, 2.0), "update": (2.0, 2.05), "finish": (2.05, 3.0)}
    report = bench.attribute(TIMELINE, windows)
    assert report["prepare"]["tokens"] == 20 and report["prepare"]["longest_gap_seconds"] == pytest.approx(0.1)
    assert report["start"]["tokens"] == 0 and report["update"]["tokens"] == 1  # the token at 2.0
    # The pause starts inside `update` and ends at 3.0: it is the finish's too, and the window's.
    assert report["update"]["longest_gap_seconds"] == pytest.approx(1.0)
    assert report["finish"]["longest_gap_seconds"] == pytest.approx(1.0)
    assert report["update_window"] == {
        "seconds": pytest.approx(1.05),
        "tokens": 1,
        "longest_gap_seconds": pytest.approx(1.0),
    }


def test_tokens_per_bin_covers_the_run(bench):
    bins = bench.tokens_per_bin(TIMELINE, 0.0, 4.0, width=1.0)
    assert bins == [10, 10, 1, 10, 1]
    assert sum(bins) == len(TIMELINE)


def _result(*, prepare_tokens: int, prepare_gap: float, start: float, update: float, load: float) -> dict:
    """A result as `targets` reads it: one delta whose load took `load` of a full reload."""
    phases = {
        "prepare": {"seconds": 1.0, "tokens": prepare_tokens, "longest_gap_seconds": prepare_gap},
        "prepare_trainer_idle": {"seconds": 0.5, "tokens": prepare_tokens, "longest_gap_seconds": prepare_gap},
        "start": {"seconds": start, "tokens": 0, "longest_gap_seconds": None},
        "update": {"seconds": update, "tokens": 0, "longest_gap_seconds": None},
    }
    return {
        "device": "cpu",
        "quiet": {"median_gap_seconds": 0.1},
        "updates": [{"kind": "delta", "phases": phases, "load_x_full": load}],
    }


def test_targets_pass_and_fail_on_their_limits(bench):
    met = bench.targets(_result(prepare_tokens=5, prepare_gap=0.3, start=0.1, update=0.15, load=0.6))
    assert all(target["passed"] for target in met.values()), met
    assert met["delta_load_x_full"]["ratio"] == pytest.approx(0.6)
    missed = bench.targets(_result(prepare_tokens=0, prepare_gap=0.31, start=0.1, update=0.16, load=0.61))
    assert not any(target["passed"] for target in missed.values()), missed
    assert missed["prepare_streams"]["longest_prepare_gap_x_median"] == pytest.approx(3.1)
    assert missed["update_is_an_empty_rpc"]["worst_update_minus_start_seconds"] == pytest.approx(0.06)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2700)  # the vLLM environment may be built first (minutes, once per clone)
def test_bench_pause_quick_runs_a_real_server_end_to_end(tmp_path):
    from vllm_server import vllm_python

    # The vLLM environment the test suite builds (on first use, as on a fresh clone).
    python = vllm_python()
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(tmp_path), "--vllm-python", str(python)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| update |" in result.stdout and "target delta_load_x_full" in result.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    assert [u["kind"] for u in report["updates"]] == ["delta", "catch_up", "anchor"]
    for update in report["updates"]:
        # The server's prefetch thread prepared each version before the client committed it.
        assert update["prepared_ahead"] and not update["prepared_inline"], update["kind"]
        assert update["load_seconds"] > 0 and update["loaded"]["in_place"] > 0, update["kind"]
        assert update["full_reload"]["seconds"] > 0 and update["load_x_full"] > 0, update["kind"]
    # And the stream went on meanwhile. Not per update: this machine is shared, and a stall
    # of the server's process can outlast a catch-up's window (a fraction of a second).
    assert sum(update["phases"]["prepare"]["tokens"] for update in report["updates"]) > 0
    assert set(report["targets"]) == {"prepare_streams", "update_is_an_empty_rpc", "delta_load_x_full"}
    assert all(isinstance(target["passed"], bool) for target in report["targets"].values())
    assert (tmp_path / "bench_pause.png").stat().st_size > 0
