"""Parameters that travel in float32 (those a model keeps in float32, such as MoE routers):
the file format names them, anchors and deltas carry their float32 bits in raw and compact
files, and a replica holds them in float32, bit for bit, or refuses with the tensor named."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from test_format import anchor_header, delta_header

from delta_sync import read_file
from delta_sync.errors import ApplyError, FormatError
from delta_sync.format import Anchor, CodedDelta, Delta, SparseChange, write_anchor, write_delta
from delta_sync.integrity import apply_checksums, tensor_checksum, updated_checksums
from delta_sync.replica.loaders import module_weight_loader
from delta_sync.replica.receiver import Receiver
from delta_sync.sparse import gather, scatter_many_

ROUTER = "model.layers.0.mlp.gate.weight"
BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def assert_same_bits(expected: dict[str, torch.Tensor], actual) -> None:
    assert sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(bits(actual[name]), bits(tensor)), f"{name} differs"


@pytest.fixture
def weights():
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8).bfloat16(),
        ROUTER: torch.randn(4, 8),  # off the bf16 grid: rounding would change most of it
        BIAS: torch.randn(4) * 1e-3,
    }


def changed(weights, seed: int) -> dict[str, SparseChange]:
    """A step's changes: some bf16 elements, and float32 ones that a bf16 rounding would hide."""
    generator = torch.Generator().manual_seed(seed)
    router = torch.tensor([0, 5, 31], dtype=torch.int32)
    return {
        "model.embed_tokens.weight": SparseChange(
            torch.tensor([1, 40, 127], dtype=torch.int32), torch.randn(3, generator=generator).bfloat16()
        ),
        ROUTER: SparseChange(router, weights[ROUTER].view(-1)[router.long()] * (1 + 2**-20)),
        BIAS: SparseChange(torch.tensor([2], dtype=torch.int32), torch.tensor([1e-3 + 2**-30])),
    }


def applied(weights, changes) -> dict[str, torch.Tensor]:
    after = {name: tensor.clone() for name, tensor in weights.items()}
    for name, change in changes.items():
        after[name].view(-1)[change.indices.long()] = change.values
    return after


def test_checksums_and_scatter_cover_float32_bits(weights):
    router, change = weights[ROUTER], changed(weights, 1)[ROUTER]
    rounded = router.to(torch.bfloat16)
    assert change.values.to(torch.bfloat16).equal(router.view(-1)[change.indices.long()].to(torch.bfloat16))
    old, (checksum,) = apply_checksums([(tensor_checksum(router), router, change.indices, change.values)])
    after = router.clone()
    scatter_many_([(after, change.indices, change.values)])
    assert checksum == tensor_checksum(after) != tensor_checksum(router)
    assert torch.equal(bits(old[0]), bits(router.view(-1)[change.indices.long()]))
    assert updated_checksums([(tensor_checksum(router), change.indices, old[0], change.values)]) == [checksum]
    assert torch.equal(bits(gather(after, change.indices)), bits(change.values))
    with pytest.raises(TypeError, match="bfloat16 values cannot be written bit for bit into a torch.float32"):
        scatter_many_([(after, change.indices, change.values.bfloat16())])
    with pytest.raises(TypeError):
        apply_checksums([(tensor_checksum(rounded), rounded, change.indices, change.values)])


def test_an_anchor_names_and_carries_its_float32_tensors(tmp_path, weights):
    path = tmp_path / "anchor.safetensors"
    header = write_anchor(path, weights, anchor_header(weights))
    assert header.dtypes == {ROUTER: torch.float32, BIAS: torch.float32}
    with safe_open(str(path), "pt") as handle:
        assert json.loads(handle.metadata()["dtypes"]) == {ROUTER: "F32", BIAS: "F32"}
        assert handle.get_slice(ROUTER).get_dtype() == "F32"
    with read_file(path) as anchor:
        assert isinstance(anchor, Anchor)
        anchor.verify()
        assert anchor.header.dtype(ROUTER) == torch.float32
        assert anchor.header.dtype("model.embed_tokens.weight") == torch.bfloat16
        assert_same_bits(weights, dict(anchor.items()))


@pytest.mark.parametrize("encoding", ["raw", "compact"])
def test_a_delta_carries_float32_values_unrounded(tmp_path, weights, encoding):
    changes = changed(weights, 2)
    path = tmp_path / "delta.safetensors"
    header = dataclasses.replace(delta_header(weights, changes), encoding=encoding)
    write_delta(path, changes, header, weights)
    with safe_open(str(path), "pt") as handle:
        keys = set(handle.keys())
        # Both encodings store a float32 parameter as raw entries, its values F32.
        assert {f"{ROUTER}.indices", f"{ROUTER}.values", f"{BIAS}.values"} <= keys
        assert handle.get_slice(f"{ROUTER}.values").get_dtype() == "F32"
        assert ("model.embed_tokens.weight.compact" in keys) == (encoding == "compact")
    file = read_file(path)
    assert isinstance(file, CodedDelta if encoding == "compact" else Delta)
    delta = file.decoded(weights)
    for name, change in changes.items():
        assert torch.equal(delta.changes[name].indices.long(), change.indices.long())
        assert delta.changes[name].values.dtype == change.values.dtype
        assert torch.equal(bits(delta.changes[name].values), bits(change.values)), name


