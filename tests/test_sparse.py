"""`extract_changes_`, the trainer's compiled compare-and-advance pass, against torch."""

from __future__ import annotations

import pytest
import torch

from delta_sync.sparse import extract_changes_

from helpers import raw_bits

pytestmark = pytest.mark.timeout(120)

# fp32 words torch must round like any other value: NaNs (quiet, signalling, negative, with
# payloads), infinities, the largest finite value (rounds to Inf), subnormals, +-0.0, and
# halfway cases that round to even both ways.
SPECIAL_WORDS = torch.tensor(
    [0x7FC00000, 0x7F800001, -0x00400000, 0x7FC12345, 0x7F800000, -0x00800000, 0x7F7FFFFF,
     0x00000001, -0x7FFFFFFF, 0, -0x80000000, 0x3F808000, 0x3F818000, 0x3F807FFF],
    dtype=torch.int64,
).to(torch.int32)  # fmt: skip


def expected(current: torch.Tensor, snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rounded = raw_bits(current.to(torch.bfloat16)).reshape(-1)
    mask = rounded != raw_bits(snapshot).reshape(-1)
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
    assert torch.equal(raw_bits(new), rounded[mask])
    assert torch.equal(raw_bits(old), raw_bits(snapshot)[mask])
    assert torch.equal(raw_bits(advanced), rounded), "the snapshot must hold the new bf16 values"
    assert extract_changes_(current, advanced, index_dtype)[0].numel() == 0


def test_fp32_special_values_round_as_torch_does():
    current = SPECIAL_WORDS.repeat(10).view(torch.float32)
    snapshot = torch.zeros(current.numel(), dtype=torch.bfloat16)
    mask, rounded = expected(current, snapshot)
    positions, new, _ = extract_changes_(current, snapshot)
    assert torch.equal(positions, mask.nonzero().squeeze(1))
    assert torch.equal(raw_bits(new), rounded[mask])


def test_buffers_grow_when_most_elements_change():
    current = torch.arange(1, 300_001, dtype=torch.float32)
    snapshot = torch.zeros(300_000, dtype=torch.bfloat16)
    positions, new, old = extract_changes_(current, snapshot)
    assert torch.equal(positions, torch.arange(300_000))
    assert torch.equal(raw_bits(new), raw_bits(current.to(torch.bfloat16)))
    assert not raw_bits(old).any()


def test_other_layouts_are_left_to_torch():
    snapshot = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert extract_changes_(torch.ones(4, 4, dtype=torch.bfloat16).t(), snapshot) is None  # not contiguous
    assert extract_changes_(torch.ones(4, 4, dtype=torch.float16), snapshot) is None  # another dtype
    assert extract_changes_(torch.ones(4, 4), snapshot.float()) is None  # snapshot not bf16
    assert extract_changes_(torch.ones(8), snapshot) is None  # sizes differ
    assert not raw_bits(snapshot).any(), "nothing advanced"


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
    assert torch.equal(raw_bits(new), raw_bits(current)[moved])
    assert torch.equal(raw_bits(old), raw_bits(snapshot)[moved])
    assert torch.equal(raw_bits(advanced), raw_bits(current))


def test_many_tensors_in_one_call_each_as_alone():
    """`extract_changes_many_`: bf16 and fp32 weights, int32 and int64 positions, an empty
    tensor and one the compiled pass declines, in one batch: each result is the tensor's own."""
    from delta_sync.sparse import extract_changes_many_

    generator = torch.Generator().manual_seed(5)
    cases = []
    for numel, dtype, index_dtype, density in (
        (70_001, torch.float32, torch.int32, 0.03),
        (1000, torch.bfloat16, torch.int64, 1.0),  # more changes than the first buffer holds
        (0, torch.bfloat16, torch.int32, 0.0),
        (4096, torch.bfloat16, torch.int32, 0.2),
        (65, torch.float32, torch.int64, 0.5),
    ):
        base = weights(numel, generator, special=numel > 0)
        current = base.clone()
        moved = torch.rand(numel, generator=generator) < density
        current[moved] += 1e-3 * torch.randn(int(moved.sum()), generator=generator)
        cases.append((current.to(dtype), base.to(torch.bfloat16), index_dtype))
    declined = (torch.ones(4, 4, dtype=torch.bfloat16).t(), torch.zeros(16, dtype=torch.bfloat16), torch.int32)
    cases.insert(2, declined)
    wanted = [expected(current, snapshot) for current, snapshot, _ in cases]
    results = extract_changes_many_(cases)
    assert results[2] is None and torch.equal(raw_bits(declined[1]), torch.zeros(16, dtype=torch.int16))
    for (current, snapshot, index_dtype), (mask, rounded), found in zip(cases, wanted, results):
        if current is declined[0]:
            continue
        positions, new, old = found
        assert positions.dtype == index_dtype
        assert torch.equal(positions.long(), mask.nonzero().squeeze(1))
        assert torch.equal(raw_bits(new), rounded[mask])
        assert torch.equal(raw_bits(snapshot), rounded), "the snapshot must hold the new bf16 values"


# -- the torch path, many tensors at once --------------------------------------------------


def test_the_batched_torch_path_finds_exactly_what_the_compiled_pass_finds():
    """Real AdamW steps on bf16 parameters and on fp32 masters (with NaN, infinities and
    -0.0 planted), through both passes from the same snapshot: same positions, values and
    advanced snapshots, bit for bit; non-contiguous tensors (which only torch takes) too."""
    from delta_sync.sparse import extract_changes_batched_

    torch.manual_seed(0)
    for master in (torch.bfloat16, torch.float32):
        params = [torch.nn.Parameter(torch.randn(shape, dtype=master)) for shape in ((64, 48), (4096,), (3, 5, 7))]
        optimizer = torch.optim.AdamW(params, lr=3e-3)
        compiled = [p.detach().to(torch.bfloat16).clone() for p in params]
        batched = [snap.clone() for snap in compiled]
        for step in range(3):
            loss = sum((p.float() ** 2).sum() for p in params)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 2:
                with torch.no_grad():
                    params[0].view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
            expected = [extract_changes_(p.detach(), snap, torch.int32) for p, snap in zip(params, compiled)]
            found = extract_changes_batched_([(p.detach(), snap, torch.int32) for p, snap in zip(params, batched)])
            for want, got, a, b in zip(expected, found, compiled, batched):
                assert want is not None
                if want[0].numel() == 0:
                    assert got is None
                    continue
                assert got[0].dtype == torch.int32 and torch.equal(want[0], got[0])
                assert torch.equal(want[1].view(torch.int16), got[1].view(torch.int16))
                assert torch.equal(want[2].view(torch.int16), got[2].view(torch.int16))
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # A transposed view: the compiled pass declines it, the batched one compares it in order.
    current = torch.randn(32, 16, dtype=torch.bfloat16).t()
    snapshot = current.contiguous().clone()
    current[3, 5] = 1.5
    assert extract_changes_(current, snapshot) is None
    (positions, new, old), none = extract_changes_batched_(
        [(current, snapshot, torch.int64), (torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16), torch.int32)]
    )
    assert none is None and positions.tolist() == [3 * 32 + 5] and new.tolist() == [1.5]
    assert snapshot[3, 5] == 1.5 and old.item() != 1.5
    # Without the old values (a host mirror has them), the rest is the same.
    current[4, 6] = 2.5
    ((positions, new, old),) = extract_changes_batched_([(current, snapshot, torch.int64)], old_values=False)
    assert positions.tolist() == [4 * 32 + 6] and new.tolist() == [2.5] and old is None and snapshot[4, 6] == 2.5
    assert extract_changes_batched_([]) == []
