"""State checksums and the replica's compiled passes over many tensors, against plain
Python written from the definitions in `delta_sync.integrity` and `delta_sync.sparse`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from delta_sync import BF16ChangeDetector, Publisher
from delta_sync.integrity import apply_checksums, payload_digest, tensor_checksum, updated_checksum, updated_checksums
from delta_sync.sparse import scatter_, scatter_many_

from two_tower import TwoTower, train_step

_MASK = (1 << 64) - 1


def reference_checksum(positions, bits) -> int:
    """The documented definition: the sum mod 2^64 of splitmix64's finalizer of
    `position << 16 | bf16 bits` over the elements, in Python integers."""
    total = 0
    for position, pattern in zip(positions, bits):
        z = ((position << 16) | (pattern & 0xFFFF)) * 0x9E3779B97F4A7C15 & _MASK
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        total += z ^ (z >> 31)
    return total & _MASK


def bits_of(tensor: torch.Tensor) -> list[int]:
    return tensor.reshape(-1).view(torch.int16).tolist()


def special_values(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=generator).to(torch.bfloat16)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0], dtype=torch.bfloat16)
    values[: min(n, 5)] = specials[: min(n, 5)]
    return values


@pytest.mark.parametrize("n", [0, 1, 7, 70_001])
def test_a_tensor_checksum_is_the_documented_sum(n):
    tensor = special_values(n, seed=n)
    assert tensor_checksum(tensor) == reference_checksum(range(n), bits_of(tensor))


def test_a_shards_checksum_takes_its_positions_in_the_full_tensor():
    full = special_values(200_000, seed=1).view(400, 500)
    shard = full[:, 100:300].contiguous()  # a column block: positions jump at every row

    def positions(start: int, stop: int) -> np.ndarray:
        flat = np.arange(start, stop)
        return (flat // 200) * 500 + 100 + flat % 200

    expected = reference_checksum(positions(0, shard.numel()).tolist(), bits_of(shard))
    assert tensor_checksum(shard, positions) == expected


def test_positions_beyond_32_bits_hash_as_the_definition_says():
    # A state checksum covers tensors of more than 2^32 elements; a short tensor stands in,
    # its changes at far positions.
    base = special_values(16, seed=2)
    positions = torch.tensor([3, 2**33 + 5, 2**40 + 1], dtype=torch.int64)
    new = special_values(3, seed=3)
    old = base[:3]
    expected = (
        reference_checksum(positions.tolist(), bits_of(new)) - reference_checksum(positions.tolist(), bits_of(old))
    ) & _MASK
    assert updated_checksum(0, positions, old, new) == expected


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64, "mixed"])
def test_apply_checksums_gathers_the_old_values_and_updates_each_checksum(index_dtype):
    generator = torch.Generator().manual_seed(4)
    tensors = [special_values(n, seed=n) for n in (1, 9, 70_001)] + [special_values(600, seed=5).view(20, 30)]
    items, expected = [], []
    for t, tensor in enumerate(tensors):
        dtype = (torch.int32, torch.int64)[t % 2] if index_dtype == "mixed" else index_dtype
        count = max(1, tensor.numel() // 10)
        indices = torch.randperm(tensor.numel(), generator=generator)[:count].sort().values.to(dtype)
        values = special_values(count, seed=10 + t)
        before = tensor_checksum(tensor)
        old = tensor.reshape(-1)[indices.long()].clone()
        after = tensor.clone()
        after.view(-1)[indices.long()] = values
        items.append((before, tensor, indices, values))
        expected.append((old, tensor_checksum(after)))
    snapshot = [t.clone() for t in tensors]
    old_values, checksums = apply_checksums(items)
    for (old, checksum), got_old, got in zip(expected, old_values, checksums):
        assert bits_of(got_old) == bits_of(old)
        assert got == checksum
    for tensor, untouched in zip(tensors, snapshot):  # nothing was written
        assert bits_of(tensor) == bits_of(untouched)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64, "mixed"])
def test_updated_checksums_of_many_tensors_are_each_tensors_checksum_after_its_change(index_dtype):
    generator = torch.Generator().manual_seed(20)
    tensors = [special_values(n, seed=30 + n) for n in (1, 9, 70_001, 50)]
    items, expected = [], []
    for t, tensor in enumerate(tensors):
        dtype = (torch.int32, torch.int64)[t % 2] if index_dtype == "mixed" else index_dtype
        count = 0 if t == 3 else max(1, tensor.numel() // 10)  # the last changes nothing
        indices = torch.randperm(tensor.numel(), generator=generator)[:count].sort().values.to(dtype)
        values = special_values(count, seed=40 + t)
        after = tensor.clone()
        after.view(-1)[indices.long()] = values
        items.append((tensor_checksum(tensor), indices, tensor.reshape(-1)[indices.long()], values))
        expected.append(tensor_checksum(after))
    assert updated_checksums(items) == expected
    assert [updated_checksum(*item) for item in items] == expected


def test_updated_checksums_refuses_mismatched_changes():
    indices, values = torch.tensor([1, 2], dtype=torch.int32), special_values(2, seed=50)
    with pytest.raises(ValueError, match="2 positions but 1 old and 2 new values"):
        updated_checksums([(0, indices, values[:1], values)])
    with pytest.raises(TypeError, match="bfloat16"):
        updated_checksums([(0, indices, values.float(), values)])
    with pytest.raises(TypeError, match="int32 or int64"):
        updated_checksums([(0, indices.to(torch.int16), values, values)])


def test_the_payload_digest_is_xxh3_over_names_and_raw_bytes_in_name_order():
    # Read by address rather than through torch's views: the bytes hashed must be the same,
    # for every dtype a file holds and for a tensor that is not contiguous.
    tensors = {
        "b.values": special_values(1000, seed=51),
        "a.indices": torch.arange(0, 3000, 3, dtype=torch.int32),
        "c.compact": torch.arange(256, dtype=torch.uint8),
        "d.wide": torch.arange(5, dtype=torch.int64),
        "e.columns": special_values(600, seed=52).view(20, 30)[:, 5:10],
        "f.empty": torch.empty(0, dtype=torch.bfloat16),
    }
    expected = xxhash.xxh3_64()
    for name in sorted(tensors):
        expected.update(name.encode() + b"\0")
        tensor = tensors[name].contiguous()
        if tensor.numel():
            expected.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert payload_digest(tensors.items()) == expected.hexdigest()


def test_apply_checksums_refuses_a_position_outside_its_tensor():
    tensor = special_values(10, seed=6)
    with pytest.raises(IndexError, match="position 10 is outside a tensor of 10 elements"):
        apply_checksums([(0, tensor, torch.tensor([2, 10], dtype=torch.int32), special_values(2, seed=7))])
    with pytest.raises(IndexError, match="position -1"):
        apply_checksums([(0, tensor, torch.tensor([-1]), special_values(1, seed=7))])


def test_scatter_many_writes_what_scatter_writes_on_every_path():
    generator = torch.Generator().manual_seed(8)
    contiguous = special_values(5000, seed=9).view(50, 100)
    wide = special_values(300, seed=10)
    half = torch.randn(64, generator=generator).to(torch.float16)  # any 2-byte dtype
    changes = [
        (contiguous, torch.tensor([0, 17, 4999], dtype=torch.int32), special_values(3, seed=11)),
        (wide, torch.tensor([5, 299]), special_values(2, seed=12)),
        (half, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1.5, -2.0], dtype=torch.float16)),
        (special_values(4, seed=13), torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.bfloat16)),
    ]
    expected = [t.clone() for t, _, _ in changes]
    for target, (_, indices, values) in zip(expected, changes):
        scatter_(target, indices, values)
    scatter_many_(changes)
    for (tensor, _, _), want in zip(changes, expected):
        assert bits_of(tensor) == bits_of(want)


def test_scatter_many_refuses_a_position_outside_its_tensor_and_leaves_that_tensor_unchanged():
    first, second = special_values(8, seed=14), special_values(8, seed=15)
    untouched = second.clone()
    with pytest.raises(IndexError, match="outside the tensor of 8 elements"):
        scatter_many_(
            [
                (first, torch.tensor([1], dtype=torch.int32), special_values(1, seed=16)),
                (second, torch.tensor([0, 8], dtype=torch.int32), special_values(2, seed=17)),
            ]
        )
    assert bits_of(second) == bits_of(untouched)


_UPDATE_AFTER_LOADING = r"""
import json, sys
import numba
from delta_sync.replica.compiled import load_compiled_passes
from delta_sync.replica.receiver import Receiver
from delta_sync.replica.shared import NodeStore