def test_a_receiver_replays_float32_tensors_bit_for_bit(tmp_path, weights):
    states = publish_by_hand(tmp_path, weights, 3)
    receiver = Receiver()
    for version, state in enumerate(states, start=1):
        receiver.apply(read_file(tmp_path / f"{version}.safetensors"))
        assert receiver.version == version
        assert_same_bits(state, receiver.weights)


def publish_by_hand(root, weights, versions: int) -> list[dict[str, torch.Tensor]]:
    """An anchor and `versions - 1` deltas (raw, then compact) written to `root`; the states."""
    root.mkdir(parents=True, exist_ok=True)
    write_anchor(root / "1.safetensors", weights, anchor_header(weights))
    states = [weights]
    for version in range(2, versions + 1):
        state = states[-1]
        changes = changed(state, version)
        header = delta_header(state, changes, version)
        encoding = "raw" if version % 2 == 0 else "compact"
        header = dataclasses.replace(header, encoding=encoding, id=dataclasses.replace(header.id, version=version))
        write_delta(root / f"{version}.safetensors", changes, header, state)
        states.append(applied(state, changes))
    return states


def test_the_node_snapshot_holds_float32_tensors_and_rebuilds_them(tmp_path, weights):
    from delta_sync.replica.shared import NodeStore

    states = publish_by_hand(tmp_path / "bucket", weights, 3)
    shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    loaded: list[dict[str, torch.Tensor]] = [{}, {}]

    def worker(number: int) -> Receiver:
        def load(tensors):
            loaded[number].update((name, tensor.clone()) for name, tensor in tensors)

        return Receiver(store=NodeStore(tmp_path / "nodes"), expected_shapes=shapes, load_weights=load)

    ahead, behind = worker(0), worker(1)
    for version in (1, 2, 3):
        ahead.apply(read_file(tmp_path / "bucket" / f"{version}.safetensors"), bucket=tmp_path / "bucket")
        assert_same_bits(states[version - 1], loaded[0])
    assert_same_bits(states[2], ahead.weights)
    # The snapshot is at version 3: version 1 is rebuilt from the undo records, float32 ones included.
    behind.apply(read_file(tmp_path / "bucket" / "1.safetensors"), bucket=tmp_path / "bucket")
    assert_same_bits(states[0], loaded[1])
    (directory,) = [d for d in (tmp_path / "nodes").iterdir() if d.is_dir()]
    assert json.loads((directory / "state.json").read_text())["float32"] == [BIAS, ROUTER]
    assert len(list(directory.glob("float32-*.bin"))) == 1


def test_a_replica_holding_bf16_where_the_bucket_carries_float32_is_refused(tmp_path, weights):
    rounded = {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}
    receiver = Receiver()
    write_anchor(tmp_path / "a.safetensors", rounded, anchor_header(rounded))
    receiver.apply(read_file(tmp_path / "a.safetensors"))
    changes = changed(weights, 2)
    header = dataclasses.replace(
        delta_header(weights, changes), base_checksums={n: tensor_checksum(rounded[n]) for n in changes}
    )
    write_delta(tmp_path / "d.safetensors", changes, header)
    with pytest.raises(ApplyError, match="gate.* travels as torch.float32, but is held as torch.bfloat16"):
        receiver.apply(read_file(tmp_path / "d.safetensors"))
    assert receiver.version == 1
    assert_same_bits(rounded, receiver.weights)


def test_a_module_holding_bf16_where_the_bucket_carries_float32_is_refused(tmp_path, weights):
    module = torch.nn.Module()
    module.register_parameter("w", torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16)))
    load = module_weight_loader(module)
    with pytest.raises(ApplyError, match="'w' travels as torch.float32.*holds it as torch.bfloat16"):
        load([("w", weights[ROUTER])])
    assert not module.w.any()
    wide = torch.nn.Module()
    wide.register_parameter("w", torch.nn.Parameter(torch.zeros(4, 8)))
    module_weight_loader(wide)([("w", weights[ROUTER])])
    assert torch.equal(bits(wide.w.detach()), bits(weights[ROUTER]))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("dtypes"), f"tensor '{BIAS}' is F32, expected BF16 \\(metadata 'dtypes' does not name it\\)"),
        (lambda m: m.update(dtypes=json.dumps({ROUTER: "F16"})), "metadata field 'dtypes' is malformed"),
        (lambda m: m.update(dtypes=json.dumps({ROUTER: "BF16"})), "metadata field 'dtypes' is malformed"),
        (lambda m: m.update(dtypes=json.dumps({"nope": "F32"})), "'dtypes' is malformed: names 'nope'"),
        (lambda m: m.update(dtypes="[]"), "metadata field 'dtypes' is malformed"),
    ],
)
def test_a_dtypes_field_that_does_not_match_the_tensors_is_refused(tmp_path, weights, edit, message):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "anchor.safetensors"
    write_anchor(path, weights, anchor_header(weights))
    with safe_open(str(path), "pt") as handle:
        metadata = dict(handle.metadata())
    edit(metadata)
    save_file(load_file(str(path)), str(path), metadata=metadata)
    with pytest.raises(FormatError, match=message):
        read_file(path)


