"""Receiver.prepare -> PendingUpdate.commit / abort: the lifecycle a vLLM session maps onto."""

from __future__ import annotations

import pytest

from delta_sync import open_bucket, read_file
from delta_sync.errors import ApplyError, BaseVersionError, FormatError
from delta_sync.layout import anchor_path, delta_path

from helpers import assert_bit_exact
from two_tower import bf16_state, replica_receiver


@pytest.fixture
def at_v3(run):
    receiver, replica = replica_receiver()
    for path in (anchor_path(1), delta_path(2), delta_path(3)):
        receiver.update(run.root, path)
    assert_bit_exact(run.states[3], bf16_state(replica))
    return receiver, replica


class Recorder:
    """A `load_weights` that records each call's names and forwards to the replica."""

    def __init__(self, receiver, fail_first: bool = False) -> None:
        self.load = receiver.load_weights
        self.fail_first = fail_first
        self.calls: list[list[str]] = []

    def __call__(self, weights) -> None:
        self.calls.append([name for name, _ in weights])
        if self.fail_first and len(self.calls) == 1:
            self.load(weights[:2])  # half loaded, then the engine fails
            raise RuntimeError("engine failed")
        self.load(weights)


def changed_names(run, *versions: int) -> set[str]:
    return {name for v in versions for name in read_file(run.root / delta_path(v)).changes}


def snapshot(receiver) -> tuple:
    weights = {name: t.clone() for name, t in receiver.weights.items()}
    return weights, dict(receiver.checksums), receiver.version, receiver.anchor_version, receiver.model_checksum


def assert_same_snapshot(before: tuple, receiver) -> None:
    weights, checksums, version, anchor_version, checksum = before
    assert_bit_exact(weights, receiver.weights)
    assert receiver.checksums == checksums
    assert (receiver.version, receiver.anchor_version, receiver.model_checksum) == (version, anchor_version, checksum)


def test_prepare_applies_to_the_snapshot_and_commit_loads(run, at_v3):
    receiver, replica = at_v3
    recorder = Recorder(receiver)
    pending = receiver.prepare(run.root, delta_path(4))
    assert receiver.pending is pending and pending.is_open
    assert pending.version == receiver.version == 4
    assert pending.names == changed_names(run, 4)
    assert_bit_exact(run.states[4], receiver.weights)
    assert_bit_exact(run.states[3], bf16_state(replica))  # the model is untouched until commit
    result = pending.commit(recorder)
    assert recorder.calls == [sorted(changed_names(run, 4))]
    assert result.version == 4 and result.loaded_tensors == len(pending.names)
    assert result.applied == (f"{open_bucket(run.root).url}/{delta_path(4)}",)
    assert receiver.pending is None and not pending.is_open
    assert_bit_exact(run.states[4], bf16_state(replica))


def test_several_prepares_extend_one_update_and_commit_loads_the_union_once(run, at_v3):
    receiver, replica = at_v3
    first = receiver.prepare(run.root, delta_path(4))
    assert receiver.prepare(run.root, delta_path(5)) is first
    assert receiver.prepare(run.root, delta_path(5)) is first  # a re-sent version is a no-op
    assert first.version == 5 and first.names == changed_names(run, 4, 5)
    recorder = Recorder(receiver)
    result = first.commit(recorder)
    assert recorder.calls == [sorted(changed_names(run, 4, 5))]
    assert [path.rsplit("/", 1)[-1] for path in result.applied] == [
        "step_00000004.safetensors",
        "step_00000005.safetensors",
    ]
    assert_bit_exact(run.states[5], bf16_state(replica))
    assert_bit_exact(run.states[5], receiver.weights)


def test_abort_restores_bit_patterns_and_version(run, at_v3):
    receiver, replica = at_v3
    before = snapshot(receiver)
    recorder = Recorder(receiver)
    receiver.load_weights = recorder
    pending = receiver.prepare(run.root, delta_path(4))
    receiver.prepare(run.root, delta_path(5))
    assert receiver.version == 5
    pending.abort()
    assert receiver.pending is None and recorder.calls == []
    assert_same_snapshot(before, receiver)
    assert_bit_exact(run.states[3], bf16_state(replica))
    # Nothing is distrusted: the deltas apply again, without an anchor.
    result = receiver.update(run.root)
    assert [path.rsplit("/", 2)[-2] for path in result.applied] == ["deltas", "deltas"]
    assert_bit_exact(run.states[5], bf16_state(replica))


