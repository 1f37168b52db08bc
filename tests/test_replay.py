"""Signed pointers only move forward: with a verify key, nothing the trainer ever signed,
put back into the bucket, moves a replica to older or other weights; a frozen pointer
shows in the replica's freshness; downloads are bounded before they start."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from delta_sync import BF16ChangeDetector, Publisher, Receiver, expected_shapes_of, module_weight_loader
from delta_sync.errors import OversizedFileError, PublishError, ReplayError, SignatureError
from delta_sync.format import read_file
from delta_sync.layout import LATEST, Latest, anchor_path, delta_path
from delta_sync.replica.pointer import PointerLedger
from delta_sync.signing import SIGNATURE_SUFFIX, FileSignature, SigningKey
from delta_sync.storage import LocalBucket
from delta_sync.storage.cache import DownloadCache

from helpers import assert_bit_exact, bf16_bits, held_bf16_bits, wait_for
from two_tower import TwoTower, bf16_state, train_step

KEY = SigningKey.generate()


class SignedRun:
    """A run published with `KEY` to a local bucket, keeping each version's bf16 state and
    the bucket's `latest.json` as it was after that version."""

    def __init__(self, root, *, run_id: str | None = None, seed: int = 0, anchor_every: int = 3, **options) -> None:
        torch.manual_seed(seed)
        self.root = root
        self.model = TwoTower()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.publisher = Publisher(
            root,
            BF16ChangeDetector(self.model, self.optimizer),
            anchor_every=anchor_every,
            anchor_bytes_ratio=None,
            keep_anchors=10,
            background=False,
            signing_key=KEY,
            run_id=run_id,
            **options,
        )
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.pointers: dict[int, bytes] = {}

    def publish(self, *versions: int, seed: int = 0) -> SignedRun:
        for version in versions:
            train_step(self.model, self.optimizer, seed=seed + version)
            self.publisher.publish(version)
            self.states[version] = bf16_state(self.model)
            self.pointers[version] = (self.root / LATEST).read_bytes()
        return self

    def close(self) -> None:
        self.publisher.close()


def replica(tmp_path, name: str = "replica", **kwargs) -> tuple[Receiver, TwoTower]:
    """A receiver with a verify key and its own cache directory (where it remembers pointers)."""
    model = TwoTower()
    receiver = Receiver(
        load_weights=module_weight_loader(model),
        expected_shapes=expected_shapes_of(model),
        verify_key=KEY.verify_key,
        cache=DownloadCache(tmp_path / name),
        **kwargs,
    )
    return receiver, model


def assert_still_serving(receiver: Receiver, model: TwoTower, before: dict[str, torch.Tensor], version: int) -> None:
    assert receiver.version == version
    for name, tensor in before.items():
        assert torch.equal(tensor, bf16_bits(receiver.weights[name])), name
        assert torch.equal(tensor, bf16_bits(dict(model.named_parameters())[name].detach())), name


@pytest.fixture
def run8(tmp_path):
    run = SignedRun(tmp_path / "bucket").publish(*range(1, 9))
    yield run
    run.close()


def test_an_older_signed_pointer_put_back_is_refused_and_a_restart_remembers(tmp_path, run8):
    receiver, model = replica(tmp_path)
    assert receiver.update(run8.root).version == 8
    before = held_bf16_bits(receiver)
    (run8.root / LATEST).write_bytes(run8.pointers[5])  # genuinely signed, and older
    with pytest.raises(ReplayError, match=r"older than one this replica already accepted .* naming v5 .* v8"):
        receiver.update(run8.root)
    assert_still_serving(receiver, model, before, 8)
    # A replica restarted with the same cache directory remembers the newest pointer.
    restarted, _ = replica(tmp_path)
    with pytest.raises(ReplayError, match="an old latest.json was put back"):
        restarted.update(run8.root)
    # The trainer's next pointer is newer: the replica follows it.
    (run8.root / LATEST).write_bytes(run8.pointers[8])
    run8.publish(9)
    assert receiver.update(run8.root).version == 9
    assert_bit_exact(run8.states[9], bf16_state(model))


