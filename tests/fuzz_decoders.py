"""Property-based fuzzing of every decoder a replica runs on bytes read from a bucket.

Anyone with write access to a bucket can put any bytes there, so each decoder must either
read its input or refuse it with a `DeltaSyncError` that names the file; any other
exception is a failure, and so is a crash of the process. The targets, each fed mutations
of real, valid inputs (bit flips, truncations, edited header fields, appended, inserted and
spliced bytes) and random bytes:

- compact streams of versions 3, 4 and 5, decoded against held weights (the right ones and
  others, whose exponent groups differ): a stream that decodes must give strictly
  ascending in-range positions, one value each, and a damaged stream must not change what
  the other stream of the same call decodes to;
- whole anchor and delta files (raw and compact) as safetensors: a damaged length prefix,
  header JSON, dtypes, shapes, offsets and metadata; and files sealed again with a valid
  payload digest around damaged tensors, so that the damage reaches the decoders behind it;
- versions in parts (a manifest and its raw or compact part files): the manifest or one part
  damaged, parts swapped or missing;
- manifests, `latest.json` pointers (with and without a verify key), signature files,
  the replica's on-disk record of accepted pointers, and PEFT adapter files.

Compiled code that writes out of bounds can kill the process instead of raising, so
`tests/test_fuzz_decoders.py` runs this module in a child process. It runs on its own too:

    python tests/fuzz_decoders.py                              # the CI budget
    DELTA_SYNC_FUZZ_SCALE=20 python tests/fuzz_decoders.py     # 20 times the examples
    DELTA_SYNC_FUZZ_SEED=7 python tests/fuzz_decoders.py       # other examples than CI's

With `DELTA_SYNC_FUZZ_KEEP=DIR`, each input is written to `DIR/<target>.bin` before it is
decoded: after a crash, that file is the last input decoded. Inputs that once failed are kept
under `tests/fuzz_cases/<target>/` and replayed first on every run.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import rans_reference
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from delta_sync.compact import decode_changes, encode_changes
from delta_sync.errors import DeltaSyncError
from delta_sync.format import Anchor, Delta, SparseChange, read_file
from delta_sync.integrity import payload_digest
from delta_sync.layout import LATEST, Latest, anchor_path, delta_path, part_path
from delta_sync.manifest import Manifest, PartRecord, read_version
from delta_sync.replica.adapter import _check_adapter_files
from delta_sync.replica.pointer import PointerLedger
from delta_sync.signing import SIGNATURE_SUFFIX, FileSignature, SigningKey, file_sha256
from delta_sync.version import VersionId

from two_tower import TwoTower, bf16_state, train_step

CASES = Path(__file__).with_name("fuzz_cases")
SCALE = float(os.environ.get("DELTA_SYNC_FUZZ_SCALE", "1"))
SEED = os.environ.get("DELTA_SYNC_FUZZ_SEED")
KEEP = os.environ.get("DELTA_SYNC_FUZZ_KEEP")
BUCKET = "fuzz-bucket"
SOURCE = "deltas/step_00000002.safetensors"


def fuzz(examples: int) -> Callable:
    """Hypothesis settings for one target: `examples` cases (times the scale), reproducible."""

    def configure(test: Callable) -> Callable:
        configured = settings(
            max_examples=max(1, int(examples * SCALE)),
            deadline=None,
            derandomize=SEED is None,
            database=None,
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
        )(test)
        return configured if SEED is None else seed(int(SEED))(configured)

    return configure


def keep(target: str, data: bytes) -> None:
    if KEEP:
        Path(KEEP, f"{target}.bin").write_bytes(data)


@functools.cache
def scratch() -> Path:
    directory = tempfile.TemporaryDirectory(prefix="delta-sync-fuzz-")
    scratch.directory = directory  # kept alive (and removed at exit) with the function
    return Path(directory.name)


def refused(exc: DeltaSyncError, *names: str, every: bool = True) -> None:
    """A refusal must name what it refuses: each of `names`, or one of them."""
    named = [name in str(exc) for name in names]
    assert all(named) if every else any(named), f"{type(exc).__name__} does not name {names}: {exc}"


# -- regression cases: inputs that once failed, replayed first ------------------------------


def test_every_case_directory_is_a_target():
    assert {path.name for path in CASES.iterdir()} <= set(CHECKS)


@pytest.mark.parametrize("case", sorted(CASES.glob("*/*.bin")), ids=lambda path: f"{path.parent.name}/{path.name}")
def test_regression_case(case):
    CHECKS[case.parent.name](case.read_bytes())


# -- byte and JSON mutations -----------------------------------------------------------------


EDITS = ("flip", "set", "truncate", "delete", "insert", "append", "splice", "repeat")


@st.composite
def mutated(draw, data: bytes, others: Sequence[bytes] = (), header: int = 64, edits: Sequence[str] = EDITS) -> bytes:
    """`data` with one to four byte-level `edits`, half of their positions in its first `header` bytes."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        edit = draw(st.sampled_from(edits))
        if not out or edit == "append":
            out += draw(st.binary(min_size=1, max_size=16))
            continue
        limit = min(header, len(out)) if draw(st.booleans()) else len(out)
        at = draw(st.integers(0, limit - 1))
        if edit == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "set":
            out[at] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]) | st.integers(0, 255))
        elif edit == "truncate":
            del out[at:]
        elif edit == "delete":
            del out[at : at + draw(st.integers(1, 8))]
        elif edit == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif edit == "repeat":
            out[at:at] = out[at : at + draw(st.integers(1, 16))]
        elif others:  # splice: the head of this input, the tail of another
            other = draw(st.sampled_from(others))
            out = out[:at] + other[draw(st.integers(0, len(other))) :]
    return bytes(out)


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 10**30, 1.5, -0.0, float("inf"), float("nan"), "", "0"])
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
)


