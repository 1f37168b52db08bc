"""The delta-sync command line, run as a real subprocess."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from delta_sync.errors import FormatError
from delta_sync.layout import anchor_path, delta_path

from helpers import assert_bit_exact, cli
from overflowing_streams import PAST_SLOTS, change_most_of, overflowing_copies
from two_tower import PublishedRun, bf16_state, replica_receiver


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "bucket"
    run = PublishedRun(root, versions=8, anchor_every=3, keep_anchors=2)
    run.close()
    return root


def test_inspect_delta_table_and_json(bucket):
    path = bucket / "deltas" / "step_00000008.safetensors"
    table = cli("inspect", str(path))
    assert table.returncode == 0, table.stderr
    assert "delta v8 on top of v7, anchor v7, encoding raw" in table.stdout
    assert "body.0.weight" in table.stdout and "total" in table.stdout
    summary = json.loads(cli("inspect", str(path), "--json").stdout)
    assert summary["kind"] == "delta" and summary["version"] == 8 and summary["base_version"] == 7
    assert summary["changed_elements"] == sum(t["changed"] for t in summary["tensors"].values())
    assert 0 < summary["sparsity"] < 1


def test_inspect_anchor(bucket):
    summary = json.loads(cli("inspect", str(bucket / "anchors" / "step_00000007.safetensors"), "--json").stdout)
    assert summary["kind"] == "anchor" and summary["sparsity"] == 0.0


def test_inspect_bad_file_names_it(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"nonsense")
    result = cli("inspect", str(bad))
    assert result.returncode == 2 and str(bad) in result.stderr


def test_verify_passes_on_a_good_bucket(bucket):
    result = cli("verify", str(bucket))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "anchors/step_00000007.safetensors: equals the replayed state bit for bit" in result.stdout
    assert "verification passed (latest v8, replayed v8)" in result.stdout
    report = json.loads(cli("verify", bucket.as_uri(), "--json").stdout)
    assert report["ok"] and report["replayed_version"] == 8


def test_verify_fails_on_a_damaged_delta(bucket, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(bucket, damaged)
    path = damaged / "deltas" / "step_00000006.safetensors"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    result = cli("verify", str(damaged))
    assert result.returncode == 1
    assert "FAIL  deltas/step_00000006.safetensors" in result.stdout
    assert "verification FAILED" in result.stdout


def test_verify_fails_when_a_delta_is_missing(bucket, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(bucket, broken)
    (broken / "deltas" / "step_00000005.safetensors").unlink()
    result = cli("verify", str(broken))
    assert result.returncode == 1
    assert "applies on top of version 5, but version 4 is held" in result.stdout


@pytest.mark.parametrize("made", ["missing", "empty", "not a bucket"])
def test_verify_fails_on_a_path_that_holds_no_bucket(tmp_path, made):
    path = tmp_path / "nope"
    if made != "missing":
        path.mkdir()
    if made == "not a bucket":
        (path / "notes.txt").write_text("hello")
    result = cli("verify", str(path))
    assert result.returncode == 1, result.stdout
    assert "holds no bucket" in result.stdout
    assert "verification FAILED (no latest.json, nothing replayed)" in result.stdout
    assert "None" not in result.stdout


def test_verify_fails_on_stored_versions_that_were_never_published(bucket, tmp_path):
    import shutil

    unpublished = tmp_path / "unpublished"
    shutil.copytree(bucket, unpublished)
    (unpublished / "latest.json").unlink()
    result = cli("verify", str(unpublished))
    assert result.returncode == 1
    assert re.search(
        r"FAIL  latest.json: absent: no version is published yet \(\d+ version file\(s\) stored", result.stdout
    )


def test_verify_says_once_that_latest_json_cannot_be_read(bucket, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(bucket, damaged)
    pointer = damaged / "latest.json"
    pointer.write_bytes(pointer.read_bytes() + b" " * (2 << 20))  # past the pointer's size limit
    result = cli("verify", str(damaged))
    assert result.returncode == 1, result.stdout
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert failed == [
        f"FAIL  latest.json: {damaged.as_uri()}/latest.json: {pointer.stat().st_size} bytes is too large for a "
        "latest.json pointer",
        "FAIL  anchors/, deltas/: not replayed: a replica reads latest.json before it applies any file",
    ], result.stdout


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A compact bucket (anchor v1, delta v2) and copies of its delta whose streams once
    overflowed the decoder's buffer; see `overflowing_streams`."""
    root = tmp_path_factory.mktemp("overflow") / "bucket"
    run = PublishedRun(root, versions=1, anchor_every=10, encoding="compact")
    change_most_of(run.model.body[0].weight)
    run.detector.mark_changed(["body.0.weight"])
    run.publisher.publish(2)
    run.close()
    copies = overflowing_copies((root / delta_path(2)).read_bytes(), run.states[1], count=3)
    assert len(copies) == 3
    return root, copies


def damaged_buckets(overflowing, tmp_path):
    """(tensor name, a copy of the bucket whose delta v2 is one of the overflowing copies)."""
    root, copies = overflowing
    for i, (name, data) in enumerate(copies):
        damaged = tmp_path / f"damaged-{i}"
        shutil.copytree(root, damaged)
        (damaged / delta_path(2)).write_bytes(data)
        yield name, damaged


def test_verify_refuses_streams_that_once_overflowed_the_decoder(overflowing, tmp_path):
    for name, damaged in damaged_buckets(overflowing, tmp_path):
        result = cli("verify", str(damaged))
        assert result.returncode == 1, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
        # The delta, and the pointer naming a version the replay could not reach.
        assert len(failed) == 2, result.stdout
        assert failed[0].startswith(f"FAIL  {delta_path(2)}: ") and name in failed[0] and PAST_SLOTS in failed[0]
        assert failed[1].startswith("FAIL  latest.json: names version 2")
        assert "verification FAILED (latest v2, replayed v1)" in result.stdout
        assert "refused" not in result.stderr, result.stderr  # one report per fault


def test_a_receiver_refuses_streams_that_once_overflowed_and_keeps_its_version(overflowing, tmp_path):
    for name, damaged in damaged_buckets(overflowing, tmp_path):
        receiver, replica = replica_receiver()
        receiver.update(damaged, anchor_path(1))
        held = bf16_state(replica)
        with pytest.raises(FormatError, match=re.escape(name)) as refused:
            receiver.update(damaged, delta_path(2))
        assert delta_path(2) in str(refused.value) and PAST_SLOTS in str(refused.value)
        assert receiver.version == 1
        assert_bit_exact(held, bf16_state(replica))
    receiver, replica = replica_receiver()
    assert receiver.update(overflowing[0]).version == 2  # the genuine file applies
