"""`njit_cached`: numba's `njit(cache=True)` with a disk cache that neither another numba build
nor a concurrent compile can corrupt.

numba keeps a cached function's machine code in numbered data files beside one index
(`compact.decode-321.py311.nbi`, `...1.nbc`, `...2.nbc`): a process that compiles a new
overload writes it to the lowest number its own reading of the index leaves free. Two
processes that compile different overloads at once (the ranks of a `torchrun` job on a fresh
cache) can both pick `.1.nbc`; the index then names one overload and the file holds the
other's code, which the next process runs with the wrong argument types and dies of a
segfault. Two environments whose numba builds differ (a trainer's and a vLLM server's over
one editable install) each ignore the other's index but write the same data files, so one
loads the other's LLVM bitcode ("LLVM bitcode parsing error ... Unknown attribute kind").

Here a data file is named after what it holds (the overload's key and the source it was
compiled from), so whoever writes it writes the same code, and each numba + llvmlite build
keeps its files in a directory of its own. Concurrent writers can still each rewrite the
index without the other's new entry: that overload is compiled again by the next process
that needs it, which costs time and nothing else.

Example:
    ```python
    >>> @njit_cached(nogil=True)
    ... def total(values):
    ...     return values.sum()
    ```
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import llvmlite
import numba
from numba.core.caching import FunctionCache, IndexDataCacheFile

__all__ = ["BUILD", "njit_cached"]

#: The directory, under numba's own cache location, that this numba build's files live in.
BUILD = f"numba-{numba.__version__}-llvmlite-{llvmlite.__version__}"


class _DataFilesByKey(IndexDataCacheFile):
    """numba's index and data files, a data file named after the overload it holds."""

    def __init__(self, cache_path: str, filename_base: str, source_stamp) -> None:
        super().__init__(cache_path=cache_path, filename_base=filename_base, source_stamp=source_stamp)
        self._filename_base = filename_base

    def save(self, key, data) -> None:
        name = self._name_of(key)
        # The data first: an index never names a file that is not (yet) there.
        self._save_data(name, data)
        overloads = self._load_index()
        if overloads.get(key) != name:
            overloads[key] = name
            self._save_index(overloads)

    def _name_of(self, key) -> str:
        digest = hashlib.sha256(repr((key, self._source_stamp)).encode()).hexdigest()[:24]
        return f"{self._filename_base}.{digest}.nbc"


class _BuildCache(FunctionCache):
    """numba's per-function cache, in this build's directory, with data files named by key."""

    def __init__(self, py_func: Callable) -> None:
        super().__init__(py_func)
        self._cache_path = os.path.join(self._cache_path, BUILD)
        os.makedirs(self._cache_path, exist_ok=True)
        self._cache_file = _DataFilesByKey(
            cache_path=self._cache_path,
            filename_base=self._impl.filename_base,
            source_stamp=self._impl.locator.get_source_stamp(),
        )


def njit_cached(**options) -> Callable[[Callable], Callable]:
    """`numba.njit(**options, cache=True)`, cached as this module describes.

    Args:
        options: `numba.njit`'s options (`nogil`, `inline`, ...), `cache` aside.

    Returns:
        A decorator that compiles a function, loading it from the cache where it can.

    Example:
        ```python
        >>> @njit_cached(nogil=True)
        ... def first(values):
        ...     return values[0]
        ```
    """

    def compile_cached(function: Callable) -> Callable:
        dispatcher = numba.njit(**options)(function)
        # What `njit(cache=True)` does (numba's `Dispatcher.enable_caching`), with our cache.
        dispatcher._cache = _BuildCache(dispatcher.py_func)
        return dispatcher

    return compile_cached
