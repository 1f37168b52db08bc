"""Compact deltas in parts: each rank codes its block of every parameter against that block
of the previous weights; a replica cuts the same blocks out of the weights it holds.

The trainers themselves (FSDP2, DeepSpeed ZeRO-3) run under `torchrun` in
test_distributed.py and test_deepspeed.py; here the parts are written directly, so that
every kind of block and every way a version of parts can be wrong is covered quickly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_format import delta_header

from delta_sync.blocks import Block
from delta_sync.errors import ApplyError, FormatError
from delta_sync.format import CodedDelta, FileHeader, SparseChange, read_file, write_delta
from delta_sync.manifest import Manifest, PartedDelta, PartRecord, read_version

SHAPE = (7, 6)
NAME = "model.layers.0.mlp.down_proj.weight"

# The blocks a trainer's ranks hold of one (7, 6) parameter, per sharding.
LAYOUTS = {
    "fsdp2 rows": [Block((0, 0), (4, 6)), Block((4, 0), (3, 6))],
    "columns (non-contiguous blocks)": [Block((0, 0), (7, 4)), Block((0, 4), (7, 2))],
    "zero3 flat ranges, one empty": [Block((0,), (20,)), Block((20,), (22,)), Block((42,), (0,))],
}


def weights_before_and_after(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    before = (torch.randn(SHAPE, generator=generator) * 0.02).bfloat16()
    after = before.clone()
    changed = torch.rand(SHAPE, generator=generator) < 0.4
    after[changed] = (after[changed].float() * 1.01).bfloat16()
    assert not torch.equal(before, after)
    return before, after


def write_parts(tmp_path, before, after, blocks, *, encoding="compact", world=None) -> tuple[Manifest, list]:
    """Each block's changes written as one rank's part, as a sharded Publisher writes them."""
    whole = delta_header({NAME: before}, {NAME: changed_elements(before, after)})
    parts, records, total = [], [], 0
    for rank, block in enumerate(blocks):
        old, new = block.region(before).contiguous(), block.region(after).contiguous()
        local = changed_elements(old, new)
        if not len(local):
            continue
        header = dataclasses.replace(
            whole,
            part=(rank, world or len(blocks)),
            encoding=encoding,
            changed_elements=len(local),
            model_checksum="",
            blocks={NAME: block.offset} if encoding == "compact" else {},
            block_shapes={NAME: block.shape} if encoding == "compact" else {},
        )
        if encoding == "raw":  # raw parts hold positions in the full tensor
            local = SparseChange(block.full_positions(SHAPE, local.indices), local.values)
        path = tmp_path / f"part_{rank:05d}.safetensors"
        written = write_delta(path, {NAME: local}, header, {NAME: old})
        records.append(PartRecord(f"deltas/step_00000002/part_{rank:05d}.safetensors", rank, 0, written.payload_digest))
        parts.append((records[-1], path))
        total += len(local)
    manifest = Manifest(
        kind="delta",
        id=whole.id,
        base_version=1,
        encoding=encoding,
        world_size=world or len(blocks),
        parts=tuple(records),
        shapes={NAME: SHAPE},
        checksums=whole.checksums,
        base_checksums=whole.base_checksums,
        model_checksum=whole.model_checksum,
        changed_elements=total,
        total_elements=whole.total_elements,
    )
    return manifest, parts


def changed_elements(before: torch.Tensor, after: torch.Tensor) -> SparseChange:
    positions = (before.reshape(-1).view(torch.int16) != after.reshape(-1).view(torch.int16)).nonzero().squeeze(1)
    return SparseChange(positions.to(torch.int32), after.reshape(-1)[positions])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parts_decode_to_the_changes_of_the_full_tensor(tmp_path, layout):
    before, after = weights_before_and_after()
    manifest, parts = write_parts(tmp_path, before, after, LAYOUTS[layout])
    version = read_version(manifest, parts, source="manifest")
    assert isinstance(version, PartedDelta) and version.coded
    decoded = version.decoded({NAME: before})
    expected = changed_elements(before, after)
    assert torch.equal(decoded.changes[NAME].indices.long(), expected.indices.long())
    assert torch.equal(decoded.changes[NAME].values.view(torch.int16), expected.values.view(torch.int16))


def test_a_part_is_decoded_against_its_block_not_the_whole_tensor(tmp_path):
    before, after = weights_before_and_after()
    manifest, parts = write_parts(tmp_path, before, after, LAYOUTS["columns (non-contiguous blocks)"])
    part = read_file(parts[1][1], part_of="m")
    assert part.header.block(NAME) == Block((0, 4), (7, 2))
    # The whole tensor is not what the part was coded against: refused, not misread.
    with pytest.raises(ApplyError, match="held as"):
        part.decoded({NAME: before})


def test_blocks_that_overlap_are_refused(tmp_path):
    before, after = weights_before_and_after()
    manifest, parts = write_parts(tmp_path, before, after, [Block((0, 0), (4, 6)), Block((3, 0), (4, 6))])
    with pytest.raises(FormatError, match="overlapping blocks"):
        read_version(manifest, parts, source="manifest")


def test_a_raw_part_among_compact_parts_is_refused(tmp_path):
    before, after = weights_before_and_after()
    (tmp_path / "compact").mkdir()
    (tmp_path / "raw").mkdir()
    manifest, compact = write_parts(tmp_path / "compact", before, after, LAYOUTS["fsdp2 rows"])
    _, raw = write_parts(tmp_path / "raw", before, after, LAYOUTS["fsdp2 rows"], encoding="raw")
    mixed = [compact[0], raw[1]]
    with pytest.raises(FormatError, match="encoding is 'raw'"):
        read_version(dataclasses.replace(manifest, parts=tuple(record for record, _ in mixed)), mixed, source="m")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_shapes": {}}, "block_shapes"),
        ({"blocks": {}}, "blocks"),
        ({"blocks": {NAME: (5, 0)}}, "does not lie inside"),
        ({"block_shapes": {NAME: (4, 7)}}, "does not lie inside"),
        ({"part": None}, "blocks"),
    ],
    ids=["no block shapes", "no blocks", "block past the end", "block wider than the tensor", "not a part"],
)
def test_block_metadata_that_does_not_fit_is_refused(tmp_path, change, message):
    before, after = weights_before_and_after()
    _, parts = write_parts(tmp_path, before, after, LAYOUTS["fsdp2 rows"])
    source = parts[0][1]
    header = read_file(source, part_of="m").header
    damaged = dataclasses.replace(header, **change)
    local = changed_elements(Block((0, 0), (4, 6)).region(before).contiguous(), Block((0, 0), (4, 6)).region(after))
    path = tmp_path / "damaged.safetensors"
    write_delta(path, {NAME: local}, damaged, {NAME: Block((0, 0), (4, 6)).region(before).contiguous()})
    with pytest.raises(FormatError, match=message):
        read_file(path, part_of="m")


def test_a_file_that_is_not_a_part_still_decodes_against_whole_tensors(tmp_path):
    before, after = weights_before_and_after()
    header = dataclasses.replace(
        delta_header({NAME: before}, {NAME: changed_elements(before, after)}), encoding="compact"
    )
    path = tmp_path / "delta.safetensors"
    write_delta(path, {NAME: changed_elements(before, after)}, header, {NAME: before})
    delta = read_file(path)
    assert isinstance(delta, CodedDelta) and delta.coded and delta.header.block(NAME) == Block((0, 0), SHAPE)
    assert torch.equal(delta.decoded({NAME: before}).changes[NAME].indices, changed_elements(before, after).indices)


def test_the_header_round_trips_its_blocks(tmp_path):
    before, after = weights_before_and_after()
    _, parts = write_parts(tmp_path, before, after, LAYOUTS["zero3 flat ranges, one empty"])
    header = read_file(parts[1][1], part_of="m").header
    assert (header.blocks, header.block_shapes) == ({NAME: (20,)}, {NAME: (22,)})
    assert FileHeader.from_metadata(header.to_metadata(), source=header.source) == header