def test_the_whole_bucket_as_it_was_is_refused(tmp_path):
    """The bucket put back as it stood at v5 (anchors, deltas, signatures, pointer)."""
    run = SignedRun(tmp_path / "bucket").publish(*range(1, 6))
    shutil.copytree(run.root, tmp_path / "backup")
    run.publish(6, 7, 8)
    run.close()
    receiver, model = replica(tmp_path)
    assert receiver.update(run.root).version == 8
    before = held_bf16_bits(receiver)
    shutil.rmtree(run.root)
    shutil.copytree(tmp_path / "backup", run.root)
    with pytest.raises(ReplayError):
        receiver.update(run.root)
    assert_still_serving(receiver, model, before, 8)


def test_another_runs_files_signed_with_the_same_key_are_refused(tmp_path, run8):
    other = SignedRun(tmp_path / "run-b", seed=1).publish(1, 2, 3, 4)
    other.close()
    receiver, model = replica(tmp_path)
    assert receiver.update(run8.root).version == 8
    before = held_bf16_bits(receiver)
    shutil.rmtree(run8.root)
    shutil.copytree(other.root, run8.root)
    with pytest.raises(SignatureError, match=r"latest\.json: signed for bucket '.*run-b', but it was read from"):
        receiver.update(run8.root)
    assert_still_serving(receiver, model, before, 8)
    # A fresh replica has no memory to lean on: the bucket binding alone refuses the copy.
    fresh, _ = replica(tmp_path, "fresh")
    with pytest.raises(SignatureError, match="signed for bucket"):
        fresh.update(run8.root, anchor_path(4))
    assert fresh.version is None


def test_a_signed_file_copied_from_another_bucket_is_refused(tmp_path, run8):
    other = SignedRun(tmp_path / "run-b", seed=1).publish(1, 2)
    other.close()
    receiver, _ = replica(tmp_path)
    assert receiver.update(run8.root).version == 8
    # Another bucket's anchor of v1 (with its signature) in place of this bucket's.
    for suffix in ("", SIGNATURE_SUFFIX):
        shutil.copy(other.root / (anchor_path(1) + suffix), run8.root / (anchor_path(1) + suffix))
    fresh, _ = replica(tmp_path, "fresh")
    with pytest.raises(SignatureError, match=r"anchors/step_00000001\.safetensors: signed for bucket '.*run-b'"):
        fresh.update(run8.root, anchor_path(1))


def test_a_resume_is_followed_and_its_abandoned_epoch_is_refused(tmp_path, run8):
    receiver, model = replica(tmp_path)
    assert receiver.update(run8.root).version == 8
    abandoned_v8 = run8.pointers[8]
    run8.close()
    # Resumed in place from a checkpoint of step 4: a new epoch rewrites v5 on, up to v10.
    resumed = SignedRun(run8.root, run_id=run8.publisher.run_id, seed=5).publish(*range(5, 11), seed=50)
    resumed.close()
    # The replica on the abandoned v8 follows the newer pointer to the new epoch's v10.
    assert receiver.update(run8.root).version == 10
    assert receiver.epoch == resumed.publisher.epoch
    assert_bit_exact(resumed.states[10], bf16_state(model))
    before = held_bf16_bits(receiver)
    (run8.root / LATEST).write_bytes(abandoned_v8)
    with pytest.raises(ReplayError, match=f"epoch {run8.publisher.epoch}"):
        receiver.update(run8.root)
    assert_still_serving(receiver, model, before, 10)


def test_a_pointer_under_a_known_sequence_must_say_the_same(tmp_path, run8):
    ledger = PointerLedger(tmp_path / "ledger")
    latest = Latest.from_json(run8.pointers[8])
    ledger.accept("bucket", latest)
    ledger.accept("bucket", latest)  # the same pointer read again
    import dataclasses

    with pytest.raises(ReplayError, match="same sequence"):
        ledger.accept("bucket", dataclasses.replace(latest, model_checksum="0" * 32))
    assert PointerLedger(tmp_path / "ledger").newest("bucket").sequence == latest.sequence


def test_pointers_count_on_across_resumes_even_without_the_old_pointer(tmp_path):
    first = SignedRun(tmp_path / "bucket").publish(1, 2)
    first.close()
    sequence = Latest.from_json(first.pointers[2]).sequence
    (first.root / LATEST).unlink()  # lost: the new start still counts past it (its clock)
    second = SignedRun(first.root, run_id=first.publisher.run_id, seed=3).publish(2)
    second.close()
    assert Latest.from_json(second.pointers[2]).sequence > sequence


