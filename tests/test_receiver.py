"""Receiver: applies anchors and deltas bit-exactly and refuses bad input without touching anything."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch

from delta_sync import read_file
from delta_sync.errors import (
    ApplyError,
    BaseVersionError,
    BucketPathError,
    FormatError,
    IntegrityError,
    OversizedFileError,
    ReplayError,
    UntrustedBucketError,
)
from delta_sync.format import Delta, SparseChange, write_delta
from delta_sync.layout import LATEST, anchor_path, delta_path
from delta_sync.replica.shared import NodeStore
from delta_sync.signing import SigningKey
from delta_sync.storage.cache import DownloadCache

from helpers import assert_bit_exact
from two_tower import PublishedRun, bf16_state, replica_receiver, resume_in_place


def test_catch_up_then_follow_file_by_file(run):
    receiver, replica = replica_receiver()
    result = receiver.update(run.root)
    assert result.version == 5
    assert [p.rsplit("/", 2)[-2:] for p in result.applied] == [
        ["anchors", "step_00000004.safetensors"],
        ["deltas", "step_00000005.safetensors"],
    ]
    assert_bit_exact(run.states[5], bf16_state(replica))
    for _ in range(3):
        version = run.step()
        result = receiver.update(run.root, delta_path(version))
        assert result.version == version and result.changed_elements > 0
        assert_bit_exact(run.states[version], bf16_state(replica))
        assert_bit_exact(run.states[version], receiver.weights)
    assert receiver.model_checksum == json.loads((run.root / "latest.json").read_text())["model_checksum"]


def test_resending_a_held_version_is_a_noop(run):
    receiver, replica = replica_receiver()
    receiver.update(run.root)
    calls = []
    receiver.load_weights = calls.append
    assert receiver.update(run.root, delta_path(5)).noop
    assert receiver.update(run.root, anchor_path(4)).noop
    assert receiver.update(run.root).noop
    assert calls == []


def test_catch_up_chains_deltas_from_the_held_version(run):
    receiver, replica = replica_receiver()
    receiver.update(run.root, anchor_path(1))
    receiver.update(run.root, delta_path(2))
    result = receiver.update(run.root)
    assert [p.rsplit("/", 1)[-1] for p in result.applied] == [
        "step_00000003.safetensors",
        "step_00000004.safetensors",
        "step_00000005.safetensors",
    ]
    assert_bit_exact(run.states[5], bf16_state(replica))


def test_missing_delta_falls_back_to_the_newest_anchor(run):
    receiver, replica = replica_receiver()
    receiver.update(run.root, anchor_path(1))
    (run.root / delta_path(2)).unlink()
    result = receiver.update(run.root)
    assert result.applied[0].endswith(anchor_path(4))
    assert_bit_exact(run.states[5], bf16_state(replica))


# -- refusals ----------------------------------------------------------------------------


def replica_at_v3(run, **kwargs):
    receiver, replica = replica_receiver(**kwargs)
    receiver.update(run.root, anchor_path(1))
    receiver.update(run.root, delta_path(2))
    receiver.update(run.root, delta_path(3))
    assert_bit_exact(run.states[3], bf16_state(replica))
    return receiver, replica


@pytest.fixture
def at_v3(run):
    return replica_at_v3(run)


def craft(run, tmp_path, edit, version: int = 4) -> str:
    """Write a modified copy of delta `version` into the bucket; returns its path in the bucket."""
    delta = read_file(run.root / delta_path(version))
    changes, header = edit(dict(delta.changes), delta.header)
    name = f"crafted/step_{version:08d}.safetensors"
    (run.root / "crafted").mkdir(exist_ok=True)
    write_delta(run.root / name, changes, header)
    return name


def rename(changes, header, old, new):
    changes[new] = changes.pop(old)
    move = lambda d: {new if k == old else k: v for k, v in d.items()}  # noqa: E731
    return changes, dataclasses.replace(
        header, shapes=move(header.shapes), checksums=move(header.checksums), base_checksums=move(header.base_checksums)
    )


def flip_first_value(changes, header):
    name = sorted(changes)[0]
    change = changes[name]
    values = change.values.clone()
    values.view(torch.int16)[0] ^= 1
    changes[name] = SparseChange(change.indices, values)
    return changes, header


EDITS = {
    "unknown parameter": (
        lambda c, h: rename(c, h, "body.0.weight", "body.9.weight"),
        ApplyError,
        "unknown parameter 'body.9.weight'",
    ),
    "wrong shape": (
        lambda c, h: (c, dataclasses.replace(h, shapes={**h.shapes, "body.0.weight": (32, 64)})),
        ApplyError,
        r"'body.0.weight' has shape \[32, 64\], held shape is \[64, 32\]",
    ),
    "checksum mismatch": (flip_first_value, IntegrityError, "would not reproduce the trainer's weights"),
    "model checksum mismatch": (
        lambda c, h: (c, dataclasses.replace(h, model_checksum="0" * 16)),
        IntegrityError,
        "model checksum",
    ),
    "other run": (
        lambda c, h: (c, dataclasses.replace(h, id=dataclasses.replace(h.id, run_id="someone-else"))),
        ApplyError,
        "belongs to run someone-else",
    ),
    "wrong base version": (
        lambda c, h: (c, dataclasses.replace(h, base_version=2)),
        BaseVersionError,
        "applies on top of version 2, but version 3 is held",
    ),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_bad_delta_changes_nothing(run, tmp_path, at_v3, case):
    receiver, replica = at_v3
    edit, error, message = EDITS[case]
    path = craft(run, tmp_path, edit)
    held = {name: t.clone() for name, t in receiver.weights.items()}
    replica_state = bf16_state(replica)
    checksum = receiver.model_checksum
    with pytest.raises(error, match=message):
        receiver.update(run.root, path)
    assert receiver.version == 3 and receiver.model_checksum == checksum
    assert_bit_exact(held, receiver.weights)
    assert_bit_exact(replica_state, bf16_state(replica))
    # The replica recovers: catch-up reaches the newest version (from an anchor after an
    # integrity failure, since the held weights can no longer be trusted).
    assert receiver.update(run.root).version == 5
    assert_bit_exact(run.states[5], bf16_state(replica))


@pytest.mark.parametrize(
    "tensor_edit, message",
    [
        (lambda i, v: (i.flip(0), v), "ascending"),
        (lambda i, v: (i.clone().fill_(10**6)[:1], v[:1]), "outside"),
        (lambda i, v: (i, v.float()), "bfloat16"),
    ],
    ids=["unsorted", "out-of-range", "wrong-dtype"],
)
def test_malformed_delta_changes_nothing(run, at_v3, tensor_edit, message):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    receiver, replica = at_v3
    src = run.root / delta_path(4)
    tensors = load_file(str(src))
    with safe_open(str(src), "pt") as handle:
        metadata = handle.metadata()
    name = "body.0.weight"
    tensors[f"{name}.indices"], tensors[f"{name}.values"] = tensor_edit(
        tensors[f"{name}.indices"], tensors[f"{name}.values"]
    )
    save_file(tensors, str(run.root / "bad.safetensors"), metadata=metadata)
    held = {n: t.clone() for n, t in receiver.weights.items()}
    with pytest.raises(FormatError, match=message):
        receiver.update(run.root, "bad.safetensors")
    assert receiver.version == 3
    assert_bit_exact(held, receiver.weights)
    assert_bit_exact(held, bf16_state(replica))


@pytest.mark.parametrize("update_checksum", [True, False], ids=["other-weights", "silent-corruption"])
def test_drifted_weights_are_detected_and_recovered_from_an_anchor(run, at_v3, update_checksum):
    from delta_sync.integrity import tensor_checksum

    receiver, replica = at_v3
    name = "body.0.weight"
    position = int(read_file(run.root / delta_path(4)).changes[name].indices[0])
    receiver.weights[name].view(-1).view(torch.int16)[position] ^= 1  # the replica's copy went bad
    if update_checksum:
        receiver.checksums[name] = tensor_checksum(receiver.weights[name])
    message = "differ from those the delta was made against" if update_checksum else "would not reproduce"
    with pytest.raises(IntegrityError, match=message):
        receiver.update(run.root, delta_path(4))
    assert receiver.version == 3
    with pytest.raises(BaseVersionError, match="failed an integrity check"):
        receiver.update(run.root, delta_path(4))
    result = receiver.update(run.root)  # catch-up reloads the newest anchor
    assert result.applied[0].endswith(anchor_path(4))
    assert_bit_exact(run.states[5], bf16_state(replica))
    assert_bit_exact(run.states[5], receiver.weights)


def test_delta_before_any_anchor_is_refused(run):
    receiver, replica = replica_receiver()
    initial = bf16_state(replica)
    with pytest.raises(BaseVersionError, match="load an anchor"):
        receiver.update(run.root, delta_path(2))
    assert_bit_exact(initial, bf16_state(replica))


def test_anchor_for_another_model_is_refused(run, tmp_path):
    from delta_sync import Receiver

    receiver = Receiver(expected_shapes={"only.weight": (4, 4)})
    with pytest.raises(ApplyError, match="unknown parameter"):
        receiver.update(run.root, anchor_path(1))
    assert receiver.version is None and receiver.weights == {}


def test_corrupted_anchor_is_refused(run, tmp_path):
    receiver, replica = replica_receiver()
    initial = bf16_state(replica)
    data = bytearray((run.root / anchor_path(4)).read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes
    (run.root / "bad-anchor.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not match its recorded checksum"):
        receiver.update(run.root, "bad-anchor.safetensors")
    assert receiver.version is None
    assert_bit_exact(initial, bf16_state(replica))


@pytest.mark.parametrize(
    "filename", ["../bucket/deltas/step_00000004.safetensors", "/etc/passwd", "deltas/../../x", ""]
)
def test_paths_escaping_the_bucket_are_refused(run, at_v3, filename):
    receiver, _ = at_v3
    with pytest.raises(BucketPathError, match=re.escape(repr(filename))):
        receiver.update(run.root, filename)
    assert receiver.version == 3


def test_untrusted_bucket_is_refused(run, tmp_path):
    receiver, replica = replica_receiver(allowed_buckets=[str(tmp_path / "elsewhere")])
    with pytest.raises(UntrustedBucketError, match="allow list"):
        receiver.update(run.root)
    trusted, _ = replica_receiver(allowed_buckets=[run.root.as_uri()])
    assert trusted.update(run.root).version == 5


def damage(path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes
    path.write_bytes(bytes(data))


def pointer_with(root, **fields) -> None:
    """Rewrite the bucket's latest.json with `fields` changed (unsigned: a writer without the key)."""
    latest = json.loads((root / LATEST).read_bytes())
    (root / LATEST).write_text(json.dumps({**latest, **fields}))


