"""The caller's CUDA streams, carried to the threads that work for it.

A CUDA stream is per thread: a pool thread that copies or rounds a parameter queues that
work on the device's default stream, whatever stream the thread that asked trains on. A
loop that trains under `torch.cuda.stream(s)` writes its weights on `s`, and work on
another stream is not ordered after those writes: it could read weights half updated.
[`caller_streams`] records the calling thread's current stream per device and
[`on_streams`] makes them current in the thread that does the work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch

__all__ = ["caller_streams", "on_streams"]


def caller_streams(devices: Iterable[torch.device]) -> dict[torch.device, torch.cuda.Stream]:
    """The calling thread's current stream on each CUDA device among `devices` (empty where
    none is a CUDA device)."""
    return {device: torch.cuda.current_stream(device) for device in dict.fromkeys(devices) if device.type == "cuda"}


@contextlib.contextmanager
def on_streams(streams: Mapping[torch.device, torch.cuda.Stream]) -> Iterator[None]:
    """Make `streams` (device -> stream, from [`caller_streams`]) current in this thread."""
    with contextlib.ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(torch.cuda.stream(stream))
        yield
