"""The main example's closing table: a server that refused an update is reported as such,
never as one that diverged; and the example leaves another run's files alone by default."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from delta_sync.trainer.replicas import ReplicaState


def check_with(states_after_wait, served_checksums=()):
    """A ReplicaCheck whose server answers `wait` with `states_after_wait` (the replicas behind)."""
    from grpo_delta_sync import ReplicaCheck

    check = object.__new__(ReplicaCheck)
    replicas = SimpleNamespace(
        wait=lambda version, timeout: states_after_wait,
        states={f"http://r{i}": ReplicaState(f"http://r{i}", 1, c) for i, c in enumerate(served_checksums)},
    )
    check.sync = SimpleNamespace(replicas=replicas)
    check.server_checked, check.server_refused = [], []
    return check


def test_a_refused_update_is_reported_as_a_refusal():
    from grpo_delta_sync import server_verdict

    refusal = "delta-sync refused the update: UntrustedBucketError: bucket file:///a is not on the allow list"
    check = check_with([ReplicaState("http://r0", None, None, error=refusal)])
    check._check_server(1, {"w": torch.zeros(2, dtype=torch.bfloat16)})
    assert check.server_checked == []
    assert check.server_refused == [(1, f"http://r0: {refusal}")]
    assert server_verdict(check) == "not compared (it took no version)"


def test_a_different_checksum_is_a_divergence():
    from grpo_delta_sync import server_verdict

    check = check_with([], served_checksums=["0" * 16])
    check._check_server(1, {"w": torch.zeros(2, dtype=torch.bfloat16)})
    assert check.server_checked == [(1, False)] and check.server_refused == []
    assert server_verdict(check) == "no (diverged)"


def test_the_example_keeps_another_runs_files_unless_told():
    from grpo_delta_sync import parse_args

    assert parse_args([]).overwrite is False
    assert parse_args(["--overwrite"]).overwrite is True
