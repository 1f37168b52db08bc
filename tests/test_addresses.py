"""Arrays handed to compiled code by address read and write the arrays themselves."""

import numba
import numpy as np
import pytest
import torch

from delta_sync.addresses import address_of, as_bfloat16, memory_of, view


@numba.njit
def _negate_all(table):
    """Negate every array of `table` (rows: address, size) in place; their sum before."""
    total = 0
    for row in range(table.shape[0]):
        values = view(table[row, 0], table[row, 1], np.int16)
        for i in range(values.size):
            total += values[i]
            values[i] = -values[i]
    return total


def test_a_compiled_call_reads_and_writes_every_array_by_address():
    arrays = [np.arange(size, dtype=np.int16) for size in (0, 1, 7, 1000)]
    table = np.array([[address_of(a), a.size] for a in arrays], np.int64)
    assert _negate_all(table) == sum(int(a.sum()) for a in [np.arange(s) for s in (0, 1, 7, 1000)])
    for size, array in zip((0, 1, 7, 1000), arrays):
        assert np.array_equal(array, -np.arange(size, dtype=np.int16))


def test_a_strided_array_is_refused():
    with pytest.raises(ValueError, match="C-contiguous"):
        address_of(np.arange(10, dtype=np.int16)[::2])


@pytest.mark.parametrize("numel", [0, 1, 1000])
def test_a_tensors_memory_read_by_address_is_the_tensor_itself(numel):
    tensor = torch.randn(numel).to(torch.bfloat16)
    bits = memory_of(tensor, np.int16)
    assert bits.tolist() == tensor.view(torch.int16).tolist()
    if numel:
        bits[0] = 0x3F80  # written through: the tensor holds 1.0 there now
        assert tensor[0].item() == 1.0
    floats = torch.arange(numel, dtype=torch.float32)  # kept alive by the caller, as documented
    assert memory_of(floats, np.int32).tolist() == floats.view(torch.int32).tolist()


@pytest.mark.parametrize("numel", [0, 3])
def test_bf16_bit_patterns_become_a_bf16_tensor_over_the_same_memory(numel):
    bits = np.arange(numel, dtype=np.int16) + 0x3F80
    tensor = as_bfloat16(bits)
    assert tensor.dtype == torch.bfloat16 and tensor.view(torch.int16).tolist() == bits.tolist()
    if numel:
        bits[1] = 0x4000  # 2.0
        assert tensor[1].item() == 2.0


def test_a_tensor_that_is_not_its_own_bytes_is_not_read_by_address():
    columns = torch.zeros(4, 6, dtype=torch.bfloat16)[:, 1:3]
    with pytest.raises(ValueError, match="only a contiguous CPU tensor"):
        memory_of(columns, np.int16)
