"""Progress bars for large transfers: shown on a terminal, for files above a size threshold."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

from tqdm.auto import tqdm

__all__ = ["copy_with_progress", "progress_min_bytes", "show_progress", "transfer_progress"]

DEFAULT_MIN_BYTES = 64 << 20


def progress_min_bytes() -> int:
    """Files at least this large get a progress bar: `$DELTA_SYNC_PROGRESS_MIN_BYTES`, else 64 MiB."""
    value = os.environ.get("DELTA_SYNC_PROGRESS_MIN_BYTES")
    if not value:
        return DEFAULT_MIN_BYTES
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"DELTA_SYNC_PROGRESS_MIN_BYTES={value!r} is not an integer") from None


def show_progress(size: int, stream: IO | None = None) -> bool:
    """Whether a transfer of `size` bytes gets a bar: large enough, and `stream` (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        is_terminal = stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        is_terminal = False
    return size >= progress_min_bytes() and is_terminal


@contextmanager
def transfer_progress(desc: str, total: int, stream: IO | None = None) -> Iterator[Callable[[int], object]]:
    """A byte-count progress bar for one transfer; yields its `update(n_bytes)` callable.

    Example:
        ```python
        >>> with transfer_progress("upload anchors/step_00000010.safetensors", size) as update:
        ...     for chunk in chunks:
        ...         send(chunk)
        ...         update(len(chunk))
        ```
    """
    enabled = show_progress(total, stream)
    with tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        disable=not enabled,
        file=stream if enabled else None,
    ) as bar:
        yield bar.update


def copy_with_progress(
    source: IO[bytes], dest: IO[bytes], desc: str, total: int, chunk: int = 16 << 20, *, limit: int | None = None
) -> int:
    """Copy one open file to another in chunks, with a [`transfer_progress`] bar; returns
    the bytes copied (with a `limit`, at most one more than it: enough to tell that the
    source is larger)."""
    copied = 0
    with transfer_progress(desc, total) as update:
        while data := source.read(chunk if limit is None else min(chunk, limit + 1 - copied)):
            dest.write(data)
            copied += len(data)
            update(len(data))
    return copied
