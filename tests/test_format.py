"""The file format: round trips, empty deltas, index dtypes, and the published TRL reading path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from delta_sync import read_file
from delta_sync.errors import FormatError
from delta_sync.format import Anchor, Delta, FileHeader, SparseChange, index_dtype, write_anchor, write_delta
from delta_sync.integrity import model_checksum, tensor_checksum, updated_checksum
from delta_sync.version import VersionId

from helpers import assert_bit_exact


def anchor_header(tensors: dict[str, torch.Tensor], version: int = 1) -> FileHeader:
    checksums = {name: tensor_checksum(t) for name, t in tensors.items()}
    total = sum(t.numel() for t in tensors.values())
    return FileHeader(
        source="test",
        kind="anchor",
        id=VersionId(version, version, "run"),
        base_version=None,
        encoding="dense",
        shapes={n: tuple(t.shape) for n, t in tensors.items()},
        checksums=checksums,
        base_checksums={},
        model_checksum=model_checksum(checksums),
        changed_elements=total,
        total_elements=total,
    )


def delta_header(base: dict[str, torch.Tensor], changes: dict[str, SparseChange], version: int = 2) -> FileHeader:
    checksums = {name: tensor_checksum(t) for name, t in base.items()}
    new = {
        name: updated_checksum(checksums[name], c.indices, base[name].view(-1)[c.indices.long()], c.values)
        for name, c in changes.items()
    }
    return FileHeader(
        source="test",
        kind="delta",
        id=VersionId(version, 1, "run"),
        base_version=version - 1,
        encoding="raw",
        shapes={n: tuple(base[n].shape) for n in changes},
        checksums=new,
        base_checksums={n: checksums[n] for n in changes},
        model_checksum=model_checksum({**checksums, **new}),
        changed_elements=sum(len(c) for c in changes.values()),
        total_elements=sum(t.numel() for t in base.values()),
    )


@pytest.fixture
def weights():
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8).bfloat16(),
        "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
    }


def test_anchor_round_trip(tmp_path, weights):
    path = tmp_path / "anchor.safetensors"
    write_anchor(path, weights, anchor_header(weights))
    anchor = read_file(path)
    assert isinstance(anchor, Anchor)
    assert anchor.header.kind == "anchor" and anchor.header.version == 1
    assert_bit_exact(weights, dict(anchor.items()))
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata()["sparse"] == "False"
        assert set(handle.keys()) == set(weights)


def test_delta_round_trip(tmp_path, weights):
    changes = {
        "model.embed_tokens.weight": SparseChange(
            torch.tensor([3, 17, 100], dtype=torch.int32), torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
        )
    }
    path = tmp_path / "delta.safetensors"
    written = write_delta(path, changes, delta_header(weights, changes))
    delta = read_file(path)
    assert isinstance(delta, Delta)
    assert delta.header == FileHeader(**{**written.__dict__, "source": str(path)})
    change = delta.changes["model.embed_tokens.weight"]
    assert change.indices.dtype == torch.int32
    assert change.indices.tolist() == [3, 17, 100]
    assert torch.equal(change.values.view(torch.int16), changes["model.embed_tokens.weight"].values.view(torch.int16))
    assert delta.header.sparsity == pytest.approx(1 - 3 / (16 * 8 + 8))


def test_empty_delta_is_a_valid_file(tmp_path, weights):
    path = tmp_path / "empty.safetensors"
    write_delta(path, {}, delta_header(weights, {}))
    delta = read_file(path)
    assert isinstance(delta, Delta) and delta.changes == {}
    assert delta.header.changed_elements == 0 and delta.header.sparsity == 1.0
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata()["changed_params"] == "[]"
        assert list(handle.keys()) == []


def test_index_dtype_switches_to_int64_at_2_pow_31():
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64


def test_int64_indices_for_a_huge_tensor(tmp_path):
    # The shape is recorded, not allocated: a delta only stores the changed elements.
    huge = (2**16, 2**15 + 1)  # 2^31 + 2^16 elements
    changes = {
        "huge.weight": SparseChange(torch.tensor([5, 2**31 + 7]), torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    }
    header = FileHeader(
        source="test",
        kind="delta",
        id=VersionId(2, 1, "run"),
        base_version=1,
        encoding="raw",
        shapes={"huge.weight": huge},
        checksums={"huge.weight": 1},
        base_checksums={"huge.weight": 0},
        model_checksum="0" * 16,
        changed_elements=2,
        total_elements=2**31 + 2**16,
    )
    path = tmp_path / "huge.safetensors"
    write_delta(path, changes, header)
    assert load_file(str(path))["huge.weight.indices"].dtype == torch.int64
    assert read_file(path).changes["huge.weight"].indices.tolist() == [5, 2**31 + 7]
    # The same positions as int32 would be wrong for such a tensor, and are refused.
    tensors = load_file(str(path))
    tensors["huge.weight.indices"] = torch.tensor([5, 7], dtype=torch.int32)
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(FormatError, match="must be 1-D torch.int64"):
        read_file(path)


def test_trl_style_receiver_reads_our_delta_with_safe_open_alone(run):
    """A receiver written against the published TRL format: only safe_open and the four keys."""
    base = {name: t.clone() for name, t in run.states[3].items()}
    path = run.root / "deltas" / "step_00000004.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        assert metadata["sparse"] == "True"
        assert int(metadata["model_version"]) == 4
        assert 0.0 < float(metadata["sparsity"]) < 1.0
        for name in json.loads(metadata["changed_params"]):
            indices = f.get_tensor(f"{name}.indices")
            values = f.get_tensor(f"{name}.values")
            assert indices.dtype == torch.int32 and values.dtype == torch.bfloat16
            base[name].view(-1)[indices.long()] = values
    assert_bit_exact(run.states[4], base)


def rewrite(path, *, tensors=None, metadata=None, drop=None) -> None:
    with safe_open(str(path), "pt") as handle:
        old_metadata = handle.metadata()
    old_tensors = load_file(str(path))
    new_tensors = {**old_tensors, **(tensors or {})}
    for key in drop or ():
        new_tensors.pop(key)
    save_file(new_tensors, str(path), metadata={**old_metadata, **(metadata or {})})


@pytest.fixture
def delta_file(tmp_path, weights):
    changes = {
        "model.embed_tokens.weight": SparseChange(
            torch.tensor([3, 17, 100], dtype=torch.int32), torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
        )
    }
    path = tmp_path / "delta.safetensors"
    write_delta(path, changes, delta_header(weights, changes))
    return path


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            dict(tensors={"model.embed_tokens.weight.indices": torch.tensor([17, 3, 100], dtype=torch.int32)}),
            "ascending",
        ),
        (dict(tensors={"model.embed_tokens.weight.indices": torch.tensor([3, 17, 128], dtype=torch.int32)}), "outside"),
        (
            dict(tensors={"model.embed_tokens.weight.indices": torch.tensor([-1, 17, 100], dtype=torch.int32)}),
            "outside",
        ),
        (dict(tensors={"model.embed_tokens.weight.values": torch.tensor([1.0, -2.0, 0.5])}), "bfloat16"),
        (
            dict(tensors={"model.embed_tokens.weight.values": torch.tensor([1.0, -2.0], dtype=torch.bfloat16)}),
            "3 indices but 2 values",
        ),
        (
            dict(tensors={"model.embed_tokens.weight.values": torch.tensor([1.0, -2.0, 0.25], dtype=torch.bfloat16)}),
            "payload digest",
        ),
        (dict(tensors={"model.other.weight.values": torch.zeros(1, dtype=torch.bfloat16)}), "unexpected"),
        (dict(drop=["model.embed_tokens.weight.values"]), "missing"),
        (dict(metadata={"format_version": "99"}), "format_version"),
        (dict(metadata={"model_version": "two"}), "'model_version' is malformed"),
        (dict(metadata={"shapes": "{not json"}), "'shapes' is malformed"),
        (dict(metadata={"sparse": "False"}), "'sparse' is malformed"),
        (dict(metadata={"changed_params": '["x"]'}), "'changed_params' is malformed"),
        (dict(metadata={"encoding": "zstd-gaps"}), "encoding 'zstd-gaps' is not supported"),
        (dict(metadata={"changed_elements": "4"}), "changed_elements"),
    ],
)
def test_malformed_delta_is_refused_with_a_clear_error(delta_file, damage, message):
    rewrite(delta_file, **damage)
    with pytest.raises(FormatError, match=message) as info:
        read_file(delta_file)
    assert str(delta_file) in str(info.value)


def test_not_safetensors_and_foreign_safetensors_are_refused(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(FormatError, match="not a readable safetensors file"):
        read_file(junk)
    foreign = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(FormatError, match="not a delta-sync file"):
        read_file(foreign)


def test_anchor_closes_its_file_and_keeps_loaded_tensors(tmp_path, weights):
    path = tmp_path / "anchor.safetensors"
    write_anchor(path, weights, anchor_header(weights))
    with read_file(path) as anchor:
        anchor.verify()
        norm = anchor.tensor("model.norm.weight")
    with pytest.raises(ValueError, match="closed"):
        anchor.tensor("model.norm.weight")
    assert torch.equal(norm.view(torch.int16), weights["model.norm.weight"].view(torch.int16))
    with read_file(tmp_path / "anchor.safetensors") as anchor:
        pass
    anchor.close()  # idempotent


@pytest.mark.parametrize(
    "damage, message",
    [
        (dict(tensors={"model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}), "does not match its recorded"),
        (dict(metadata={"model_checksum": "0" * 16}), "model checksum does not match"),
        (dict(metadata={"payload_xxh3": "0" * 16}), "payload digest does not match"),
    ],
)
def test_anchor_verify_refuses_damaged_contents(tmp_path, weights, damage, message):
    from delta_sync.errors import IntegrityError

    path = tmp_path / "anchor.safetensors"
    write_anchor(path, weights, anchor_header(weights))
    rewrite(path, **damage)
    with read_file(path) as anchor:  # the structure is intact
        with pytest.raises(IntegrityError, match=message) as info:
            anchor.verify()
    assert str(path) in str(info.value)


@pytest.mark.parametrize("key", ["kind", "sparse", "shapes", "checksums", "model_version", "run_id", "payload_xxh3"])
def test_a_missing_metadata_field_is_named(tmp_path, weights, key):
    path = tmp_path / "anchor.safetensors"
    write_anchor(path, weights, anchor_header(weights))
    with safe_open(str(path), "pt") as handle:
        metadata = {k: v for k, v in handle.metadata().items() if k != key}
    save_file(load_file(str(path)), str(path), metadata=metadata)
    with pytest.raises(FormatError, match=f"metadata field '{key}' is missing"):
        read_file(path)