def test_failed_commit_rolls_back_a_chain_bit_exactly(run, at_v3):
    receiver, replica = at_v3
    before = snapshot(receiver)
    pending = receiver.prepare(run.root, delta_path(4))
    receiver.prepare(run.root, delta_path(5))
    recorder = Recorder(receiver, fail_first=True)
    with pytest.raises(RuntimeError, match="engine failed"):
        pending.commit(recorder)
    assert len(recorder.calls) == 2  # the rollback reloaded the previous values
    assert recorder.calls[0] == recorder.calls[1] == sorted(changed_names(run, 4, 5))
    assert_same_snapshot(before, receiver)
    assert_bit_exact(run.states[3], bf16_state(replica))
    assert receiver.pending is None
    assert receiver.update(run.root, delta_path(4)).version == 4  # no anchor needed
    assert_bit_exact(run.states[4], bf16_state(replica))


def test_a_pending_update_ends_exactly_once(run, at_v3):
    receiver, _ = at_v3
    committed = receiver.prepare(run.root, delta_path(4))
    committed.commit()
    with pytest.raises(RuntimeError, match="already committed"):
        committed.commit()
    with pytest.raises(RuntimeError, match="already committed"):
        committed.abort()
    aborted = receiver.prepare(run.root, delta_path(5))
    assert aborted is not committed
    aborted.abort()
    with pytest.raises(RuntimeError, match="already aborted"):
        aborted.commit()
    with pytest.raises(RuntimeError, match="already aborted"):
        aborted.abort()
    assert receiver.version == 4


def test_update_and_apply_refuse_while_an_update_is_prepared(run, at_v3):
    receiver, _ = at_v3
    pending = receiver.prepare(run.root, delta_path(4))
    with pytest.raises(RuntimeError, match="still open"):
        receiver.update(run.root, delta_path(5))
    with pytest.raises(RuntimeError, match="still open"):
        receiver.apply(read_file(run.root / delta_path(5)))
    assert receiver.pending is pending and receiver.version == 4
    pending.abort()
    assert receiver.version == 3


def test_a_failing_file_keeps_what_was_prepared_before_it(run, at_v3):
    receiver, _ = at_v3
    run.step()
    pending = receiver.prepare(run.root, delta_path(4))
    with pytest.raises(BaseVersionError, match="applies on top of version 5, but version 4 is held"):
        receiver.prepare(run.root, delta_path(6))
    assert receiver.pending is pending and pending.version == 4
    pending.abort()
    assert receiver.version == 3


def test_a_failing_first_prepare_leaves_nothing_open(run, at_v3):
    receiver, _ = at_v3
    before = snapshot(receiver)
    with pytest.raises(BaseVersionError, match="applies on top of version 4, but version 3 is held"):
        receiver.prepare(run.root, delta_path(5))
    assert receiver.pending is None
    assert_same_snapshot(before, receiver)


def test_catch_up_prepares_an_anchor_and_deltas_and_commit_loads_everything_once(run):
    receiver, replica = replica_receiver()
    initial = bf16_state(replica)
    recorder = Recorder(receiver)
    pending = receiver.prepare(run.root)
    assert [path.rsplit("/", 2)[-2:] for path in pending.applied] == [
        ["anchors", "step_00000004.safetensors"],
        ["deltas", "step_00000005.safetensors"],
    ]
    assert pending.names == set(receiver.weights)
    assert_bit_exact(initial, bf16_state(replica))
    pending.commit(recorder)
    assert recorder.calls == [sorted(receiver.weights)]
    assert_bit_exact(run.states[5], bf16_state(replica))


def test_aborting_an_anchor_leaves_no_trusted_version(run, at_v3):
    receiver, replica = at_v3
    pending = receiver.prepare(run.root, anchor_path(4))
    receiver.prepare(run.root, delta_path(5))
    pending.abort()
    # The snapshot cannot go back past an anchor without a second copy of the model.
    assert receiver.version is None and receiver.run_id is None and receiver.model_checksum is None
    assert_bit_exact(run.states[3], bf16_state(replica))
    with pytest.raises(BaseVersionError, match="aborted.*load an anchor"):
        receiver.update(run.root, delta_path(5))
    result = receiver.update(run.root)
    assert result.applied[0].endswith(anchor_path(4)) and result.version == 5
    assert_bit_exact(run.states[5], bf16_state(replica))
    assert_bit_exact(run.states[5], receiver.weights)


