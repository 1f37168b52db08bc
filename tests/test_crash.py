"""The publisher killed (a real SIGKILL) at every upload, delete and pointer write, in a fresh
run and while resuming one: afterwards `latest.json` names only complete files, `verify`
passes, a fresh replica converges bit-exactly, a replica that held the abandoned trajectory
recovers, and the restarted publisher finishes the run.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from delta_sync import Receiver, verify_bucket
from delta_sync.integrity import model_checksum, tensor_checksum

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "crash" / "publish_and_resume.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("publish_and_resume", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(bucket: Path, phase: str, crash_at: int | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, str(SCRIPT), str(bucket), phase] + ([str(crash_at)] if crash_at else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def expected():
    """Every state either trajectory publishes, by checksum."""
    script = _load_script()
    known = {}
    for phase in ("A", "B"):
        for version, state in script.states(phase).items():
            known[model_checksum({n: tensor_checksum(t) for n, t in state.items()})] = (phase, version, state)
    return known


@pytest.fixture(scope="module")
def completed_a(tmp_path_factory):
    """A bucket where phase A ran to the end, and how many bucket operations each phase makes."""
    bucket = tmp_path_factory.mktemp("crash") / "phase-a"
    a = run(bucket, "A")
    assert a.returncode == 0, a.stderr[-3000:]
    probe = bucket.parent / "probe"
    shutil.copytree(bucket, probe)
    b = run(probe, "B")
    assert b.returncode == 0, b.stderr[-3000:]
    count = lambda result: int(result.stdout.split("OPERATIONS ")[1])  # noqa: E731
    return bucket, count(a), count(b)


def assert_consistent(bucket: Path, expected, replicas: list[Receiver]) -> None:
    report = verify_bucket(str(bucket))
    if not (bucket / "latest.json").exists():
        # Killed before the first version was published: nothing to follow yet, and a
        # verification of nothing does not pass.
        assert [(step.path, step.ok) for step in report.steps] == [("latest.json", False)], report.steps
        return
    assert report.ok, [step for step in report.steps if not step.ok]
    for receiver in [Receiver(), *replicas]:
        receiver.update(bucket)
        phase, version, state = expected[receiver.model_checksum]
        assert version == receiver.version == report.latest_version
        for name, tensor in state.items():
            assert torch.equal(tensor.view(torch.int16), receiver.weights[name].view(torch.int16)), name


def crash_then_check(bucket: Path, phase: str, crash_at: int, expected, replicas, restart: bool) -> None:
    killed = run(bucket, phase, crash_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert_consistent(bucket, expected, replicas)
    if restart:
        finished = run(bucket, phase)
        assert finished.returncode == 0, finished.stderr[-3000:]
        assert_consistent(bucket, expected, replicas)
        assert replicas[0].version == 6 if replicas else True


def test_killed_at_every_operation_of_a_fresh_run(tmp_path, completed_a, expected):
    _, operations, _ = completed_a

    def case(crash_at: int) -> None:
        # Restart after the earliest crashes (before the first latest.json) and every fourth one.
        crash_then_check(
            tmp_path / f"a{crash_at}", "A", crash_at, expected, [], restart=crash_at <= 4 or crash_at % 4 == 0
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(case, range(1, operations + 1)))


def test_killed_at_every_operation_of_a_resume(tmp_path, completed_a, expected):
    phase_a, _, operations = completed_a

    def case(crash_at: int) -> None:
        bucket = tmp_path / f"b{crash_at}"
        shutil.copytree(phase_a, bucket)
        abandoned = Receiver()
        abandoned.update(bucket)
        assert abandoned.version == 6  # phase A's v6, which the resume abandons
        crash_then_check(bucket, "B", crash_at, expected, [abandoned], restart=crash_at % 3 == 0)

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(case, range(1, operations + 1)))
