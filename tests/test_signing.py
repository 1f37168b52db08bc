"""Signed versions: with a verify key, only files the trainer signed change what a replica holds."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from delta_sync import BF16ChangeDetector, Publisher, Receiver, read_file, verify_bucket
from delta_sync.errors import ApplyError, FormatError, SignatureError
from delta_sync.format import SparseChange, write_delta
from delta_sync.integrity import model_checksum, updated_checksum
from delta_sync.layout import LATEST, anchor_path, delta_path
from delta_sync.signing import SigningKey, VerifyKey

from helpers import bf16_bits, held_bf16_bits
from two_tower import TwoTower, bf16_state, train_step


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    private, public = SigningKey.generate().save(directory)
    return private, public


def publish(root, signing_key, versions: int = 4):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(
        root, BF16ChangeDetector(model, optimizer), anchor_every=3, background=False, signing_key=signing_key
    )
    states = {}
    for version in range(1, versions + 1):
        train_step(model, optimizer, seed=version)
        publisher.publish(version)
        states[version] = bf16_state(model)
    publisher.close()
    return states


def assert_unchanged(receiver: Receiver, before: dict[str, torch.Tensor], version: int) -> None:
    assert receiver.version == version
    for name, tensor in before.items():
        assert torch.equal(tensor, bf16_bits(receiver.weights[name])), name


def test_keygen_writes_a_private_key_only_its_owner_reads(keys):
    private, public = keys
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    assert SigningKey.load(private).key_id == VerifyKey.load(public).key_id
    assert VerifyKey.load(public.read_text()).key_id == VerifyKey.load(public).key_id  # PEM text, as in a secret
    with pytest.raises(FileExistsError, match=r"File exists: .*delta-sync\.key"):
        SigningKey.generate().save(private.parent)


def test_a_signed_bucket_replays_bit_exactly_with_the_key(tmp_path, keys):
    private, public = keys
    states = publish(tmp_path, private)
    assert (tmp_path / (delta_path(2) + ".sig")).is_file() and "signature" in json.loads(
        (tmp_path / LATEST).read_text()
    )
    receiver = Receiver(verify_key=public)
    assert receiver.update(tmp_path).version == 4
    for name, tensor in states[4].items():
        assert torch.equal(bf16_bits(tensor), bf16_bits(receiver.weights[name]))
    assert verify_bucket(str(tmp_path)).ok


def test_unsigned_or_foreign_files_are_refused(tmp_path, keys):
    _, public = keys
    publish(tmp_path / "unsigned", None)
    with pytest.raises(SignatureError, match="not signed"):
        Receiver(verify_key=public).update(tmp_path / "unsigned")
    other = SigningKey.generate()
    publish(tmp_path / "other", other)
    with pytest.raises(SignatureError, match="not by the trusted key"):
        Receiver(verify_key=public).update(tmp_path / "other")


def forge(root, *, edit_metadata=None, extra_change=False):
    """Rewrite delta 4 as an attacker with write access to the bucket would: valid format,
    recomputed checksums, but not the trainer's file."""
    path = root / delta_path(4)
    delta = read_file(path)
    header = delta.header
    changes = dict(delta.changes)
    if extra_change:
        name = sorted(changes)[0]
        change = changes[name]
        value = torch.tensor([9984.0], dtype=torch.bfloat16)
        changes[name] = SparseChange(change.indices, torch.cat([change.values[:-1], value]))
        checksum = updated_checksum(header.checksums[name], change.indices[-1:], change.values[-1:], value)
        checksums = {**header.checksums, name: checksum}
        header = type(header)(**{**vars(header), "checksums": checksums, "model_checksum": model_checksum(checksums)})
    if edit_metadata:
        identity = {key: edit_metadata.pop(key) for key in ("version", "run_id") if key in edit_metadata}
        header = dataclasses.replace(header, id=dataclasses.replace(header.id, **identity), **edit_metadata)
    path.unlink()
    write_delta(path, changes, header)


@pytest.mark.parametrize(
    "forgery",
    [
        pytest.param({"extra_change": True}, id="recomputed checksums"),
        pytest.param({"edit_metadata": {"version": 97}}, id="version jump"),
        pytest.param({"edit_metadata": {"changed_elements": 0}}, id="metadata only"),
    ],
)
def test_forged_files_are_refused_with_a_key(tmp_path, keys, forgery):
    private, public = keys
    states = publish(tmp_path, private)
    receiver = Receiver(verify_key=public)
    for path in (anchor_path(1), delta_path(2), delta_path(3)):
        receiver.update(tmp_path, path)
    before, version = held_bf16_bits(receiver), receiver.version
    forge(tmp_path, **forgery)
    with pytest.raises(
        SignatureError,
        match=re.escape(delta_path(4)) + ": (the file's SHA-256 .* is|larger than .*) not the one signed",
    ):
        receiver.update(tmp_path, delta_path(4))
    assert_unchanged(receiver, before, version)
    # Catching up passes over the forged delta and reaches v4 through its signed anchor.
    assert receiver.update(tmp_path).version == 4
    for name, tensor in states[4].items():
        assert torch.equal(bf16_bits(tensor), bf16_bits(receiver.weights[name])), name


def test_without_a_key_a_version_jump_is_still_refused(tmp_path):
    publish(tmp_path, None)
    receiver = Receiver()
    receiver.update(tmp_path, anchor_path(1))
    for version in (2, 3):
        receiver.update(tmp_path, delta_path(version))
    before = held_bf16_bits(receiver)
    forge(tmp_path, edit_metadata={"version": 97})
    with pytest.raises(FormatError, match="path names delta v4"):
        receiver.update(tmp_path, delta_path(4))
    assert_unchanged(receiver, before, 3)
    # And a file claiming a version past latest.json, at a path that matches its claim.
    (tmp_path / delta_path(4)).rename(tmp_path / delta_path(97))
    with pytest.raises(FormatError, match="past the bucket's latest.json"):
        receiver.update(tmp_path, delta_path(97))
    assert_unchanged(receiver, before, 3)


def test_a_replica_of_another_run_is_told_so(tmp_path):
    publish(tmp_path / "a", None)
    publish(tmp_path / "b", None)
    receiver = Receiver()
    receiver.update(tmp_path / "a")
    with pytest.raises(ApplyError, match="belongs to run"):
        receiver.update(tmp_path / "b", delta_path(4))


def test_keygen_and_verify_from_the_command_line(tmp_path):
    from helpers import cli

    made = cli("keygen", str(tmp_path / "keys"))
    assert made.returncode == 0, made.stderr
    assert cli("keygen", str(tmp_path / "keys")).returncode != 0  # never overwrites a key
    publish(tmp_path / "bucket", tmp_path / "keys" / "delta-sync.key")
    public = str(tmp_path / "keys" / "delta-sync.pub")
    assert cli("verify", str(tmp_path / "bucket"), "--verify-key", public).returncode == 0
    other = SigningKey.generate().save(tmp_path / "other")[1]
    refused = cli("verify", str(tmp_path / "bucket"), "--verify-key", str(other))
    assert refused.returncode == 1 and "not by the trusted key" in refused.stdout
