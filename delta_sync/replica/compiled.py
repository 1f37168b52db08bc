"""`load_compiled_passes`: a replica's compiled passes, ready before the server serves.

numba loads each compiled pass from its on-disk cache the first time a process calls it
(and compiles it, for seconds, the first time in an environment), holding the GIL all
the while. Left to the first update, that happens while vLLM generates, and no token
streams until it is done; vLLM's worker extension calls this when its engine starts.
"""

from __future__ import annotations

import time

import torch

from ..changes import SparseChange
from ..compact import decode_changes, encode_changes
from ..integrity import apply_checksums, tensor_checksum
from ..sparse import scatter_many_

__all__ = ["load_compiled_passes"]


def load_compiled_passes() -> float:
    """Run, on a few elements, every compiled pass a replica's update calls.

    Returns:
        The seconds it took.

    Example:
        ```python
        >>> seconds = load_compiled_passes()  # at start-up, before any request
        ```
    """
    start = time.perf_counter()
    weights = torch.zeros(8, dtype=torch.bfloat16)
    values = torch.ones(2, dtype=torch.bfloat16)
    for dtype in (torch.int32, torch.int64):
        indices = torch.tensor([1, 5], dtype=dtype)
        apply_checksums([(0, weights, indices, values)])
        scatter_many_([(weights.clone(), indices, values)])
    tensor_checksum(weights)
    tensor_checksum(weights.float())  # a tensor that travels in float32 (a router), as an anchor's checks see it
    change = SparseChange(torch.tensor([1, 5], dtype=torch.int32), values)
    entries = encode_changes({"w": change}, {"w": weights})
    decode_changes(entries, {"w": weights}, {"w": (8,)}, source="load_compiled_passes")
    return time.perf_counter() - start
