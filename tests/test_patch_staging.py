"""`stage_patches`: one update's patch positions and values packed into one buffer each and
split back into per-tensor views, bit-exactly. On the CPU the buffers stay on the host; the
copy to a CUDA device (pinned memory, `non_blocking`) is not exercised here."""

from __future__ import annotations

import re

import pytest
import torch

from delta_sync.replica.staging import stage_patches


def patches_of(sizes: dict[str, int], *, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Ascending unique int64 positions and random bf16 values (NaN-free, -0.0 included)."""
    generator = torch.Generator().manual_seed(seed)
    patches = {}
    for name, count in sizes.items():
        positions = torch.randperm(10 * count + 1, generator=generator)[:count].sort().values
        values = torch.randn(count, generator=generator).to(torch.bfloat16)
        if count:
            values[0] = -0.0
        patches[name] = (positions, values)
    return patches


def test_views_hold_every_patch_bit_exactly_in_one_buffer_each():
    patches = patches_of({"lm_head.weight": 700, "model.norm.weight": 0, "model.embed_tokens.weight": 1234})
    staged = stage_patches(patches, "cpu")
    assert list(staged) == list(patches)
    for name, (positions, values) in patches.items():
        assert staged[name].positions.dtype == torch.int32  # every position fits: half the bytes
        assert torch.equal(staged[name].positions.long(), positions), name
        assert torch.equal(staged[name].values.view(torch.int16), values.view(torch.int16)), name
    # Two buffers for the whole update, not two per tensor.
    for field in ("positions", "values"):
        storages = {getattr(patch, field).untyped_storage().data_ptr() for patch in staged.values()}
        assert len(storages) == 1, field
    assert not staged["lm_head.weight"].values.is_pinned()  # nothing pinned for the CPU


def test_positions_past_int32_stay_int64():
    patches = patches_of({"a": 5, "b": 3})
    wide = torch.tensor([1, 2**31 + 7], dtype=torch.int64)
    patches["b"] = (wide, torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    staged = stage_patches(patches, torch.device("cpu"))
    assert staged["b"].positions.dtype == torch.int64
    assert torch.equal(staged["b"].positions, wide)
    assert torch.equal(staged["a"].positions, patches["a"][0])


def test_an_empty_update_stages_nothing():
    assert stage_patches({}, "cpu") == {}


@pytest.mark.parametrize(
    ("positions", "values", "message"),
    [
        (torch.tensor([1, 2]), torch.ones(3, dtype=torch.bfloat16), "'bad': 2 position(s) but values of shape [3]"),
        (torch.tensor([[1, 2]]), torch.ones(2, dtype=torch.bfloat16), "'bad': its positions must be a 1-D"),
        (torch.tensor([1.0, 2.0]), torch.ones(2, dtype=torch.bfloat16), "'bad': its positions must be a 1-D"),
        (torch.tensor([1, 2]), torch.ones(2, dtype=torch.float32), "'bad': its values are torch.float32"),
    ],
)
def test_a_malformed_patch_is_refused_by_name(positions, values, message):
    patches = {**patches_of({"good": 4}), "bad": (positions, values)}
    with pytest.raises(ValueError, match=re.escape(message)):
        stage_patches(patches, "cpu")