def malformed_delta(run, tmp_path):
    damage(run.root / delta_path(4))
    receiver, replica = replica_at_v3(run)
    return receiver, replica, lambda: receiver.update(run.root, delta_path(4))


def malformed_delta_on_a_catch_up(run, tmp_path):
    damage(run.root / delta_path(5))
    receiver, replica = replica_at_v3(run)
    return receiver, replica, lambda: receiver.update(run.root)


def crafted(case):
    def setup(run, tmp_path):
        receiver, replica = replica_at_v3(run)
        path = craft(run, tmp_path, EDITS[case][0])
        return receiver, replica, lambda: receiver.update(run.root, path)

    return setup


def wrong_base_version(run, tmp_path):
    receiver, replica = replica_at_v3(run)
    return receiver, replica, lambda: receiver.update(run.root, delta_path(5))


def path_escaping_the_prefix(run, tmp_path):
    receiver, replica = replica_at_v3(run)
    return receiver, replica, lambda: receiver.update(run.root, "../bucket/" + delta_path(4))


def untrusted_bucket(run, tmp_path):
    receiver, replica = replica_at_v3(run, allowed_buckets=[run.root.as_uri()])
    copy = shutil.copytree(run.root, tmp_path / "copy")
    return receiver, replica, lambda: receiver.update(copy)