def _slots(document) -> list[tuple]:
    """Every `(container, key)` in a JSON document."""
    slots = []
    if isinstance(document, dict):
        for key, value in document.items():
            slots.append((document, key))
            slots.extend(_slots(value))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            slots.append((document, index))
            slots.extend(_slots(value))
    return slots


@st.composite
def edited_json(draw, document) -> bytes:
    """`document` with one to three values replaced, removed or added, as JSON text."""
    document = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(document)
        if not slots:
            document = draw(JSON_VALUES)
            continue
        container, key = draw(st.sampled_from(slots))
        edit = draw(st.sampled_from(["replace", "remove", "add", "wrap"]))
        if edit == "replace":
            container[key] = draw(JSON_VALUES)
        elif edit == "remove":
            del container[key]
        elif edit == "wrap":
            container[key] = [container[key]] if draw(st.booleans()) else {"": container[key]}
        elif isinstance(container, dict):
            container[draw(st.text(max_size=12))] = draw(JSON_VALUES)
        else:
            container.append(draw(JSON_VALUES))
    return json.dumps(document, indent=draw(st.sampled_from([None, 1]))).encode()


HOSTILE_TEXT = st.sampled_from(
    [b"", b"null", b"[]", b"{}", b'"x"', b"[" * 5000, b'{"a":' * 5000, b"1e999", b"\xff\xfe", b"\x00" * 64]
)


def json_inputs(document) -> st.SearchStrategy[bytes]:
    text = json.dumps(document).encode()
    return edited_json(document) | mutated(text, header=len(text)) | HOSTILE_TEXT | st.binary(max_size=256)


# -- compact streams -----------------------------------------------------------------------


def _weights(rng: np.random.Generator, numel: int) -> torch.Tensor:
    """bf16 weights with a spread of exponents (several exponent groups), some of them zero."""
    values = rng.normal(0, 0.02, numel) * np.exp(rng.normal(0, 2, numel))
    values[rng.random(numel) < 0.02] = 0
    return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)


