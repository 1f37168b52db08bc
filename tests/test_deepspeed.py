"""DeltaSyncCallback with DeepSpeed ZeRO engines: `torchrun` processes on CPU (DeepSpeed's CPU
accelerator, gloo), and the flat blocks ZeRO-3 partitions are published as.

ZeRO-1/2 keep whole parameters on every rank: rank 0 publishes single files. ZeRO-3 keeps
each parameter as one flat partition per rank: every rank publishes its own partition as
a flat block of an anchor part, and positions in the full tensors in its delta parts. The
script checks a Receiver against the full weights bit for bit after every version and
makes gathering weights fail while the callback runs.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from test_distributed import torchrun
from torch import nn

from delta_sync.blocks import Block
from delta_sync.errors import UnsupportedLayoutError
from delta_sync.trainer.sharding import describe_model, full_shape, local_tensor

requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install deepspeed, or the 'test' extra)",
)


def test_a_flat_block_is_a_range_of_the_flattened_tensor():
    full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    block = Block(offset=(8,), shape=(9,))  # from the middle of row 1 to the middle of row 3
    assert block.is_flat((7, 5)) and block.fits((7, 5)) and not block.fits((3, 5))
    assert block.full_positions((7, 5), torch.tensor([0, 1, 8])).tolist() == [8, 9, 16]
    assert block.region(full).tolist() == list(range(8, 17))
    rebuilt = torch.zeros(7, 5)
    for start, size in ((0, 8), (8, 9), (17, 18)):
        piece = Block((start,), (size,))
        piece.region(rebuilt).copy_(full.view(-1)[start : start + size])
    assert torch.equal(rebuilt, full)
    # A 1-D tensor's blocks are flat and rectangular alike.
    assert not Block((2,), (3,)).is_flat((9,)) and Block((2,), (3,)).region(torch.arange(9)).tolist() == [2, 3, 4]


def test_flat_blocks_that_overlap_or_mix_with_rectangles_are_caught():
    assert Block((0,), (5,)).overlaps(Block((4,), (3,)))
    assert not Block((0,), (5,)).overlaps(Block((5,), (3,)))
    assert not Block((0,), (5,)).overlaps(Block((2,), (0,)))  # empty
    # A tensor's blocks are all flat or all rectangles: a mix is refused, not compared.
    assert Block((0,), (5,)).overlaps(Block((3, 0), (1, 5)))


def zero3_parameter(shape: tuple[int, ...], partition: int, location: str = "none") -> nn.Parameter:
    """A parameter as ZeRO-3 leaves it between steps: empty, its partition in `ds_tensor`."""
    param = nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
    param.ds_id = 0
    param.ds_shape = torch.Size(shape)
    param.ds_numel = math.prod(shape)
    param.ds_process_group = None
    param.ds_tensor = torch.arange(partition).to(torch.bfloat16)
    param.ds_tensor.final_location = location
    return param


def test_a_zero3_partition_is_published_as_a_flat_block_without_its_padding():
    param = zero3_parameter((2, 3), partition=8)  # padded by 2
    layout = describe_model([("w", param)])
    assert layout.sharded and layout.shapes == {"w": (2, 3)} and full_shape(param) == (2, 3)
    assert layout.shards["w"].block == Block((0,), (6,))
    assert local_tensor(param).tolist() == list(range(6))


def test_zero3_partitions_offloaded_to_nvme_are_refused():
    with pytest.raises(UnsupportedLayoutError, match="NVMe"):
        describe_model([("w", zero3_parameter((2, 3), partition=6, location="nvme"))])


def run(
    bucket: Path, ranks: int, stage: int, precision: str, passed: str, steps: int, encoding: str = "raw"
) -> list[dict]:
    results = torchrun(
        "deepspeed_publish.py",
        ranks,
        "--bucket",
        str(bucket),
        "--stage",
        str(stage),
        "--precision",
        precision,
        "--pass",
        passed,
        "--steps",
        str(steps),
        "--anchor-every",
        "2",
        "--encoding",
        encoding,
    )
    results.sort(key=lambda result: result["rank"])
    assert len(results) == ranks
    assert [v["version"] for v in results[0]["versions"]] == list(range(1, steps + 1))
    return results


def applied(results: list[dict]) -> list[str]:
    return [path for version in results[0]["versions"] for path in version["applied"]]


def trained(results: list[dict]) -> bool:
    """Whether every step changed some weights, as the trainer reported them."""
    return all(version["changed"] > 0 for version in results[0]["versions"][1:])


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize(
    ("stage", "precision", "passed"),
    [(2, "bf16", "trainer"), (1, "fp32", "engine")],
    ids=["zero2-bf16-as-trainer-passes", "zero1-fp32-engine"],
)
def test_zero_1_2_rank_0_publishes_whole_tensors_bit_exactly(tmp_path, stage, precision, passed):
    from delta_sync import verify_bucket

    bucket = tmp_path / "bucket"
    results = run(bucket, 2, stage, precision, passed, steps=4)
    assert [(r["sharded"], r["publishes"]) for r in results] == [(False, True), (False, False)]
    assert trained(results) and any("/deltas/" in path for path in applied(results)), "no delta was exercised"
    assert not list(bucket.rglob("part_*.safetensors")), "whole parameters must be published as single files"
    assert verify_bucket(str(bucket)).ok


@pytest.mark.slow
@requires_deepspeed
def test_zero3_every_rank_publishes_its_partition_and_a_receiver_replays_bit_exactly(tmp_path):
    from delta_sync import verify_bucket

    bucket = tmp_path / "bucket"
    results = run(bucket, 2, 3, "bf16", "trainer", steps=4)
    assert all(r["sharded"] and r["publishes"] for r in results)
    assert trained(results) and any("/deltas/" in path for path in applied(results)), "no delta was exercised"
    parts = {p.relative_to(bucket).as_posix() for p in bucket.rglob("part_*.safetensors")}
    assert {"anchors/step_00000003/part_00000.safetensors", "anchors/step_00000003/part_00001.safetensors"} <= parts
    report = verify_bucket(str(bucket))
    assert report.ok, [step for step in report.steps if not step.ok]


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize("encoding", ["raw", "compact"])
def test_zero3_on_3_ranks_with_fp32_partitions_and_empty_ones(tmp_path, encoding):
    # The 2-element q/k norms leave rank 2 an empty partition; fp32 partitions are published
    # through their bf16 rounding. Compact parts are coded in each rank's flat range.
    from delta_sync import read_file, verify_bucket

    bucket = tmp_path / "bucket"
    results = run(bucket, 3, 3, "fp32", "engine", steps=3, encoding=encoding)
    assert all(r["sharded"] for r in results) and trained(results)
    assert any("/deltas/" in path for path in applied(results)), "no delta was exercised"
    for path in bucket.glob("deltas/*/part_*.safetensors"):
        header = read_file(path, part_of="test").header
        assert header.encoding == encoding
        assert all(len(shape) == 1 for shape in header.block_shapes.values())
    assert verify_bucket(str(bucket)).ok