def test_an_unsigned_or_uncounted_pointer_is_refused_with_a_key(tmp_path, run8):
    fields = json.loads(run8.pointers[8])
    for missing in ("sequence", "written_at"):
        stripped = {key: value for key, value in fields.items() if key != missing}
        (run8.root / LATEST).write_text(json.dumps(stripped))
        receiver, _ = replica(tmp_path, f"replica-{missing}")
        with pytest.raises(SignatureError, match="is not the one signed"):
            receiver.update(run8.root)
        assert receiver.version is None


# -- freshness ---------------------------------------------------------------------------


def test_a_frozen_pointer_makes_the_replica_stale_and_says_so(tmp_path, run8, caplog):
    receiver, _ = replica(tmp_path, max_staleness=0.05)
    assert receiver.freshness().age is None and not receiver.freshness().stale
    receiver.update(run8.root)
    written_at = Latest.from_json(run8.pointers[8]).written_at
    caplog.set_level(logging.WARNING, logger="delta_sync")
    wait_for(lambda: receiver.freshness().stale, timeout=30, what="the pointer to grow older than 0.05 s")
    freshness = receiver.freshness()
    assert freshness.age >= 0.05 and freshness.max_age == 0.05
    assert freshness.age == pytest.approx(__import__("time").time() - written_at, abs=5)
    assert [r for r in caplog.records if "latest.json (v8) was written" in r.getMessage()], caplog.text
    warnings = len(caplog.records)
    receiver.freshness()
    assert len(caplog.records) == warnings  # once per pointer, not per status request


def test_the_max_staleness_setting_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTA_SYNC_MAX_STALENESS", "soon")
    with pytest.raises(ValueError, match="DELTA_SYNC_MAX_STALENESS must be a positive number of seconds"):
        replica(tmp_path)
    monkeypatch.setenv("DELTA_SYNC_MAX_STALENESS", "90")
    assert replica(tmp_path)[0].max_staleness == 90.0