def test_a_failed_anchor_commit_demands_an_anchor(run, at_v3):
    receiver, replica = at_v3
    pending = receiver.prepare(run.root, anchor_path(4))
    recorder = Recorder(receiver, fail_first=True)
    with pytest.raises(RuntimeError, match="engine failed"):
        pending.commit(recorder)
    assert len(recorder.calls) == 1  # the model is in an unknown state: no partial reload
    with pytest.raises(BaseVersionError, match="loading an anchor into the model failed; load an anchor first"):
        receiver.update(run.root, delta_path(5))
    result = receiver.update(run.root)
    assert result.applied[0].endswith(anchor_path(4))
    assert_bit_exact(run.states[5], bf16_state(replica))


def test_a_failed_catch_up_leaves_the_replica_where_it_was(run):
    # Deltas 3 and 4 chain from v2, delta 5 is damaged: nothing is applied, not even 3 and 4.
    receiver, replica = replica_receiver()
    receiver.update(run.root, anchor_path(1))
    receiver.update(run.root, delta_path(2))
    damaged = bytearray((run.root / delta_path(5)).read_bytes())
    damaged[-3] ^= 0x40  # inside the last tensor's bytes
    (run.root / delta_path(5)).write_bytes(bytes(damaged))
    with pytest.raises(FormatError, match="payload digest"):
        receiver.update(run.root)
    assert receiver.pending is None and receiver.version == 2
    assert_bit_exact(run.states[2], bf16_state(replica))
    assert_bit_exact(run.states[2], receiver.weights)
    # A fresh replica whose catch-up fails after the anchor loads nothing into the model and
    # claims no version (an anchor cannot be undone in the snapshot without a second copy).
    fresh, fresh_replica = replica_receiver()
    before = bf16_state(fresh_replica)
    with pytest.raises(FormatError, match="payload digest"):
        fresh.update(run.root)
    assert fresh.version is None and fresh.model_checksum is None
    assert_bit_exact(before, bf16_state(fresh_replica))


def test_abort_of_a_noop_update_changes_nothing(run, at_v3):
    receiver, replica = at_v3
    before = snapshot(receiver)
    pending = receiver.prepare(run.root, delta_path(3))
    assert pending.applied == () and pending.names == frozenset()
    pending.abort()
    assert_same_snapshot(before, receiver)
    assert receiver.update(run.root, delta_path(4)).version == 4
    assert_bit_exact(run.states[4], bf16_state(replica))


def test_a_prepared_update_is_not_reported_as_served_until_committed(run, at_v3):
    receiver, _ = at_v3
    served = receiver.serving
    assert served.version == 3
    pending = receiver.prepare(run.root, delta_path(4))
    assert receiver.version == 4  # the snapshot is ahead...
    assert receiver.serving == served  # ...but the model still serves v3
    pending.commit()
    assert receiver.serving.version == 4 and receiver.serving.model_checksum == receiver.model_checksum


def test_each_prepare_says_what_it_applied(run, at_v3):
    receiver, _ = at_v3
    pending = receiver.prepare(run.root, delta_path(4))
    assert pending.last.version == 4 and [p.rsplit("/", 1)[-1] for p in pending.last.applied] == [
        "step_00000004.safetensors"
    ]
    receiver.prepare(run.root, delta_path(4))  # re-sent: applies nothing
    assert pending.last.applied == () and pending.last.version == 4
    assert len(pending.steps) == 2 and len(pending.applied) == 1
    receiver.commit(pending)


def test_a_file_of_another_kind_than_announced_is_refused_before_it_is_applied(run, at_v3):
    receiver, replica = at_v3
    before = bf16_state(replica)
    with pytest.raises(ApplyError, match=r"is a delta, but update_info 'update_kind' is 'dense' \(an anchor\)"):
        receiver.prepare(run.root, delta_path(4), kind="anchor")
    assert receiver.pending is None and receiver.version == 3
    assert_bit_exact(before, bf16_state(replica))
