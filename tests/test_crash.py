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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from delta_sync import Receiver, expected_shapes_of, module_weight_loader, verify_bucket
from delta_sync.errors import DeltaSyncError
from delta_sync.integrity import model_checksum, tensor_checksum
from delta_sync.replica.shared import NodeStore

from helpers import raw_bits, run_script
from two_tower import PublishedRun, TwoTower

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "crash" / "publish_and_resume.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("publish_and_resume", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(bucket: Path, phase: str, crash_at: int | None = None) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, str(bucket), phase, *([str(crash_at)] if crash_at else []))


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


# -- the node snapshot's own writes ---------------------------------------------------------

SNAPSHOT_WRITER = Path(__file__).parent / "crash" / "node_snapshot_writer.py"


def test_a_replica_killed_at_every_write_of_the_node_snapshot_recovers(tmp_path):
    """A replica SIGKILLed at each write to the node snapshot (undo records, the state, the
    tensors, an anchor's start): a fresh replica on the same snapshot then gets, for every
    file the dead one applied, that version bit for bit, a no-op, or a `DeltaSyncError`
    saying why it cannot (never a bare `FileNotFoundError`); and its catch-up reaches the
    bucket's newest version bit for bit."""
    writer = _load(SNAPSHOT_WRITER, "node_snapshot_writer")
    run = PublishedRun(tmp_path / "bucket", versions=7, anchor_every=3, keep_anchors=10)
    run.close()

    def write(snapshot_dir: Path, crash_at: int | None = None) -> subprocess.CompletedProcess:
        return run_script(SNAPSHOT_WRITER, str(run.root), str(snapshot_dir), *([str(crash_at)] if crash_at else []))

    probe = write(tmp_path / "probe")
    assert probe.returncode == 0, probe.stderr[-3000:]
    writes = int(probe.stdout.split("WRITES ")[1])
    assert writes >= 3 * len(writer.FILES)

    def case(crash_at: int) -> None:
        snapshot_dir = tmp_path / f"snapshot-{crash_at}"
        killed = write(snapshot_dir, crash_at)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        replica = TwoTower()
        receiver = Receiver(
            load_weights=module_weight_loader(replica),
            expected_shapes=expected_shapes_of(replica),
            store=NodeStore(snapshot_dir),
        )
        for path in writer.FILES:
            try:
                receiver.update(run.root, path)
            except DeltaSyncError:
                continue  # refused, with a reason: what the dead replica left cannot give it
            # What the model now holds (the shared snapshot itself may be ahead of it).
            served = dict(replica.named_parameters())
            for name, tensor in run.states[receiver.version].items():
                assert torch.equal(raw_bits(tensor), raw_bits(served[name].detach())), (crash_at, path, name)
        receiver.update(run.root)
        assert receiver.version == 7, crash_at
        for name, tensor in run.states[7].items():
            assert torch.equal(raw_bits(tensor), raw_bits(receiver.weights[name])), (crash_at, name)
            assert torch.equal(raw_bits(tensor), raw_bits(dict(replica.named_parameters())[name].detach())), (
                crash_at,
                name,
            )

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(case, range(1, writes + 1)))


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
