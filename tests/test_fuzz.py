"""Hostile input against the replica: damaged and crafted files never change the held weights
into anything but the trainer's, and every refusal is a DeltaSyncError naming the problem.

Every case starts from a real bucket (a short AdamW run) and a replica at v3, then mutates
one file and asks the replica for it, by name and by catch-up.
"""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from delta_sync import Receiver
from delta_sync.errors import DeltaSyncError
from delta_sync.layout import LATEST, anchor_path, delta_path
from delta_sync.signing import SigningKey

from helpers import bf16_bits, held_bf16_bits
from two_tower import PublishedRun

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "bucket"
    run = PublishedRun(root, versions=5, anchor_every=3, keep_anchors=10)  # anchors 1, 4; deltas 2-5
    run.publisher.close()
    return run


@pytest.fixture
def bucket(original, tmp_path):
    root = tmp_path / "bucket"
    shutil.copytree(original.root, root)
    return root


def replica_at_v3(root) -> Receiver:
    receiver = Receiver()
    for path in (anchor_path(1), delta_path(2), delta_path(3)):
        receiver.update(root, path)
    return receiver


def snapshot(receiver: Receiver):
    return receiver.version, held_bf16_bits(receiver)


def assert_never_wrong(original, receiver: Receiver, before, request) -> None:
    """Either refused with the held weights untouched, or applied and bit-exact with the trainer."""
    version, held = before
    try:
        request()
    except DeltaSyncError:
        assert receiver.version == version
        for name, tensor in held.items():
            assert torch.equal(tensor, bf16_bits(receiver.weights[name])), name
        return
    expected = original.states[receiver.version]
    for name, tensor in expected.items():
        assert torch.equal(bf16_bits(tensor), bf16_bits(receiver.weights[name])), (receiver.version, name)


def flip_bytes(path, rng: random.Random, count: int) -> None:
    data = bytearray(path.read_bytes())
    for _ in range(count):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target", [delta_path(4), anchor_path(4), delta_path(5)])
@pytest.mark.parametrize("seed", range(12))
def test_byte_flips(original, bucket, target, seed):
    rng = random.Random(seed)
    receiver = replica_at_v3(bucket)
    before = snapshot(receiver)
    flip_bytes(bucket / target, rng, count=1 + seed % 3)
    assert_never_wrong(original, receiver, before, lambda: receiver.update(bucket, target))
    assert_never_wrong(original, receiver, snapshot(receiver), lambda: receiver.update(bucket))


@pytest.mark.parametrize("target", [delta_path(4), anchor_path(4), LATEST])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.3, 0.9, 0.999])
def test_truncations(original, bucket, target, fraction):
    receiver = replica_at_v3(bucket)
    before = snapshot(receiver)
    data = (bucket / target).read_bytes()
    (bucket / target).write_bytes(data[: int(len(data) * fraction)])
    request = (lambda: receiver.update(bucket)) if target == LATEST else (lambda: receiver.update(bucket, target))
    assert_never_wrong(original, receiver, before, request)


NASTY = {
    "empty": "",
    "letters": "abc",
    "negative": "-1",
    "float": "12.9",
    "spaced": " 1_2 ",
    "huge": "9" * 40,
    "exponent": "1e400",
    "nested": "[" * 50_000 + "]" * 50_000,
    "object nesting": '{"a":' * 20_000 + "1" + "}" * 20_000,
    "infinity list": "[Infinity]",
    "wrong type": '{"x": [1.5, -2]}',
    "long": "x" * 1_000_000,
}


def rewrite_metadata(path, key: str, value: str | None) -> None:
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    if value is None:
        metadata.pop(key, None)
    else:
        metadata[key] = value
    save_file(tensors, str(path), metadata=metadata)


DELTA_KEYS = [
    "format",
    "format_version",
    "kind",
    "sparse",
    "model_version",
    "base_version",
    "anchor_version",
    "encoding",
    "run_id",
    "epoch",
    "shapes",
    "checksums",
    "base_checksums",
    "model_checksum",
    "payload_xxh3",
    "changed_elements",
    "total_elements",
    "changed_params",
]


@pytest.mark.parametrize("key", DELTA_KEYS)
def test_metadata_mutations_of_a_delta(original, bucket, key):
    receiver = replica_at_v3(bucket)
    for value in [None, *NASTY.values()]:
        shutil.copy(original.root / delta_path(4), bucket / delta_path(4))
        rewrite_metadata(bucket / delta_path(4), key, value)
        before = snapshot(receiver)
        assert_never_wrong(original, receiver, before, lambda r=receiver: r.update(bucket, delta_path(4)))
        if receiver.version != 3:  # an informational field: the genuine delta applied; start again
            receiver = replica_at_v3(bucket)


@pytest.mark.parametrize("key", ["model_version", "shapes", "checksums", "model_checksum", "blocks", "part"])
def test_metadata_mutations_of_an_anchor(original, bucket, key):
    receiver = Receiver()
    for value in [None, *NASTY.values(), "0/2", '{"w": [0, 0]}']:
        shutil.copy(original.root / anchor_path(4), bucket / anchor_path(4))
        rewrite_metadata(bucket / anchor_path(4), key, value)
        assert_never_wrong(original, receiver, snapshot(receiver), lambda: receiver.update(bucket, anchor_path(4)))


@pytest.mark.parametrize(
    "pointer",
    [
        b"",
        b"[]",
        b"null",
        b'{"version": 1e400}',
        b'{"version": "5"}',
        b"[" * 100_000,
        b'{"version": 5, "anchor_version": 4, "anchor": "anchors/step_00000004.safetensors", "delta": null, '
        b'"model_checksum": "0000000000000000", "run_id": "someone-else"}',
        b'{"version": 9, "anchor_version": 4, "anchor": "../../etc/passwd", "delta": "../x", '
        b'"model_checksum": "0", "run_id": "r"}',
    ],
)
def test_hostile_latest_json(original, bucket, pointer):
    receiver = replica_at_v3(bucket)
    (bucket / LATEST).write_bytes(pointer)
    assert_never_wrong(original, receiver, snapshot(receiver), lambda: receiver.update(bucket))
    assert_never_wrong(original, receiver, snapshot(receiver), lambda: receiver.update(bucket, delta_path(4)))


def test_with_a_key_every_flip_is_a_signature_error(tmp_path):
    from delta_sync import BF16ChangeDetector, Publisher
    from delta_sync.errors import SignatureError

    from two_tower import TwoTower, train_step

    key = SigningKey.generate()
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(tmp_path, BF16ChangeDetector(model, optimizer), background=False, signing_key=key)
    for version in (1, 2):
        train_step(model, optimizer, seed=version)
        publisher.publish(version)
    publisher.close()
    rng = random.Random(0)
    original = (tmp_path / delta_path(2)).read_bytes()
    for _ in range(20):
        receiver = Receiver(verify_key=key.verify_key)
        receiver.update(tmp_path, anchor_path(1))
        (tmp_path / delta_path(2)).write_bytes(original)
        flip_bytes(tmp_path / delta_path(2), rng, count=1)
        with pytest.raises(
            SignatureError, match=re.escape(delta_path(2)) + ": the file's SHA-256 .* is not the one signed"
        ):
            receiver.update(tmp_path, delta_path(2))
        assert receiver.version == 1
    json.loads((tmp_path / LATEST).read_text())  # the pointer itself stays valid JSON