def _change(rng: np.random.Generator, held: torch.Tensor, density: float) -> SparseChange:
    """Adam-like steps of about `density` of the elements (those whose bits really change)."""
    flat = held.reshape(-1)
    chosen = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < density))
    step = torch.from_numpy(rng.normal(0, 0.05, chosen.numel()).astype(np.float32))
    new = (flat[chosen].float() * (1 + step) + 1e-4 * torch.sign(step)).to(torch.bfloat16)
    moved = new.view(torch.int16) != flat[chosen].view(torch.int16)
    return SparseChange(indices=chosen[moved].to(torch.int32), values=new[moved])


def _reference_stream(held: torch.Tensor, change: SparseChange, boundaries: list[int], version: int) -> bytes:
    """A stream of an older version, made by the reference coder of the tests."""
    prev_bits = held.reshape(-1).view(torch.int16).numpy()
    indices = change.indices.long().numpy()
    return rans_reference.encode_stream(
        prev_bits, indices, change.values.view(torch.int16).numpy(), boundaries, version
    )


SHAPE = (64, 64)


class CompactInputs:
    """Held weights, their variants, and valid streams against them (versions 3, 4, 5)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(39)
        held = _weights(rng, SHAPE[0] * SHAPE[1]).reshape(SHAPE)
        # Others: the same elements in another order (same group sizes, other ranks); 64 of
        # them moved to a high exponent (other group sizes); all zero (one group).
        flat = held.reshape(-1)
        moved = flat.view(torch.int16).clone()
        moved[rng.choice(moved.numel(), 64, replace=False)] = 0x4000
        shuffled = flat[torch.from_numpy(rng.permutation(flat.numel()))]
        self.helds = [held, shuffled.reshape(SHAPE), moved.view(torch.bfloat16).reshape(SHAPE)]
        self.helds.append(torch.zeros(SHAPE, dtype=torch.bfloat16))
        streams, changes = {}, {}
        for name, density in (("many", 0.4), ("few", 0.01), ("most", 0.9), ("none", 0.0)):
            changes[name] = _change(rng, held, density)
            streams[name] = encode_changes({"w": changes[name]}, {"w": held})["w.compact"].numpy().tobytes()
        change = _change(rng, held, 0.05)
        for version in (3, 4):
            streams[f"v{version}"] = _reference_stream(held, change, [110, 118, 122], version)
        streams["v4 one group"] = _reference_stream(held, change, [], 4)
        # Most elements of each group changed: the groups code their unchanged members.
        streams["v3 most"] = _reference_stream(held, changes["most"], [114, 116, 118], 3)
        assert {stream[0] for stream in streams.values()} == {3, 4, 5}
        assert max(stream[1] for stream in streams.values()) > 2  # several exponent groups
        self.streams = streams
        # The other stream of every call: it must decode to its change whatever the damaged one holds.
        self.neighbour_held = _weights(rng, 3000)
        self.neighbour = _change(rng, self.neighbour_held, 0.3)
        self.neighbour_stream = encode_changes({"a": self.neighbour}, {"a": self.neighbour_held})["a.compact"]


@functools.cache
def compact_inputs() -> CompactInputs:
    return CompactInputs()


def header_fields(stream: bytes) -> list[tuple[int, int, str]]:
    """`(start, end, kind)` of each field of a valid stream's header: kind "byte" or "varint"."""
    reader = rans_reference.Reader(stream)
    fields = []

    def take(kind: str) -> int:
        start = reader.at
        value = reader.byte() if kind == "byte" else reader.varint()
        fields.append((start, reader.at, kind))
        return value

    version, groups = take("byte"), take("byte")
    for _ in range(groups - 1):
        take("byte")
    if version >= 4:
        for _ in range(groups - 1):
            take("varint")
    for _ in range(groups):
        if take("varint"):
            for _ in range(take("byte") + 1):
                take("byte")
    take("varint")
    return fields


VARINTS = st.sampled_from([0, 1, 2, 3, 64, 127, 128, 4095, 4096, 4097, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1])
BYTES = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 8, 9, 27, 28, 29, 127, 128, 254, 255]) | st.integers(0, 255)


