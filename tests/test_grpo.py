"""A real TRL GRPOTrainer with DeltaSyncCallback, and replicas fed only from the bucket."""

from __future__ import annotations

import pytest

from delta_sync import DeltaSyncCallback, Receiver
from delta_sync.layout import step_versions
from delta_sync.replica.verify import verify_bucket

from trainers import FollowingReplica, LogRecorder, grpo_trainer, same_bits, trainer_bits

pytestmark = pytest.mark.slow


def test_replica_is_bit_exact_after_every_step(tmp_path, capsys):
    bucket = tmp_path / "bucket"
    sync = DeltaSyncCallback(bucket=str(bucket), anchor_every=3, anchor_bytes_ratio=None)
    replica = FollowingReplica(sync, bucket)
    recorder = LogRecorder()
    trainer = grpo_trainer(tmp_path, [sync, replica, recorder], steps=8, gradient_accumulation_steps=2)
    trainer.train()
    assert [step for step, _, _ in replica.results] == list(range(1, 9))
    assert all(exact for _, exact, _ in replica.results), replica.results
    # After the first anchor the replica only ever downloads deltas.
    applied = [path.rsplit("/", 2)[-2] for _, _, paths in replica.results[1:] for path in paths]
    assert set(applied) == {"deltas"}
    kinds = [report.kind for report in sync.reports]
    assert kinds[0] == "anchor" and kinds[3] == "delta+anchor" and kinds.count("delta") == 5
    # Metrics sit next to the loss in the trainer's logs, as later callbacks and its printer get them.
    logged = [entry for entry in recorder.logs if "loss" in entry and "delta/sparsity" in entry]
    assert logged and all(0.0 <= entry["delta/sparsity"] <= 1.0 for entry in logged)
    assert "'delta/sparsity'" in capsys.readouterr().out
    assert verify_bucket(bucket).ok


def test_late_replica_catches_up_and_retention_keeps_what_replicas_need(tmp_path):
    bucket = tmp_path / "bucket"
    sync = DeltaSyncCallback(bucket=str(bucket), anchor_every=5, keep_anchors=2)
    late = FollowingReplica(sync, bucket, start_at=15)
    paused = FollowingReplica(sync, bucket, stop_after=12)
    trainer = grpo_trainer(tmp_path, [sync, late, paused], steps=20)
    trainer.train()

    first_step, first_exact, first_applied = late.results[0]
    assert first_step == 15 and first_exact
    assert [p.rsplit("/", 1)[-1] for p in first_applied] == [
        "step_00000011.safetensors",
        *(f"step_{v:08d}.safetensors" for v in range(12, 16)),
    ]
    assert first_applied[0].endswith("anchors/step_00000011.safetensors")
    assert all(exact for _, exact, _ in late.results) and late.results[-1][0] == 20

    files = sync.publisher.bucket.list()
    assert step_versions(files, "anchor") == [11, 16]
    assert step_versions(files, "delta") == list(range(12, 21))
    # The replica paused at version 12 still finds every delta it needs.
    assert paused.receiver.version == 12
    result = paused.receiver.update(bucket)
    assert all("/deltas/" in path for path in result.applied)
    assert same_bits(trainer_bits(trainer.model), paused.receiver.weights)


def test_sync_every_k_steps_accumulates_changes(tmp_path):
    bucket = tmp_path / "bucket"
    sync = DeltaSyncCallback(bucket=str(bucket), sync_every=3, anchor_every=100)
    replica = FollowingReplica(sync, bucket)
    trainer = grpo_trainer(tmp_path, [sync, replica], steps=7)
    trainer.train()
    assert [r.version for r in sync.reports] == [3, 6, 7]  # the remainder is published at train end
    assert [r.steps for r in sync.reports] == [3, 3, 1]
    assert all(exact for _, exact, _ in replica.results)
    fresh = Receiver()
    assert fresh.update(bucket).version == 7
    assert same_bits(trainer_bits(trainer.model), fresh.weights)
