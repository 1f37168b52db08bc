"""A local bucket someone hostile can write to: only regular files inside it are read, small
files are capped, and neither a replica, `verify` nor `inspect` hangs, runs out of memory or
ends in a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from delta_sync import Receiver, expected_shapes_of, module_weight_loader
from delta_sync.cli import main
from delta_sync.errors import BucketError, BucketFileNotFoundError, BucketPathError, DeltaSyncError
from delta_sync.layout import LATEST, anchor_path, delta_path
from delta_sync.replica import verify as verify_module
from delta_sync.replica.shared import NodeStore
from delta_sync.storage import LocalBucket
from delta_sync.storage.cache import DownloadCache

import helpers
from two_tower import PublishedRun, TwoTower

#: The most memory a CLI run on hostile input may take (a read without limit would not fit).
MEMORY_LIMIT = 4 << 30


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A good bucket (anchors 1 and 4, deltas 2-5); each test damages its own copy."""
    root = tmp_path_factory.mktemp("hardening") / "bucket"
    run = PublishedRun(root, versions=5, anchor_every=3, keep_anchors=2)
    run.close()
    return root


@pytest.fixture
def bucket(published, tmp_path):
    root = tmp_path / "bucket"
    shutil.copytree(published, root)
    return root


def held(receiver: Receiver) -> tuple:
    return receiver.version, receiver.run_id, receiver.model_checksum


def updated_receiver(root) -> Receiver:
    receiver = Receiver()
    receiver.update(root, anchor_path(1))
    receiver.update(root, delta_path(2))
    return receiver


# -- LocalBucket itself ---------------------------------------------------------------------


