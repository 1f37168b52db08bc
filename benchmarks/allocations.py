"""[`CountAllocations`]: the bytes torch allocates inside a block, and their peak.

CPU tensors have no allocator statistics (`torch.cuda.max_memory_allocated` is CUDA's), so
this counts for itself: a `TorchDispatchMode` sees every operator's outputs, and each new
storage among them is held (by a storage handle, which keeps no tensor alive) until torch's
own reference count says that nothing else uses it. What a block keeps at its peak is then
the sum of the storages alive at some operator's return: on a GPU, the same operators would
allocate the same bytes on the device (less what the block copies to the host).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CountAllocations"]


class CountAllocations(TorchDispatchMode):
    """Counts the storages torch operators create inside the block.

    Attributes:
        allocated: Bytes of every new storage, summed.
        peak: The most bytes of those storages alive at once.
        live: Bytes of those storages alive now (after the block: what it left behind).

    Example:
        ```python
        >>> with CountAllocations() as counted:
        ...     found = extract_changes_batched_(pairs)
        >>> counted.peak / changed_elements
        8.0
        ```
    """

    def __init__(self) -> None:
        super().__init__()
        self.allocated = 0
        self.peak = 0
        self._held: dict[int, tuple[torch.UntypedStorage, int]] = {}

    @property
    def live(self) -> int:
        self._drop_dead()
        return sum(nbytes for _, nbytes in self._held.values())

    def _drop_dead(self) -> None:
        for key, (storage, _) in list(self._held.items()):
            if torch._C._storage_Use_Count(storage._cdata) <= 1:  # only our handle is left
                del self._held[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()
        }
        result = func(*args, **(kwargs or {}))
        self._drop_dead()
        for out in tree_flatten(result)[0]:
            if not isinstance(out, torch.Tensor):
                continue
            storage = out.untyped_storage()
            key = storage.data_ptr()
            if not storage.nbytes() or key in known or key in self._held:
                continue
            self._held[key] = (storage, storage.nbytes())
            self.allocated += storage.nbytes()
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self._held.values()))
        return result