def test_a_live_trainer_refreshes_its_pointer_with_nothing_to_publish(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(
        tmp_path, BF16ChangeDetector(model, optimizer), signing_key=KEY, pointer_refresh=0.1, background=True
    )
    try:
        train_step(model, optimizer, seed=1)
        publisher.publish(1)
        publisher.flush()
        first = Latest.from_json(
            (tmp_path / LATEST).read_bytes(), verify_key=KEY.verify_key, bucket=f"{tmp_path.as_uri()}"
        )

        def refreshed() -> Latest | None:
            latest = Latest.from_json(
                (tmp_path / LATEST).read_bytes(), verify_key=KEY.verify_key, bucket=tmp_path.as_uri()
            )
            return latest if latest.sequence > first.sequence else None

        again = wait_for(refreshed, timeout=30, what="the publisher to refresh latest.json")
        assert again.version == 1 and again.model_checksum == first.model_checksum
        assert again.written_at > first.written_at
    finally:
        publisher.close()
    with pytest.raises(ValueError, match="pointer_refresh must be > 0"):
        Publisher(tmp_path / "other", BF16ChangeDetector(model, optimizer), pointer_refresh=0)


# -- bounded downloads -------------------------------------------------------------------


def test_an_unsigned_delta_larger_than_the_model_allows_is_refused_before_the_copy(tmp_path):
    root = tmp_path / "bucket"
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(root, BF16ChangeDetector(model, optimizer), background=False)
    for version in (1, 2):
        train_step(model, optimizer, seed=version)
        publisher.publish(version)
    publisher.close()
    replica_model = TwoTower()
    cache = tmp_path / "cache"
    receiver = Receiver(
        load_weights=module_weight_loader(replica_model),
        expected_shapes=expected_shapes_of(replica_model),
        cache=DownloadCache(cache),
    )
    receiver.update(root, anchor_path(1))
    # A sparse file far larger than a delta of every element could be.
    with open(root / delta_path(2), "r+b") as handle:
        handle.truncate(1 << 40)
    with pytest.raises(OversizedFileError, match=r"deltas/step_00000002\.safetensors: 1,099,511,627,776 bytes"):
        receiver.update(root, delta_path(2))
    assert receiver.version == 1
    assert not [p for p in cache.rglob("step_00000002.safetensors")]


def test_a_signed_file_is_downloaded_no_further_than_its_signed_size(tmp_path, run8):
    receiver, _ = replica(tmp_path)
    receiver.update(run8.root, anchor_path(1))
    with open(run8.root / delta_path(2), "r+b") as handle:
        handle.truncate(1 << 40)
    with pytest.raises(SignatureError, match=r"step_00000002\.safetensors: larger than the [\d,]+ bytes signed"):
        receiver.update(run8.root, delta_path(2))
    assert not [p for p in (tmp_path / "replica").rglob("step_00000002.safetensors")]
    # No signature: refused before the file is fetched at all.
    (run8.root / (delta_path(3) + SIGNATURE_SUFFIX)).unlink()
    with pytest.raises(SignatureError, match="not signed"):
        receiver.update(run8.root, delta_path(3))
    assert not [p for p in (tmp_path / "replica").rglob("step_00000003.safetensors")]
    assert receiver.version == 1


def test_a_signature_names_its_bucket_run_epoch_and_size(run8):
    signature = FileSignature.from_json((run8.root / (delta_path(2) + SIGNATURE_SUFFIX)).read_bytes(), source="sig")
    header = read_file(run8.root / delta_path(2)).header
    assert signature.about.bucket == run8.root.as_uri()
    assert (signature.about.run_id, signature.about.epoch) == (header.run_id, header.epoch)
    assert signature.size == os.path.getsize(run8.root / delta_path(2))


def test_an_older_format_signature_is_refused_with_a_clear_error(run8):
    fields = json.loads((run8.root / (delta_path(2) + SIGNATURE_SUFFIX)).read_bytes())
    old = {key: fields[key] for key in ("path", "sha256", "key_id", "signature")}
    with pytest.raises(Exception, match="older format, which names no bucket"):
        FileSignature.from_json(json.dumps(old).encode(), source="deltas/step_00000002.safetensors.sig")


def test_trainer_and_replicas_may_name_a_bucket_alike(tmp_path):
    """A directory the trainer and a replica mount at different paths: both name it."""
    run = SignedRun(tmp_path / "trainer-view", bucket_id="shared-run1").publish(1, 2)
    run.close()
    (tmp_path / "replica-view").symlink_to(run.root)
    receiver, model = replica(tmp_path)
    with pytest.raises(SignatureError, match="set DELTA_SYNC_BUCKET_ID to the same name on both"):
        receiver.update(tmp_path / "replica-view")
    named, model = replica(tmp_path, "named", bucket_id="shared-run1")
    assert named.update(tmp_path / "replica-view").version == 2
    assert_bit_exact(run.states[2], bf16_state(model))


# -- signatures land with their files ----------------------------------------------------


class FailingUploads(LocalBucket):
    """A local bucket whose uploads of chosen paths fail: a store outage at one exact write
    cannot be produced for real, so this test double stands in for it."""

    failing: set[str] = set()

    def upload(self, path, source, *, overwrite=True):
        if path in self.failing:
            raise OSError(f"injected failure uploading {path}")
        super().upload(path, source, overwrite=overwrite)


@pytest.mark.parametrize("failing", ["signature", "file"])
def test_no_version_file_is_ever_stored_without_its_signature(tmp_path, failing):
    from delta_sync import verify_bucket

    bucket = FailingUploads(tmp_path)
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(bucket, BF16ChangeDetector(model, optimizer), background=False, signing_key=KEY)
    train_step(model, optimizer, seed=1)
    publisher.publish(1)
    FailingUploads.failing = {delta_path(2) + (SIGNATURE_SUFFIX if failing == "signature" else "")}
    try:
        train_step(model, optimizer, seed=2)
        with pytest.raises(PublishError, match="injected failure"):
            publisher.publish(2)
            publisher.flush()
    finally:
        FailingUploads.failing = set()
    stored = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert delta_path(2) not in stored  # never a stored file without its signature
    publisher.close()
    report = verify_bucket(tmp_path, verify_key=KEY.verify_key)
    assert report.ok and report.latest_version == 1, report.to_dict()