def test_values_of_another_dtype_than_the_header_names_are_refused(tmp_path, weights):
    from safetensors.torch import load_file, save_file

    changes = changed(weights, 2)
    path = tmp_path / "delta.safetensors"
    write_delta(path, changes, delta_header(weights, changes))
    with safe_open(str(path), "pt") as handle:
        metadata = dict(handle.metadata())
    tensors = load_file(str(path))
    tensors[f"{ROUTER}.values"] = tensors[f"{ROUTER}.values"].bfloat16()
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(FormatError, match=f"{ROUTER}.values must be 1-D float32, got 1-D torch.bfloat16"):
        read_file(path)


# -- the trainer side: what a model keeps in float32 is published in float32 ------------------


def loaded_as_users_load_it(family: str, directory, seed: int = 0):
    """A tiny `family` model written by `save_pretrained` and loaded back in bf16, as a
    trainer loads one: transformers keeps its routers in float32."""
    import transformers
    from test_checkpoint_layout import FAMILIES, deepseek_v3_config

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(deepseek_v3_config()) if family == "deepseek_v3" else FAMILIES[family]()
    model.save_pretrained(directory)
    return type(model).from_pretrained(directory, dtype=torch.bfloat16)


def checkpoint_bits(expected: dict[str, torch.Tensor], actual) -> None:
    """The same tensors in the same dtypes, bit for bit: float32 ones are not rounded."""
    assert_same_bits(expected, {name: actual[name] for name in actual})


@pytest.mark.parametrize("encoding", ["raw", "compact"])
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_routers_a_model_keeps_in_float32_are_published_in_float32(family, encoding, tmp_path):
    from safetensors.torch import load_file
    from test_checkpoint_layout import _train

    from delta_sync import BF16ChangeDetector, Publisher, expected_shapes_of, verify_bucket
    from delta_sync.checkpoint import persistent_buffers

    model = loaded_as_users_load_it(family, tmp_path / "base")
    kept = {name for name, tensor in {**dict(model.named_parameters()), **persistent_buffers(model)}.items()
            if tensor.dtype == torch.float32}  # fmt: skip
    routers = {name for name in kept if name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))}
    assert routers and kept == routers, kept
    # Off the bf16 grid, as auxiliary-loss-free balancing leaves a router bias.
    for name in routers:
        if name.endswith("bias"):
            model.get_buffer(name).copy_(torch.randn(model.get_buffer(name).shape) * 1e-3 + 2**-20)
    # Steps below most bf16 elements' rounding step, as fine-tuning takes them: deltas, not anchors.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    detector = BF16ChangeDetector(model, optimizer)
    assert detector.float32 == routers
    bucket = tmp_path / "bucket"
    publisher = Publisher(
        bucket, detector, anchor_every=3, anchor_bytes_ratio=None, background=False, encoding=encoding
    )
    replica = loaded_as_users_load_it(family, tmp_path / "replica-base", seed=1)
    follower = Receiver(load_weights=module_weight_loader(replica), expected_shapes=expected_shapes_of(replica))
    for version in range(1, 6):  # anchors at 1 and 4
        _train(model, optimizer, steps=1, seed=version)
        publisher.publish(version)
        assert follower.update(bucket).version == version
    delta = read_file(bucket / next(report.delta for report in reversed(publisher.reports) if report.delta))
    # The routers' AdamW updates are mostly below a bf16 step: only float32 bits see them.
    router = next(name for name in routers if name.endswith("weight"))
    assert router in delta.header.shapes and delta.header.dtype(router) == torch.float32
    publisher.close()
    detector.close()
    model.save_pretrained(tmp_path / "saved")
    expected = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert {name for name, tensor in expected.items() if tensor.dtype == torch.float32} == routers
    checkpoint_bits(expected, follower.weights)
    for name in routers:
        held = replica.get_parameter(name) if name.endswith("weight") else replica.get_buffer(name)
        assert torch.equal(bits(held.detach()), bits(expected[name])), name
    assert verify_bucket(bucket).ok