def test_a_symlink_out_of_the_bucket_is_refused_even_to_a_valid_file(bucket, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(bucket / delta_path(3), outside / "step_00000003.safetensors")
    (bucket / delta_path(3)).unlink()
    (bucket / delta_path(3)).symlink_to(outside / "step_00000003.safetensors")
    receiver = updated_receiver(bucket)
    before = held(receiver)
    with pytest.raises(BucketPathError, match=r"'deltas/step_00000003.safetensors' is a symbolic link"):
        receiver.update(bucket, delta_path(3))
    assert held(receiver) == before


def test_a_symlinked_directory_is_refused(bucket, tmp_path):
    shutil.move(bucket / "deltas", tmp_path / "deltas")
    (bucket / "deltas").symlink_to(tmp_path / "deltas", target_is_directory=True)
    receiver = updated_receiver_from_anchor(bucket)
    before = held(receiver)
    with pytest.raises(BucketPathError, match="passes through 'deltas', a symbolic link"):
        receiver.update(bucket, delta_path(2))
    assert held(receiver) == before


def updated_receiver_from_anchor(root) -> Receiver:
    receiver = Receiver()
    receiver.update(root, anchor_path(1))
    return receiver


def test_symlink_loops_long_names_and_directories_are_bucket_errors(bucket):
    local = LocalBucket(bucket)
    (bucket / "loop.json").symlink_to(bucket / "loop.json")
    cases = {
        "loop.json": "is a symbolic link",
        "x" * 300: "longer than 255 bytes",
        f"deltas/{'y' * 256}.safetensors": "longer than 255 bytes",
        "anchors": "is a directory",
        f"{delta_path(2)}/inside": "a file, not a directory",
    }
    for path, message in cases.items():
        for read in (local.read_bytes, local.local_path, lambda p: local.download(p, bucket.parent / "copy")):
            with pytest.raises(BucketPathError, match=message) as caught:
                read(path)
            assert repr(path) in str(caught.value)
    with pytest.raises(BucketFileNotFoundError, match=re.escape("no file 'deltas/step_00000099.safetensors'")):
        local.read_bytes("deltas/step_00000099.safetensors")


def test_a_replica_refuses_a_directory_or_link_loop_at_a_version_path(bucket):
    receiver = updated_receiver(bucket)
    before = held(receiver)
    (bucket / delta_path(3)).unlink()
    (bucket / delta_path(3)).mkdir()
    (bucket / delta_path(4)).unlink()
    (bucket / delta_path(4)).symlink_to(bucket / delta_path(4))
    for path, message in [(delta_path(3), "is a directory"), (delta_path(4), "is a symbolic link")]:
        with pytest.raises(BucketPathError, match=message):
            receiver.update(bucket, path)
        assert held(receiver) == before
    with pytest.raises(DeltaSyncError, match="has a name longer than 255 bytes"):
        receiver.update(bucket, f"deltas/step_{'0' * 300}.safetensors")
    assert held(receiver) == before


def test_a_fifo_or_device_is_refused_without_blocking(bucket):
    os.mkfifo(bucket / "fifo")
    local = LocalBucket(bucket)
    # Without O_NONBLOCK this open would wait for a writer forever.
    with pytest.raises(BucketPathError, match="'fifo' is a FIFO"):
        local.read_bytes("fifo")
    with pytest.raises(BucketPathError, match="is a FIFO"):
        local.local_path("fifo")


def test_read_bytes_is_capped(bucket):
    receiver = updated_receiver(bucket)
    before = held(receiver)
    local = LocalBucket(bucket)
    with open(bucket / LATEST, "r+b") as file:
        file.truncate(local.max_read_bytes + 1)  # sparse: no disk used
    with pytest.raises(BucketError, match=r"'latest.json' is larger than 16,777,216 bytes"):
        local.read_bytes(LATEST)
    with pytest.raises(BucketError, match="larger than"):
        receiver.update(bucket)  # catch-up reads latest.json
    assert held(receiver) == before
    local.max_read_bytes = 8
    (bucket / "small").write_bytes(b"12345678")
    assert local.read_bytes("small") == b"12345678"


# -- the command line on hostile buckets: real processes, bounded memory and time ---------


def cli(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return helpers.cli(*args, stdout=stdout, timeout=180, preexec_fn=limit_memory)


def test_verify_refuses_a_latest_json_linked_to_dev_zero(bucket):
    (bucket / LATEST).unlink()
    (bucket / LATEST).symlink_to("/dev/zero")
    result = cli("verify", str(bucket), "--json")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    steps = json.loads(result.stdout)["steps"]
    assert not steps[0]["ok"] and steps[0]["path"] == LATEST and "symbolic link" in steps[0]["message"]


def test_verify_reports_a_fifo_and_finishes(bucket):
    (bucket / delta_path(3)).unlink()
    os.mkfifo(bucket / delta_path(3))
    result = cli("verify", str(bucket), "--json")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    steps = {step["path"]: step for step in json.loads(result.stdout)["steps"]}
    assert not steps[delta_path(3)]["ok"] and "is a FIFO" in steps[delta_path(3)]["message"]
    # The replay went on: the next anchor restarted the chain and the delta after it applied.
    assert steps[anchor_path(4)]["ok"] and steps[delta_path(5)]["ok"] and steps[LATEST]["ok"]


def test_inspect_refuses_special_files_quietly(bucket, tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")
    (bucket / delta_path(3)).unlink()
    os.mkfifo(bucket / delta_path(3))
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    for target, message in [
        (tmp_path / "fifo.safetensors", "not a regular file"),
        (tmp_path / "zero.safetensors", "not a regular file"),
        (bucket / delta_path(3), "is a FIFO"),
        (bucket / "anchors" / ("z" * 300 + ".safetensors"), "longer than 255 bytes"),
        (tmp_path / ("z" * 300), "File name too long"),
    ]:
        result = cli("inspect", str(target))
        assert result.returncode == 2, (target, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_inspect_into_a_closed_pipe_ends_quietly(bucket):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has already exited: every write fails
    try:
        result = cli("inspect", str(bucket / delta_path(2)), stdout=write_end)
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert result.stderr == "", result.stderr


@pytest.mark.parametrize(
    "error",
    [
        RecursionError("maximum recursion depth exceeded"),
        OverflowError("cannot convert"),
        IsADirectoryError(21, "Is a directory", "anchors"),
    ],
)
def test_an_unforeseen_error_is_one_line_and_exit_code_2(bucket, monkeypatch, capsys, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("delta_sync.cli.verify_bucket", fail)
    assert main(["verify", str(bucket)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"delta-sync: error: {bucket}: {type(error).__name__}: ") and err.count("\n") == 1, err


def test_verify_reports_an_unforeseen_error_and_goes_on(bucket, monkeypatch):
    update = Receiver.update

    def update_or_fail(self, bucket_url, filename=None):
        if filename == delta_path(3):
            raise RecursionError("maximum recursion depth exceeded")
        return update(self, bucket_url, filename)

    monkeypatch.setattr(Receiver, "update", update_or_fail)
    report = verify_module.verify_bucket(bucket)
    steps = {step.path: step for step in report.steps}
    assert not report.ok
    assert steps[delta_path(3)].message == "unexpected RecursionError: nested too deeply"
    assert steps[anchor_path(4)].ok and steps[delta_path(5)].ok and steps[LATEST].ok


def test_errors_are_delta_sync_errors():
    assert issubclass(BucketPathError, DeltaSyncError)


# -- file modes: what the trainer writes, replicas (other users) can read ---------------------
# Every file the bucket, the download cache and the node snapshot create is 0666 less the
# process umask, every directory 0777 less it; private keys (`delta-sync keygen`) stay 0600.


def modes_below(root) -> dict[str, int]:
    """Permission bits of `root` and of everything below it, by path relative to `root`."""
    found = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for path in sorted(root.rglob("*")):
        found[str(path.relative_to(root))] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


@contextlib.contextmanager
def process_umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_bucket_cache_and_node_snapshot_files_follow_the_umask(tmp_path, umask):
    with process_umask(umask):
        run = PublishedRun(tmp_path / "bucket", versions=3, anchor_every=2)
        run.close()
        model = TwoTower()
        receiver = Receiver(
            store=NodeStore(tmp_path / "snapshots", history=4),
            cache=DownloadCache(tmp_path / "cache"),
            load_weights=module_weight_loader(model),
            expected_shapes=expected_shapes_of(model),
        )
        receiver.update(run.root, anchor_path(1))
        receiver.update(run.root, delta_path(2))  # an undo record in the node snapshot
        receiver.update(run.root)
    assert receiver.version == 3
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    for area in ("bucket", "cache", "snapshots"):
        modes = modes_below(tmp_path / area)
        expected = {name: dir_mode if (tmp_path / area / name).is_dir() else file_mode for name in modes}
        assert modes == expected, f"{area}: {[(n, oct(m)) for n, m in modes.items() if m != expected[n]]}"
    # What each area must hold for the check to mean anything.
    bucket_files = modes_below(tmp_path / "bucket")
    assert {LATEST, anchor_path(1), delta_path(2), delta_path(3)} <= set(bucket_files)
    assert any(name.endswith(".safetensors") for name in modes_below(tmp_path / "cache"))
    snapshot_files = {Path(name).name for name in modes_below(tmp_path / "snapshots")}
    assert {"weights.bin", "state.json", "lock"} <= snapshot_files
    assert any(name.endswith(".safetensors") for name in modes_below(tmp_path / "snapshots"))


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("source", ["bytes", "file"])
def test_every_kind_of_upload_to_a_local_bucket_follows_the_umask(tmp_path, overwrite, source):
    payload = b'{"version": 1}'
    given = tmp_path / "payload.json"
    given.write_bytes(payload)
    with process_umask(0o022):
        LocalBucket(tmp_path / "bucket").upload("a/b/latest.json", payload if source == "bytes" else given)
    with process_umask(0o027):
        LocalBucket(tmp_path / "bucket").upload("a/b/latest.json", payload, overwrite=overwrite)
    modes = modes_below(tmp_path / "bucket")
    # The first write made the file and its directories; the second one replaced (or kept) it.
    assert modes == {".": 0o755, "a": 0o755, "a/b": 0o755, "a/b/latest.json": 0o640 if overwrite else 0o644}
    assert (tmp_path / "bucket" / "a" / "b" / "latest.json").read_bytes() == payload
