"""`extract_changes_`, the trainer's compiled compare-and-advance pass, against torch."""

from __future__ import annotations

import pytest
import torch

from delta_sync.sparse import extract_changes_

pytestmark = pytest.mark.timeout(120)

# fp32 words torch must round like any other value: NaNs (quiet, signalling, negative, with
# payloads), infinities, the largest finite value (rounds to Inf), subnormals, +-0.0, and
# halfway cases that round to even both ways.
SPECIAL_WORDS = torch.tensor(
    [0x7FC00000, 0x7F800001, -0x00400000, 0x7FC12345, 0x7F800000, -0x00800000, 0x7F7FFFFF,
     0x00000001, -0x7FFFFFFF, 0, -0x80000000, 0x3F808000, 0x3F818000, 0x3F807FFF],
    dtype=torch.int64,
).to(torch.int32)  # fmt: skip


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def expected(current: torch.Tensor, snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rounded = bits(current.to(torch.bfloat16)).reshape(-1)
    mask = rounded != bits(snapshot).reshape(-1)
    return mask, rounded


def weights(numel: int, generator: torch.Generator, special: bool) -> torch.Tensor:
    tensor = torch.randn(numel, generator=generator) * 0.02
    if special:
        picks = torch.randint(0, numel, (max(1, numel // 7),), generator=generator)
        tensor.view(torch.int32)[picks] = SPECIAL_WORDS[torch.randint(0, SPECIAL_WORDS.numel(), picks.shape)]
    return tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 70_001])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_torch_and_advances_the_snapshot(dtype, numel, density, index_dtype):
    generator = torch.Generator().manual_seed(numel + int(100 * density))
    base = weights(numel, generator, special=True)
    snapshot = base.to(torch.bfloat16)
    current = base.clone()
    moved = torch.rand(numel, generator=generator) < density
    current[moved] += 1e-3 * torch.randn(int(moved.sum()), generator=generator)
    current = current.to(dtype)
    mask, rounded = expected(current, snapshot)
    advanced = snapshot.clone()
    positions, new, old = extract_changes_(current, advanced, index_dtype)
    assert positions.dtype == index_dtype
    assert torch.equal(positions.long(), mask.nonzero().squeeze(1))
    assert torch.equal(bits(new), rounded[mask])
    assert torch.equal(bits(old), bits(snapshot)[mask])
    assert torch.equal(bits(advanced), rounded), "the snapshot must hold the new bf16 values"
    assert extract_changes_(current, advanced, index_dtype)[0].numel() == 0


def test_fp32_special_values_round_as_torch_does():
    current = SPECIAL_WORDS.repeat(10).view(torch.float32)
    snapshot = torch.zeros(current.numel(), dtype=torch.bfloat16)
    mask, rounded = expected(current, snapshot)
    positions, new, _ = extract_changes_(current, snapshot)
    assert torch.equal(positions, mask.nonzero().squeeze(1))
    assert torch.equal(bits(new), rounded[mask])


def test_buffers_grow_when_most_elements_change():
    current = torch.arange(1, 300_001, dtype=torch.float32)
    snapshot = torch.zeros(300_000, dtype=torch.bfloat16)
    positions, new, old = extract_changes_(current, snapshot)
    assert torch.equal(positions, torch.arange(300_000))
    assert torch.equal(bits(new), bits(current.to(torch.bfloat16)))
    assert not bits(old).any()


def test_other_layouts_are_left_to_torch():
    snapshot = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert extract_changes_(torch.ones(4, 4, dtype=torch.bfloat16).t(), snapshot) is None  # not contiguous
    assert extract_changes_(torch.ones(4, 4, dtype=torch.float16), snapshot) is None  # another dtype
    assert extract_changes_(torch.ones(4, 4), snapshot.float()) is None  # snapshot not bf16
    assert extract_changes_(torch.ones(8), snapshot) is None  # sizes differ
    assert not bits(snapshot).any(), "nothing advanced"


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_bf16_views_that_start_mid_word_are_compared_exactly(offset):
    """The bf16 pass reads whole groups as 64-bit words: a view whose data starts at any
    element (a parameter carved out of a flat buffer) must give the same result."""
    generator = torch.Generator().manual_seed(offset)
    flat = weights(4099, generator, special=True).to(torch.bfloat16)
    current = flat[offset:]
    snapshot = current.clone()
    moved = (torch.rand(current.numel(), generator=generator) < 0.05).nonzero().squeeze(1)
    current.view(torch.int16)[moved] += 1
    base = torch.empty(snapshot.numel() + offset, dtype=torch.bfloat16)
    advanced = base[offset:]
    advanced.copy_(snapshot)
    positions, new, old = extract_changes_(current, advanced)
    assert torch.equal(positions, moved)
    assert torch.equal(bits(new), bits(current)[moved])
    assert torch.equal(bits(old), bits(snapshot)[moved])
    assert torch.equal(bits(advanced), bits(current))