def oversized_file(run, tmp_path):
    receiver, replica = replica_at_v3(run)
    with open(run.root / delta_path(4), "r+b") as handle:
        handle.truncate(1 << 40)  # sparse: far larger than a delta of every element
    return receiver, replica, lambda: receiver.update(run.root, delta_path(4))


def pointer_with_other_weights_at_the_held_version(run, tmp_path):
    receiver, replica = replica_at_v3(run)
    pointer_with(
        run.root, version=3, anchor_version=1, anchor=anchor_path(1), delta=delta_path(3), model_checksum="0" * 16
    )
    return receiver, replica, lambda: receiver.update(run.root)


def pointer_past_the_buckets_files(run, tmp_path):
    receiver, replica = replica_at_v3(run)
    pointer_with(run.root, version=9, delta=delta_path(9))
    return receiver, replica, lambda: receiver.update(run.root)


def replayed_pointer_with_a_key(run, tmp_path):
    key = SigningKey.generate()
    signed = PublishedRun(tmp_path / "signed", versions=3, signing_key=key)
    older = (signed.root / LATEST).read_bytes()
    signed.step()
    signed.close()
    receiver, replica = replica_receiver(verify_key=key.verify_key, cache=DownloadCache(tmp_path / "cache"))
    assert receiver.update(signed.root).version == 4
    (signed.root / LATEST).write_bytes(older)  # genuinely signed, and older
    return receiver, replica, lambda: receiver.update(signed.root)