def compiled():
    found = {}
    for module in [m for name, m in sys.modules.items() if name.startswith("delta_sync")]:
        for name, value in vars(module).items():
            if isinstance(value, numba.core.registry.CPUDispatcher) and value.targetoptions.get("nogil"):
                found[f"{module.__name__}.{name}"] = len(value.overloads)
    return found

load_compiled_passes()
before = compiled()
buckets, shapes, snapshots = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
for bucket in buckets:
    receiver = Receiver(store=NodeStore(snapshots), expected_shapes={k: tuple(v) for k, v in shapes.items()})
    receiver.update(bucket)
    assert receiver.version == 3, receiver.version
after = compiled()
print(json.dumps({name: [before.get(name, 0), count] for name, count in after.items() if count != before.get(name, 0)}))
"""


def test_the_compiled_passes_an_update_runs_are_all_loaded_before_it(tmp_path):
    # In a fresh process, as a vLLM worker starts: an update of raw and compact deltas
    # (verified, written to the node snapshot) compiles nothing more. A pass missing from
    # `load_compiled_passes` would load while vLLM generates, stalling it.
    buckets = []
    for encoding in ("raw", "compact"):
        torch.manual_seed(0)
        model = TwoTower()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        detector = BF16ChangeDetector(model, optimizer)
        publisher = Publisher(tmp_path / encoding, detector, anchor_every=10, encoding=encoding, background=False)
        for version in (1, 2, 3):
            train_step(model, optimizer, seed=version)
            publisher.publish(version)
        publisher.close()
        detector.close()
        buckets.append(str(tmp_path / encoding))
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    result = subprocess.run(
        [sys.executable, "-c", _UPDATE_AFTER_LOADING, json.dumps(buckets), json.dumps(shapes), str(tmp_path / "nodes")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {}