@st.composite
def header_edit(draw, stream: bytes) -> bytes:
    """`stream` with one header field (version, groups, boundaries, group sizes, change
    counts, value tables, word count) set to another value, or a varint made overlong."""
    start, end, kind = draw(st.sampled_from(header_fields(stream)))
    if kind == "byte":
        value = bytes([draw(BYTES)])
    elif draw(st.integers(0, 5)) == 0:
        value = b"\xff" * draw(st.integers(1, 11)) + draw(st.sampled_from([b"", b"\x00", b"\x01"]))
    else:
        value = rans_reference.varint(draw(VARINTS | st.integers(0, 2**64)))
    return stream[:start] + value + stream[end:]


@st.composite
def compact_cases(draw) -> tuple[bytes, int]:
    """A damaged stream, and which of the held tensors to decode it against."""
    inputs = compact_inputs()
    stream = inputs.streams[draw(st.sampled_from(sorted(inputs.streams)))]
    others = list(inputs.streams.values())
    how = draw(st.sampled_from(["header"] * 3 + ["same length"] * 3 + ["bytes"] * 2 + ["both", "random"]))
    if how in ("header", "both"):
        stream = draw(header_edit(stream))
    if how == "same length":  # the word count still matches: the damage reaches the coder
        stream = draw(mutated(stream, header=len(stream) // 8, edits=("flip", "set")))
    if how in ("bytes", "both"):
        stream = draw(mutated(stream, others))
    if how == "random":
        stream = draw(st.sampled_from([b"", b"\x03", b"\x04", b"\x05"])) + draw(st.binary(max_size=200))
    return stream, draw(st.sampled_from([0, 0, 1, 2, 3]))


def check_compact_stream(stream: bytes, held: int = 0) -> None:
    """Decode `stream` as tensor `w` (held as `helds[held]`), next to a valid stream for `a`."""
    keep("compact_stream", stream)
    inputs = compact_inputs()
    entries = {
        "a.compact": inputs.neighbour_stream,
        "w.compact": torch.from_numpy(np.frombuffer(stream, np.uint8).copy()),
    }
    previous = {"a": inputs.neighbour_held, "w": inputs.helds[held]}
    shapes = {"a": tuple(inputs.neighbour_held.shape), "w": SHAPE}
    try:
        decoded = decode_changes(entries, previous, shapes, source=SOURCE)
    except DeltaSyncError as exc:
        refused(exc, SOURCE, "w.compact")
        return
    neighbour = decoded["a"]
    assert torch.equal(neighbour.indices.long(), inputs.neighbour.indices.long()), "a damaged stream changed another"
    assert torch.equal(neighbour.values.view(torch.int16), inputs.neighbour.values.view(torch.int16))
    check_well_formed(decoded["w"], SHAPE[0] * SHAPE[1])


def replay_compact_stream(data: bytes) -> None:
    # A write out of bounds need not crash at once: it may corrupt memory that later use trips on.
    for _ in range(50):
        for held in range(len(compact_inputs().helds)):
            check_compact_stream(data, held)


def check_decoded(delta: Delta) -> None:
    for name, change in delta.changes.items():
        check_well_formed(change, math.prod(delta.header.shapes[name]))


def check_well_formed(change: SparseChange, numel: int) -> None:
    indices = change.indices.long()
    assert change.indices.dim() == 1 and change.values.dim() == 1
    assert change.values.dtype == torch.bfloat16
    assert indices.numel() == change.values.numel() <= numel
    if indices.numel():
        assert 0 <= int(indices[0]) and int(indices[-1]) < numel, "positions out of range"
        assert bool((indices[1:] > indices[:-1]).all()), "positions not strictly ascending"


@given(compact_cases())
@fuzz(5000)
def test_compact_stream(case):
    check_compact_stream(*case)


# -- a published run: anchor, raw and compact deltas, pointer, signatures -------------------


class Bucket:
    """Anchor v1 and delta v2 of a short run, published raw and compact with a signing key."""

    def __init__(self, root: Path) -> None:
        from delta_sync import BF16ChangeDetector, Publisher

        self.key = SigningKey.generate()
        self.files: dict[str, bytes] = {}
        for encoding in ("raw", "compact"):
            torch.manual_seed(0)
            model = TwoTower()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            detector = BF16ChangeDetector(model, optimizer)
            publisher = Publisher(
                root / encoding,
                detector,
                anchor_every=10,
                anchor_bytes_ratio=None,
                background=False,
                encoding=encoding,
                signing_key=self.key,
                bucket_id=BUCKET,
                pointer_refresh=None,
            )
            for version in (1, 2):
                train_step(model, optimizer, seed=version)
                publisher.publish(version)
                if version == 1:
                    self.base = bf16_state(model)
            publisher.close()
            detector.close()
            self.files[f"{encoding} delta"] = (root / encoding / delta_path(2)).read_bytes()
        self.files["anchor"] = (root / "raw" / anchor_path(1)).read_bytes()
        self.latest = (root / "compact" / LATEST).read_bytes()
        self.signature = (root / "compact" / (delta_path(2) + SIGNATURE_SUFFIX)).read_bytes()
        self.signed_sha256 = file_sha256(root / "compact" / delta_path(2))


@functools.cache
def bucket() -> Bucket:
    return Bucket(scratch() / "bucket")


# -- whole files ---------------------------------------------------------------------------


def _split(data: bytes) -> tuple[dict, bytes]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _join(header: bytes, body: bytes) -> bytes:
    """A safetensors file of a header (JSON text) and a body, the length prefix made to fit."""
    return len(header).to_bytes(8, "little") + header + body


DTYPES = ["BF16", "F16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "U64", "BOOL", "F8_E4M3", "bf16", "", "X"]
SIZES = st.sampled_from([0, 1, 2, 7, 8, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -1]) | st.integers(0, 5000)


@st.composite
def damaged_safetensors(draw, data: bytes) -> bytes:
    """`data` with its header's length prefix, JSON, dtypes, shapes, offsets or metadata damaged."""
    header, body = _split(data)
    edit = draw(st.sampled_from(["length", "dtype", "shape", "offsets", "entry", "metadata", "json"]))
    if edit == "length":
        length = draw(SIZES | st.sampled_from([len(data) - 8, len(data) - 7, len(body)]))
        return (length % 2**64).to_bytes(8, "little") + data[8:]
    if edit == "json":
        return _join(draw(edited_json(header)), body)
    names = sorted(name for name in header if name != "__metadata__")
    name = draw(st.sampled_from(names))
    entry = header[name]
    if edit == "dtype":
        entry["dtype"] = draw(st.sampled_from(DTYPES) | JSON_VALUES)
    elif edit == "shape":
        shape = list(entry["shape"])
        if shape and draw(st.booleans()):
            shape[draw(st.integers(0, len(shape) - 1))] = draw(SIZES)
        else:
            shape = draw(st.lists(SIZES, max_size=4))
        entry["shape"] = shape
    elif edit == "offsets":
        begin, end = entry["data_offsets"]
        choices = st.sampled_from([0, begin, end, begin + 1, end - 1, len(body), len(body) + 1]) | SIZES
        entry["data_offsets"] = [draw(choices), draw(choices)] if draw(st.booleans()) else draw(JSON_VALUES)
    elif edit == "entry":
        other = draw(st.sampled_from(names))
        header[name] = copy.deepcopy(header[other]) if draw(st.booleans()) else draw(JSON_VALUES)
    else:
        metadata = header.setdefault("__metadata__", {})
        key = draw(st.sampled_from(sorted(metadata) or ["format"]) | st.text(max_size=8))
        metadata[key] = draw(st.text(max_size=24) | JSON_VALUES)
    return _join(json.dumps(header).encode(), body)


def resealed(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A file of `tensors` whose payload digest is right, so that readers look past it."""
    return save_safetensors(tensors, metadata={**metadata, "payload_xxh3": payload_digest(tensors.items())})


def _metadata(data: bytes) -> dict[str, str]:
    return _split(data)[0]["__metadata__"]


@st.composite
def resealed_delta(draw, data: bytes) -> bytes:
    """A delta with one tensor damaged (or its dtype or shape changed), sealed again."""
    tensors = load_safetensors(data)
    name = draw(st.sampled_from(sorted(tensors)))
    tensor = tensors[name]
    if tensor.dtype == torch.uint8:  # a compact stream
        damaged = draw(header_edit(tensor.numpy().tobytes()) | mutated(tensor.numpy().tobytes()))
        tensor = torch.from_numpy(np.frombuffer(damaged, np.uint8).copy())
    else:
        edit = draw(st.sampled_from(["element", "swap", "truncate", "dtype", "shape"]))
        tensor = tensor.clone()
        if edit in ("element", "swap") and tensor.numel():
            at = draw(st.integers(0, tensor.numel() - 1))
            flat = tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else tensor.dtype).reshape(-1)
            if edit == "element":
                flat[at] = draw(st.sampled_from([0, -1, 1, 2**15 - 1, -(2**15)]) | st.integers(-(2**15), 2**15 - 1))
            else:
                other = draw(st.integers(0, tensor.numel() - 1))
                flat[at], flat[other] = flat[other].clone(), flat[at].clone()
        elif edit == "truncate":
            tensor = tensor[: draw(st.integers(0, tensor.numel()))].clone()
        elif edit == "dtype":
            tensor = tensor.to(draw(st.sampled_from([torch.int64, torch.int16, torch.float32, torch.uint8])))
        elif tensor.numel() % 2 == 0:
            tensor = tensor.reshape(2, -1).clone()
    tensors[name] = tensor
    metadata = _metadata(data)
    if draw(st.integers(0, 3)) == 0:  # a metadata field too, past the digest
        metadata[draw(st.sampled_from(sorted(metadata)))] = draw(st.text(max_size=16) | JSON_VALUES.map(json.dumps))
    return resealed(tensors, metadata)


@st.composite
def version_files(draw) -> bytes:
    files = bucket().files
    data = files[draw(st.sampled_from(sorted(files)))]
    how = draw(st.sampled_from(["header"] * 3 + ["bytes"] * 2 + ["resealed"] * 4 + ["random"]))
    if how == "header" or (how == "resealed" and _metadata(data)["kind"] != "delta"):
        return draw(damaged_safetensors(data))
    if how == "bytes":
        return draw(mutated(data, list(files.values()), header=_header_length(data)))
    if how == "resealed":
        return draw(resealed_delta(data))
    return draw(st.binary(max_size=64))


def _header_length(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def check_version_file(data: bytes) -> None:
    """Read an anchor or delta as the replica does; an anchor is verified, a delta decoded."""
    keep("version_file", data)
    path = scratch() / "file.safetensors"
    path.write_bytes(data)
    try:
        with read_file(path, source=SOURCE) as file:
            if isinstance(file, Anchor):
                file.verify()
                for _ in file.items():
                    pass
                return
            delta = file.decoded(bucket().base)
    except DeltaSyncError as exc:
        refused(exc, SOURCE)
        return
    check_decoded(delta)


@given(version_files())
@fuzz(1000)
def test_version_file(data):
    check_version_file(data)


# -- versions in parts: a manifest and its part files ------------------------------------------

MANIFEST_SOURCE = "deltas/step_00000002.manifest.json"


@functools.cache
def parted_inputs() -> list[tuple[bytes, tuple[bytes, ...]]]:
    """Compact deltas in parts (row and flat-range blocks) and a raw one: manifest and part files."""
    from test_compact_parts import LAYOUTS, weights_before_and_after, write_parts

    before, after = weights_before_and_after()
    versions = []
    for encoding, layout in (
        ("compact", "columns (non-contiguous blocks)"),
        ("compact", "zero3 flat ranges, one empty"),
        ("raw", "fsdp2 rows"),
    ):
        directory = scratch() / "parted" / f"{encoding} {layout}"
        directory.mkdir(parents=True)
        manifest, parts = write_parts(directory, before, after, LAYOUTS[layout], encoding=encoding)
        versions.append((manifest.to_json(), tuple(path.read_bytes() for _, path in parts)))
    return versions


@st.composite
def parted_versions(draw) -> tuple[bytes, tuple[bytes, ...]]:
    """A version in parts with its manifest damaged, or one part, or its parts swapped or dropped."""
    manifest, parts = draw(st.sampled_from(parted_inputs()))
    parts = list(parts)
    what = draw(st.sampled_from(["manifest", "part", "part", "order"]))
    if what == "manifest":
        manifest = draw(json_inputs(json.loads(manifest)))
    elif what == "part":
        at = draw(st.integers(0, len(parts) - 1))
        if draw(st.booleans()):  # sealed again, and recorded so by the manifest: the damage reaches the decoder
            parts[at] = draw(resealed_delta(parts[at]))
            document = json.loads(manifest)
            document["parts"][at]["payload_xxh3"] = _metadata(parts[at]).get("payload_xxh3")
            manifest = json.dumps(document).encode()
        else:
            parts[at] = draw(damaged_safetensors(parts[at]) | mutated(parts[at]))
    elif draw(st.booleans()):
        parts.reverse()
    else:
        del parts[draw(st.integers(0, len(parts) - 1))]
    return manifest, tuple(parts)


def check_parted_version(manifest: bytes, parts: tuple[bytes, ...]) -> None:
    """Read a manifest and its parts as the replica does, and decode the version they make."""
    from test_compact_parts import NAME, weights_before_and_after

    keep("parted_version", json.dumps({"manifest": manifest.hex(), "parts": [part.hex() for part in parts]}).encode())
    directory = scratch() / "parts"
    directory.mkdir(exist_ok=True)
    names = [MANIFEST_SOURCE]
    try:
        version = Manifest.from_json(manifest, source=MANIFEST_SOURCE)
        pairs = []
        for record, data in zip(version.parts, parts):
            names.append(record.path)
            pairs.append((record, directory / f"part_{len(pairs)}.safetensors"))
            pairs[-1][1].write_bytes(data)
        with read_version(version, pairs, source=MANIFEST_SOURCE) as read:
            delta = read.decoded({NAME: weights_before_and_after()[0]})
    except DeltaSyncError as exc:
        refused(exc, *names, every=False)
        return
    check_decoded(delta)


@given(parted_versions())
@fuzz(600)
def test_parted_version(case):
    check_parted_version(*case)


def replay_parted_version(data: bytes) -> None:
    case = json.loads(data)
    check_parted_version(bytes.fromhex(case["manifest"]), tuple(bytes.fromhex(part) for part in case["parts"]))


# -- manifests, pointers, signatures ---------------------------------------------------------


def _manifest(kind: str) -> Manifest:
    delta = kind == "delta"
    return Manifest(
        kind=kind,
        id=VersionId(version=2, anchor_version=1 if delta else 2, run_id="run", epoch="e1"),
        base_version=1 if delta else None,
        encoding="compact" if delta else "dense",
        world_size=2,
        parts=(
            PartRecord(part_path(kind, 2, 0), rank=0, bytes=1000, payload_xxh3="0" * 16, sha256="ab" * 32),
            PartRecord(part_path(kind, 2, 1), rank=1, bytes=900, payload_xxh3="1" * 16),
        ),
        shapes={"w": (4, 8), "b": (8,)},
        checksums={"w": 1, "b": 2},
        base_checksums={"w": 3, "b": 4} if delta else {},
        model_checksum="f" * 16,
        changed_elements=5 if delta else 40,
        total_elements=40,
    )


def check_manifest(data: bytes) -> None:
    keep("manifest", data)
    try:
        Manifest.from_json(data, source=MANIFEST_SOURCE)
    except DeltaSyncError as exc:
        refused(exc, MANIFEST_SOURCE)


@given(st.sampled_from(["delta", "anchor"]).flatmap(lambda kind: json_inputs(json.loads(_manifest(kind).to_json()))))
@fuzz(1000)
def test_manifest(data):
    check_manifest(data)


def check_latest(data: bytes) -> None:
    """Parse a pointer unsigned and with the run's key; a pointer taken goes to a ledger."""
    keep("latest", data)
    for verify_key in (None, bucket().key.verify_key):
        try:
            latest = Latest.from_json(data, source=LATEST, verify_key=verify_key, bucket=BUCKET)
        except DeltaSyncError as exc:
            refused(exc, LATEST)
            continue
        latest.digest()
        latest.age()
        PointerLedger(None).accept(BUCKET, latest)


@given(st.deferred(lambda: json_inputs(json.loads(bucket().latest))))
@fuzz(1000)
def test_latest(data):
    check_latest(data)


def check_signature(data: bytes) -> None:
    keep("signature", data)
    source = SOURCE + SIGNATURE_SUFFIX
    try:
        signature = FileSignature.from_json(data, source=source)
        bucket().key.verify_key.verify(signature, path=SOURCE, bucket=BUCKET)
        signature.check_digest(bucket().signed_sha256)
    except DeltaSyncError as exc:
        refused(exc, SOURCE)


@given(st.deferred(lambda: json_inputs(json.loads(bucket().signature))))
@fuzz(600)
def test_signature(data):
    check_signature(data)


def check_pointer_record(data: bytes) -> None:
    """The replica's record of the newest pointer it accepted, damaged on its disk."""
    keep("pointer_record", data)
    root = scratch() / "ledger"
    latest = Latest.from_json(bucket().latest)
    PointerLedger(root).accept(BUCKET, latest)  # writes a valid record first
    (record,) = (root / "pointers").glob("*.json")
    record.write_bytes(data)
    try:
        PointerLedger(root).accept(BUCKET, latest)
        PointerLedger(root).newest(BUCKET)
    except DeltaSyncError as exc:
        refused(exc, record.name, LATEST, every=False)
    finally:
        record.unlink()


@st.composite
def pointer_records(draw) -> bytes:
    root = scratch() / "ledger-seed"
    ledger = PointerLedger(root)
    ledger.accept(BUCKET, Latest.from_json(bucket().latest))
    (record,) = (root / "pointers").glob("*.json")
    return draw(json_inputs(json.loads(record.read_bytes())))


@given(pointer_records())
@fuzz(300)
def test_pointer_record(data):
    check_pointer_record(data)


# -- PEFT adapter files ----------------------------------------------------------------------

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


@functools.cache
def adapter_weights() -> bytes:
    generator = torch.Generator().manual_seed(0)
    return save_safetensors(
        {
            "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 16, generator=generator),
            "base_model.model.layers.0.q_proj.lora_B.weight": torch.zeros(16, 4),
        }
    )


def check_adapter(config: bytes, weights: bytes) -> None:
    local = scratch() / "adapter"
    local.mkdir(exist_ok=True)
    (local / "adapter_config.json").write_bytes(config)
    (local / "adapter_model.safetensors").write_bytes(weights)
    try:
        _check_adapter_files(local, "adapters/step_00000002")
    except DeltaSyncError as exc:
        refused(exc, "adapters/step_00000002")


def check_adapter_config(data: bytes) -> None:
    keep("adapter_config", data)
    check_adapter(data, adapter_weights())


def check_adapter_weights(data: bytes) -> None:
    keep("adapter_weights", data)
    check_adapter(json.dumps(ADAPTER_CONFIG).encode(), data)


@given(json_inputs(ADAPTER_CONFIG))
@fuzz(300)
def test_adapter_config(data):
    check_adapter_config(data)


@given(st.deferred(lambda: damaged_safetensors(adapter_weights()) | mutated(adapter_weights(), header=200)))
@fuzz(300)
def test_adapter_weights(data):
    check_adapter_weights(data)


# The regression cases' targets.
CHECKS: dict[str, Callable[[bytes], None]] = {
    "compact_stream": replay_compact_stream,
    "version_file": check_version_file,
    "parted_version": replay_parted_version,
    "manifest": check_manifest,
    "latest": check_latest,
    "signature": check_signature,
    "pointer_record": check_pointer_record,
    "adapter_config": check_adapter_config,
    "adapter_weights": check_adapter_weights,
}


if __name__ == "__main__":
    sys.exit(
        pytest.main(
            [__file__, "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning", *sys.argv[1:]]
        )
    )