REFUSALS = {
    "malformed delta": (malformed_delta, FormatError, re.escape(delta_path(4)) + ": payload digest"),
    "malformed delta on a catch-up": (
        malformed_delta_on_a_catch_up,
        FormatError,
        re.escape(delta_path(5)) + ": payload digest",
    ),
    "unknown parameter": (crafted("unknown parameter"), ApplyError, "unknown parameter 'body.9.weight'"),
    "wrong base version": (wrong_base_version, BaseVersionError, "applies on top of version 4, but version 3 is held"),
    "bad checksum": (crafted("checksum mismatch"), IntegrityError, "would not reproduce the trainer's weights"),
    "path escaping the prefix": (path_escaping_the_prefix, BucketPathError, r"must not contain '\.\.'"),
    "untrusted bucket": (untrusted_bucket, UntrustedBucketError, "is not on this receiver's allow list"),
    "oversized file": (oversized_file, OversizedFileError, re.escape(delta_path(4)) + ": 1,099,511,627,776 bytes"),
    "pointer naming other weights at the held version": (
        pointer_with_other_weights_at_the_held_version,
        FormatError,
        re.escape(delta_path(3)) + ": model_checksum [0-9a-f]{16}, but the bucket's latest.json names "
        "model_checksum 0{16} for version 3",
    ),
    "pointer past the bucket's files": (
        pointer_past_the_buckets_files,
        ApplyError,
        re.escape(LATEST) + ": names version 9, but the bucket holds no file of it",
    ),
    "replayed pointer with a key": (replayed_pointer_with_a_key, ReplayError, "an old latest.json was put back"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refusal_keeps_the_held_weights_and_the_reported_version(run, tmp_path, case):
    setup, error, message = REFUSALS[case]
    receiver, replica, request = setup(run, tmp_path)
    reported = receiver.version, receiver.model_checksum
    held = {name: t.clone() for name, t in receiver.weights.items()}
    served = bf16_state(replica)
    with pytest.raises(error, match=message):
        request()
    assert receiver.pending is None
    assert (receiver.version, receiver.model_checksum) == reported
    assert_bit_exact(held, receiver.weights)
    assert_bit_exact(served, bf16_state(replica))


def test_a_pointer_naming_other_weights_at_the_held_version_is_refused_and_forgotten(tmp_path):
    # Without a key anyone who can write the bucket can write latest.json. The replica's v8
    # was checked when it was applied; the bucket's own v8 file contradicts the pointer.
    run = PublishedRun(tmp_path / "bucket", versions=8, anchor_every=3, keep_anchors=10)  # anchors 1, 4, 7
    receiver, replica = replica_receiver()
    assert receiver.update(run.root).version == 8
    genuine = (run.root / LATEST).read_bytes()
    pointer_with(run.root, model_checksum="0" * 16)
    for request in (lambda: receiver.update(run.root), lambda: receiver.update(run.root, delta_path(8))):
        with pytest.raises(FormatError, match=re.escape(delta_path(8)) + ": model_checksum .* latest.json names "):
            request()
        assert receiver.version == 8
        assert_bit_exact(run.states[8], receiver.weights)
        assert_bit_exact(run.states[8], bf16_state(replica))
    # Nothing was distrusted: with the trainer's pointer back, the replica is in step.
    (run.root / LATEST).write_bytes(genuine)
    assert receiver.update(run.root).noop
    run.step()
    assert receiver.update(run.root, delta_path(9)).applied == (f"{run.root.as_uri()}/{delta_path(9)}",)
    assert_bit_exact(run.states[9], bf16_state(replica))
    run.close()


@pytest.mark.parametrize("shared", [False, True], ids=["private snapshot", "node snapshot"])
def test_a_catch_up_failing_after_its_anchor_drops_the_version_only_from_a_private_snapshot(run, tmp_path, shared):
    # The one documented exception: deltas 4 and 5 damaged, so the catch-up from v3 to v6
    # takes anchor 4 and fails on delta 5, after the anchor replaced the snapshot's v3.
    run.step()
    store = {"store": NodeStore(tmp_path / "snapshots")} if shared else {}
    receiver, replica = replica_at_v3(run, **store)
    damage(run.root / delta_path(4))
    damage(run.root / delta_path(5))
    with pytest.raises(FormatError, match=re.escape(delta_path(5)) + ": payload digest"):
        receiver.update(run.root)
    assert_bit_exact(run.states[3], bf16_state(replica))  # the model is never touched
    if shared:
        assert receiver.version == 3
    else:
        assert receiver.version is None and receiver.model_checksum is None
        with pytest.raises(BaseVersionError, match="load an anchor before a delta"):
            receiver.update(run.root, delta_path(6))


def test_failing_load_weights_rolls_back(run, at_v3):
    receiver, replica = at_v3
    held = {n: t.clone() for n, t in receiver.weights.items()}
    real_load = receiver.load_weights
    calls = []

    def flaky(weights):
        calls.append([name for name, _ in weights])
        if len(calls) == 1:
            real_load(weights[:2])  # half-loaded, then the engine fails
            raise RuntimeError("engine failed")
        real_load(weights)

    receiver.load_weights = flaky
    with pytest.raises(RuntimeError, match="engine failed"):
        receiver.update(run.root, delta_path(4))
    assert receiver.version == 3
    assert len(calls) == 2  # the rollback reloaded the previous values
    assert_bit_exact(held, receiver.weights)
    assert_bit_exact(held, bf16_state(replica))


def test_delta_file_object_can_be_applied_directly(run):
    receiver, _ = replica_receiver()
    receiver.update(run.root, anchor_path(4))
    delta = read_file(run.root / delta_path(5))
    assert isinstance(delta, Delta)
    assert receiver.apply(delta).version == 5


def test_a_replica_ahead_of_the_buckets_pointer_goes_back_to_it(tmp_path):
    # As after a crash-safe resume: latest.json steps back to v4 while a replica holds v5.
    run = PublishedRun(tmp_path / "bucket", versions=4, anchor_every=3, keep_anchors=10)
    pointer_at_4 = (run.root / "latest.json").read_bytes()
    run.step()
    receiver, replica = replica_receiver()
    assert receiver.update(run.root).version == 5
    (run.root / "latest.json").write_bytes(pointer_at_4)
    assert receiver.update(run.root).version == 4
    assert_bit_exact(run.states[4], bf16_state(replica))


def test_a_replica_on_an_abandoned_version_converges_when_the_resumed_run_reaches_its_number(tmp_path):
    # Resumed in place from a checkpoint of step 4 until the new start reaches v6 again: a
    # replica holding the abandoned v6 holds the pointer's version number with other weights.
    first = PublishedRun(tmp_path, versions=6, anchor_every=3, keep_anchors=10)
    first.close()
    receiver, replica = replica_receiver()
    assert receiver.update(tmp_path).version == 6
    abandoned = receiver.model_checksum
    model, publisher = resume_in_place(tmp_path, first.publisher.run_id, (5, 6))
    assert publisher.reports[-1].model_checksum != abandoned
    result = receiver.update(tmp_path)
    assert result.version == 6 and not result.noop
    assert receiver.model_checksum == publisher.reports[-1].model_checksum
    assert_bit_exact(bf16_state(model), bf16_state(replica))
    assert receiver.update(tmp_path).noop  # and then it is in step


@pytest.mark.parametrize("escape", ["%2E%2E", "%2e%2e", "%2E", ".%2E"])
def test_a_dot_segment_never_passes_the_allow_list(escape):
    receiver, _ = replica_receiver(allowed_buckets=["s3://ckpts/run1"])
    with pytest.raises(UntrustedBucketError, match=r"'\.' or '\.\.' segment"):
        receiver.check_bucket(f"s3://ckpts/run1/{escape}/run2")
    with pytest.raises(BucketPathError, match=r"must not contain '\.\.'"):
        receiver.check_bucket("s3://ckpts/run1/../run2")  # refused when the bucket is opened
    assert receiver.check_bucket("s3://ckpts/run1/sub").url == "s3://ckpts/run1/sub"
