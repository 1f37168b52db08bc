"""Many numpy arrays handed to one compiled call, by address.

A compiled (numba) pass over each tensor of a model is one call per tensor, and each call
returns to Python holding the GIL: where another thread runs Python (on a trainer, the one
that launches the training kernels; on a replica, vLLM's), every return waits for that
thread's GIL switch interval (5 ms), which on a model of hundreds of tensors costs more
than the passes themselves. Handing a call the addresses and sizes of all its arrays lets
one call, without the GIL, do them all. (numba's typed lists would do the same, but
compile their own methods in every process, most of a second before the first encode.)

The caller keeps the arrays alive, C-contiguous and of the dtype it names, for the call.

Example:
    ```python
    >>> table = np.array([[address_of(a), a.size] for a in arrays], np.int64)
    >>> @numba.njit(nogil=True)
    ... def total(table):
    ...     return sum(view(table[i, 0], table[i, 1], np.int16).sum() for i in range(table.shape[0]))
    ```
"""

from __future__ import annotations

import ctypes

import numba
import numpy as np
import torch
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["address_of", "as_bfloat16", "memory_of", "on_host", "view"]


def address_of(array: np.ndarray) -> int:
    """The address of a C-contiguous array's first element.

    Raises:
        ValueError: The array is not C-contiguous (its elements are not at `address + i * itemsize`).
    """
    if not array.flags.c_contiguous:
        raise ValueError("only a C-contiguous array can be passed by address")
    return array.__array_interface__["data"][0]


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself where it is a contiguous CPU tensor (readable at `data_ptr()`), else a
    contiguous CPU copy.

    Most torch calls release the GIL, and where another thread runs Python (a trainer's
    training loop, a replica's vLLM), taking it back waits for that thread's switch interval
    (5 ms) per call: a tensor that needs none is used as it is, with no call.
    """
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor
    return tensor.detach().cpu().contiguous()


def memory_of(tensor: torch.Tensor, dtype: type[np.generic]) -> np.ndarray:
    """The memory of a contiguous CPU tensor as a 1-D numpy array of `dtype`, with no torch
    call (`tensor.view(...).numpy()` makes two, each of which drops the GIL). The caller
    keeps `tensor` alive while the array is used.

    Raises:
        ValueError: The tensor is not a contiguous CPU tensor (its elements are not the
            bytes from `data_ptr()` on).
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"only a contiguous CPU tensor can be read by address, got one on {tensor.device}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(tensor.data_ptr()), dtype)


def as_bfloat16(bits: np.ndarray) -> torch.Tensor:
    """A 1-D array of bf16 bit patterns (int16) as a bf16 tensor sharing its memory, with no
    torch call that drops the GIL."""
    if bits.size == 0:
        return torch.empty(0, dtype=torch.bfloat16)
    return torch.frombuffer(bits, dtype=torch.bfloat16)


@intrinsic
def _pointer(typingctx, address):
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@numba.njit(inline="always")
def view(address, size, dtype):
    """The `size` elements of `dtype` at `address`, as a C-contiguous 1-D array (from
    `numba.njit` functions only; nothing is copied or checked)."""
    return numba.carray(_pointer(address), size, dtype)
