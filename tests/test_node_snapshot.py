"""One snapshot per machine: `Receiver`s with a `NodeStore` over a `NodeSnapshot`, as the workers of one or
several vLLM servers on a node use them (tested with plain modules; tests/test_fleet.py
runs real servers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from delta_sync import Receiver, expected_shapes_of, module_weight_loader
from delta_sync.errors import SnapshotMovedError
from delta_sync.integrity import model_checksum, tensor_checksum
from delta_sync.layout import anchor_path, delta_path
from delta_sync.replica import snapshot as snapshot_module
from delta_sync.replica.shared import NodeStore
from delta_sync.replica.snapshot import NodeSnapshot

from helpers import assert_bit_exact
from two_tower import TwoTower, bf16_state


def worker(snapshot_dir: Path, *, history: int = 8, **kwargs) -> tuple[Receiver, TwoTower]:
    """One "vLLM worker": its own model, the node's snapshot."""
    replica = TwoTower()
    receiver = Receiver(
        store=NodeStore(snapshot_dir, history=history),
        load_weights=module_weight_loader(replica),
        expected_shapes=expected_shapes_of(replica),
        **kwargs,
    )
    return receiver, replica


def checksum_of(state: dict[str, torch.Tensor]) -> str:
    return model_checksum({name: tensor_checksum(t) for name, t in state.items()})


def node_state(snapshot_dir: Path) -> dict:
    (directory,) = [d for d in snapshot_dir.iterdir() if d.is_dir()]
    return json.loads((directory / "state.json").read_text())


