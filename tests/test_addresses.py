"""Arrays handed to compiled code by address read and write the arrays themselves."""

import numba
import numpy as np
import pytest

from delta_sync.addresses import address_of, view


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
