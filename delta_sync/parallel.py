"""`parallel_map`: per-parameter work on every core.

Work on separate parameters is independent, and numpy, torch and xxhash release the GIL
in their kernels, so threads scale across cores without copying anything.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["parallel_map"]

T = TypeVar("T")
R = TypeVar("R")


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="delta-sync")


def parallel_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """`list(map(fn, items))`, run on a shared thread pool; exceptions propagate."""
    items = list(items)
    if len(items) < 2:
        return [fn(item) for item in items]
    return list(_pool().map(fn, items))