def test_workers_share_one_snapshot_and_each_loads_bit_exact(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    first, first_model = worker(nodes)
    second, second_model = worker(nodes)
    for _ in range(3):
        version = stepwise.step()
        for receiver, model in ((first, first_model), (second, second_model)):
            receiver.update(stepwise.root, delta_path(version) if version > 2 else None)
            assert_bit_exact(stepwise.states[version], bf16_state(model))
            assert receiver.serving.version == version
            assert receiver.serving.model_checksum == checksum_of(stepwise.states[version])

    # One file for the machine, mapped by both; nothing private; nothing applied twice.
    assert [d.name for d in nodes.iterdir()] == [Path(first.memory().shared_path).parent.name]
    model_bytes = sum(t.numel() * 2 for t in stepwise.states[1].values())
    for receiver in (first, second):
        memory = receiver.memory()
        assert memory.private_bytes == 0
        assert memory.shared_path == first.memory().shared_path
        assert model_bytes <= memory.shared_bytes <= model_bytes + 64 * len(stepwise.states[1])
    assert os.path.getsize(first.memory().shared_path) == first.memory().shared_bytes


def test_a_worker_finding_the_snapshot_ahead_applies_nothing_and_loads_its_changes(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    first, _ = worker(nodes)
    second, second_model = worker(nodes)
    for receiver in (first, second):
        receiver.update(stepwise.root)
    version = stepwise.step()
    assert first.update(stepwise.root, delta_path(version)).applied

    loaded = []
    pending = second.prepare(stepwise.root, delta_path(version))
    assert pending.applied == ()  # the first worker applied it to the node already
    pending.commit(lambda weights: (loaded.extend(n for n, _ in weights), second.load_weights(weights)))
    changed = {
        n
        for n in stepwise.states[version]
        if not torch.equal(
            stepwise.states[version][n].view(torch.int16), stepwise.states[version - 1][n].view(torch.int16)
        )
    }
    assert set(loaded) == changed
    assert_bit_exact(stepwise.states[version], bf16_state(second_model))


def test_a_worker_asked_for_a_version_the_snapshot_passed_loads_exactly_that_version(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    ahead, _ = worker(nodes)
    behind, behind_model = worker(nodes)
    behind.update(stepwise.root)  # v1
    for _ in range(4):
        ahead.update(stepwise.root, delta_path(stepwise.step()))
    assert node_state(nodes)["version"] == 5

    for version in (2, 3):
        result = behind.update(stepwise.root, delta_path(version))
        assert result.version == behind.serving.version == version
        assert behind.serving.model_checksum == checksum_of(stepwise.states[version])
        assert_bit_exact(stepwise.states[version], bf16_state(behind_model))
    assert node_state(nodes)["version"] == 5  # rebuilt privately, the node untouched
    assert behind.memory().private_bytes == 0  # the rebuilt tensors went into the model, not kept

    behind.update(stepwise.root)  # a catch-up reaches the node's version
    assert_bit_exact(stepwise.states[5], bf16_state(behind_model))


def test_a_version_beyond_the_history_is_refused_and_nothing_changes(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    ahead, _ = worker(nodes, history=2)
    behind, behind_model = worker(nodes, history=2)
    behind.update(stepwise.root)
    for _ in range(4):
        ahead.update(stepwise.root, delta_path(stepwise.step()))

    with pytest.raises(SnapshotMovedError, match="can no longer rebuild version 2"):
        behind.update(stepwise.root, delta_path(2))
    assert behind.serving.version == 1 and behind.pending is None
    assert_bit_exact(stepwise.states[1], bf16_state(behind_model))
    behind.update(stepwise.root)
    assert_bit_exact(stepwise.states[5], bf16_state(behind_model))


def test_a_failed_load_puts_the_worker_back_and_keeps_the_node(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    receiver, model = worker(nodes)
    receiver.update(stepwise.root)
    version = stepwise.step()

    calls = []

    def flaky(weights):
        calls.append([n for n, _ in weights])
        receiver.load_weights(weights[:2] if len(calls) == 1 else weights)
        if len(calls) == 1:
            raise RuntimeError("engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        receiver.prepare(stepwise.root, delta_path(version)).commit(flaky)
    assert receiver.serving.version == version - 1
    assert_bit_exact(stepwise.states[version - 1], bf16_state(model))  # reloaded at its version
    assert node_state(nodes)["version"] == version  # the node keeps what it checked
    receiver.update(stepwise.root, delta_path(version))
    assert_bit_exact(stepwise.states[version], bf16_state(model))


def test_a_version_that_moves_out_of_reach_before_loading_leaves_the_model_untouched(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    ahead, _ = worker(nodes, history=2)
    behind, behind_model = worker(nodes, history=2)
    behind.update(stepwise.root)
    pending = behind.prepare(stepwise.root, delta_path(stepwise.step()))  # v2, prepared
    for _ in range(3):  # another server takes the node past the history before v2 is loaded
        ahead.update(stepwise.root, delta_path(stepwise.step()))

    calls = []
    with pytest.raises(SnapshotMovedError, match="can no longer rebuild version 2"):
        pending.commit(lambda weights: calls.append(weights))
    assert calls == []  # nothing was handed to the model, nothing reloaded
    assert behind.serving.version == behind.version == 1
    assert_bit_exact(stepwise.states[1], bf16_state(behind_model))
    behind.update(stepwise.root)
    assert_bit_exact(stepwise.states[5], bf16_state(behind_model))


def test_an_aborted_update_leaves_the_worker_serving_its_version(stepwise, tmp_path):
    receiver, model = worker(tmp_path / "snapshots")
    receiver.update(stepwise.root)
    version = stepwise.step()
    receiver.prepare(stepwise.root, delta_path(version)).abort()
    assert receiver.version == receiver.serving.version == version - 1
    assert receiver.checksums == {n: tensor_checksum(t) for n, t in stepwise.states[version - 1].items()}
    receiver.update(stepwise.root, delta_path(version))
    assert_bit_exact(stepwise.states[version], bf16_state(model))


def test_concurrent_workers_apply_each_version_to_the_node_once(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    workers = [worker(nodes) for _ in range(3)]
    for receiver, _ in workers:
        receiver.update(stepwise.root)
    for _ in range(3):
        version = stepwise.step()
        with ThreadPoolExecutor(len(workers)) as pool:
            results = list(pool.map(lambda w, v=version: w[0].update(stepwise.root, delta_path(v)), workers))
        assert sum(bool(result.applied) for result in results) == 1
        for _, model in workers:
            assert_bit_exact(stepwise.states[version], bf16_state(model))


CRASHING_WORKER = """
import os, signal, sys
sys.path[:0] = [{tests!r}]
import torch
import delta_sync.replica.shared as writer_module
from delta_sync.replica.snapshot import NodeSnapshot
from test_node_snapshot import worker

writes = []
real_mark, real_scatter, real_copy = NodeSnapshot._mark_writing, writer_module.scatter_many_, torch.Tensor.copy_

def mark_then_arm(self, version, kind):
    real_mark(self, version, kind)
    writes.append("armed")

def die_on_second_write():
    if writes:
        writes.append("write")
        if len(writes) == 3:  # killed for real with part of the version written
            os.kill(os.getpid(), signal.SIGKILL)

def scatter(changes):  # tensor by tensor, so that the kill lands between two of them
    for change in changes:
        real_scatter([change])
        die_on_second_write()

def copy(self, source, *args, **kwargs):
    result = real_copy(self, source, *args, **kwargs)
    die_on_second_write()
    return result

NodeSnapshot._mark_writing = mark_then_arm
writer_module.scatter_many_ = scatter
torch.Tensor.copy_ = copy
receiver, _ = worker({nodes!r})
receiver.update({bucket!r}, {path!r})
"""


def crash_a_worker(stepwise, nodes: Path, path: str) -> None:
    script = CRASHING_WORKER.format(
        tests=str(Path(__file__).parent), nodes=str(nodes), bucket=str(stepwise.root), path=path
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert node_state(nodes)["writing"] is not None  # it died mid-write


def test_a_worker_killed_mid_delta_leaves_a_snapshot_others_recover(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    survivor, model = worker(nodes)
    survivor.update(stepwise.root)
    version = stepwise.step()
    crash_a_worker(stepwise, nodes, delta_path(version))

    # A reader before any writer recovers sees no version it could load.
    with NodeSnapshot(Path(survivor.memory().shared_path).parent, survivor.expected_shapes).shared() as state:
        assert state.version is None
    # The next writer restores the overwritten values, then applies the delta itself.
    survivor.update(stepwise.root, delta_path(version))
    assert node_state(nodes)["writing"] is None
    assert_bit_exact(stepwise.states[version], bf16_state(model))
    fresh, fresh_model = worker(nodes)
    fresh.update(stepwise.root)
    assert_bit_exact(stepwise.states[version], bf16_state(fresh_model))


def test_a_worker_killed_mid_anchor_leaves_a_snapshot_that_waits_for_an_anchor(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    stepwise.step()
    crash_a_worker(stepwise, nodes, anchor_path(1))
    receiver, model = worker(nodes)
    receiver.update(stepwise.root)
    state = node_state(nodes)
    assert state["writing"] is None and state["version"] == 2
    assert_bit_exact(stepwise.states[2], bf16_state(model))


def test_a_snapshot_written_before_a_reboot_is_not_trusted(stepwise, tmp_path, monkeypatch):
    nodes = tmp_path / "snapshots"
    first, _ = worker(nodes)
    first.update(stepwise.root)
    monkeypatch.setattr(snapshot_module, "_boot_id", lambda: "another-boot")
    second, model = worker(nodes)
    result = second.update(stepwise.root)
    assert result.applied  # loaded from the bucket again, not from the old file
    assert_bit_exact(stepwise.states[1], bf16_state(model))


def test_a_damaged_state_file_is_not_trusted(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    first, _ = worker(nodes)
    first.update(stepwise.root)
    (directory,) = [d for d in nodes.iterdir() if d.is_dir()]
    (directory / "state.json").write_text('{"format": 1, "version": 1')  # cut short
    second, model = worker(nodes)
    assert second.update(stepwise.root).applied  # from the bucket again, not from the file
    assert_bit_exact(stepwise.states[1], bf16_state(model))


def test_a_snapshot_another_version_of_delta_sync_wrote_is_not_trusted(stepwise, tmp_path, caplog):
    # Its undo records may be laid out otherwise: format 1 kept one pair of tensors per parameter.
    nodes = tmp_path / "snapshots"
    first, _ = worker(nodes)
    first.update(stepwise.root)
    (directory,) = [d for d in nodes.iterdir() if d.is_dir()]
    state = json.loads((directory / "state.json").read_text())
    (directory / "state.json").write_text(json.dumps({**state, "format": 1}))
    second, model = worker(nodes)
    with caplog.at_level("WARNING", logger="delta_sync"):
        assert second.update(stepwise.root).applied  # from the bucket again, not from the file
    assert "state format 1, this version of delta-sync keeps 3" in caplog.text
    assert_bit_exact(stepwise.states[1], bf16_state(model))


def test_mapped_memory_counts_copied_pages_not_pages_only_one_process_touched(tmp_path):
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(4 * mmap.PAGESIZE))
    with path.open("r+b") as file:
        shared = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED)
        shared[0] = 1  # written through to the one page-cache copy
        touched = snapshot_module.mapped_memory(path)
        assert touched["rss"] >= mmap.PAGESIZE and touched["private"] == 0
        shared.close()
        copied = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE)
        copied[0] = 2  # copy-on-write: this process now holds its own page
        assert snapshot_module.mapped_memory(path)["private"] == mmap.PAGESIZE
        copied.close()


def test_a_read_file_is_applied_to_the_node_snapshot_of_its_bucket(stepwise, tmp_path):
    from delta_sync import read_file

    receiver, model = worker(tmp_path / "snapshots")
    with read_file(stepwise.root / anchor_path(1)) as anchor:
        with pytest.raises(ValueError, match="kept per bucket"):
            receiver.apply(anchor)  # which bucket's snapshot is not known
        assert receiver.version is None
        assert receiver.apply(anchor, bucket=stepwise.root).version == 1
    assert_bit_exact(stepwise.states[1], bf16_state(model))
    assert receiver.memory().shared_path is not None


def test_a_node_store_needs_the_models_shapes(tmp_path):
    with pytest.raises(ValueError, match="expected_shapes"):
        Receiver(store=NodeStore(tmp_path / "snapshots"))


def test_a_missing_undo_record_puts_the_version_out_of_reach(stepwise, tmp_path):
    nodes = tmp_path / "snapshots"
    ahead, _ = worker(nodes)
    behind, behind_model = worker(nodes)
    behind.update(stepwise.root)  # v1
    for _ in range(3):
        ahead.update(stepwise.root, delta_path(stepwise.step()))
    (undo,) = [path for path in nodes.glob("*/undo/00000004.safetensors")]
    undo.unlink()  # as a process that died between the state and the record would leave it
    with pytest.raises(SnapshotMovedError, match="can no longer rebuild version 2"):
        behind.update(stepwise.root, delta_path(2))
    assert behind.serving.version == 1 and behind.pending is None
    assert_bit_exact(stepwise.states[1], bf16_state(behind_model))
    behind.update(stepwise.root)  # a catch-up reaches the node's version, which needs no record
    assert_bit_exact(stepwise.states[4], bf16_state(behind_model))
