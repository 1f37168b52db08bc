"""[`PublisherOptions`] and [`PeftPublish`]: how a trainer's versions are stored, for both publishers.

Both the anchor-and-delta [`Publisher`] (`delta_sync.trainer.publisher`) and the
adapter-mode `AdapterPublisher` (`delta_sync.trainer.adapter`) are configured by the same
options, so the options live here, below both: neither publisher imports the other.
[`signing_key_of`] resolves the one option both read the environment for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

from ..changes import Encoding
from ..signing import SigningKey

__all__ = ["PeftPublish", "PublisherOptions", "signing_key_of"]

#: The encodings a publisher writes deltas in.
_DELTA_ENCODINGS = (Encoding.RAW, Encoding.COMPACT)


class PeftPublish(str, Enum):
    """What a PEFT LoRA model is published as (`DeltaSyncConfig.peft_publish`).

    A `str`, so that it compares equal to (and is accepted as) its value.
    """

    #: The base checkpoint with the adapter merged in, as anchors and deltas (`delta_sync.trainer.merged`).
    MERGED = "merged"
    #: The adapter itself, whole, per version, for `vllm serve --enable-lora`.
    ADAPTER = "adapter"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class PublisherOptions:
    """How a [`Publisher`] stores versions; checked once, when made.

    Args:
        anchor_every: Write an anchor every this many versions (and at the first); >= 1.
        anchor_bytes_ratio: Also write an anchor once the deltas since the last one add up to
            more than this fraction of its size, so that a replica joining late never
            downloads more than about `1 + anchor_bytes_ratio` anchors' worth to catch up.
            None to count versions only.
        keep_anchors: How many anchors to keep (>= 1); older anchors and the deltas before
            the oldest kept anchor are deleted.
        background: Encode and upload on a worker thread.
        max_pending: Versions that may wait for the worker before `publish` blocks (at
            least 1 is always allowed).
        run_id: Identifier of this training run, recorded in every file; random by default
            (rank 0's, with a sharded model).
        overwrite: If the bucket prefix already holds another run's files, delete them
            (otherwise that is an error: runs must not share a prefix). A run resumed
            with the same `run_id` continues in place.
        signing_key: Sign every file replicas act on with this Ed25519 key (a
            `delta_sync.signing.SigningKey`, or the path or PEM text of one); default: the
            key `DELTA_SYNC_SIGNING_KEY` names, else unsigned.
        encoding: How deltas store their changes: [`Encoding.RAW`] (int32 positions and
            bf16 values, the published TRL format) or [`Encoding.COMPACT`] (entropy-coded
            against the weights replicas hold; several times smaller, see
            `delta_sync.compact`). Its value (`"raw"`, `"compact"`) is accepted too.
        bucket_id: The bucket's name in signed statements, which replicas check against
            theirs; default `DELTA_SYNC_BUCKET_ID`, else the bucket's URL. Set it (to the
            same name on replicas) when they reach the bucket by another URL, e.g. a
            directory mounted elsewhere.
        pointer_refresh: With nothing to publish for this many seconds, write
            `latest.json` again (same version, a newer counter and time), so that replicas
            can tell a live trainer from a pointer held back (`DELTA_SYNC_MAX_STALENESS` on
            replicas should be a few times this). None never refreshes. Needs `background`.
        peft_publish: What a PEFT LoRA model is published as (a `PeftPublish`, or its
            value): `"merged"` (the base checkpoint with the adapter merged, as anchors and
            deltas; a [`Publisher`]) or `"adapter"` (the adapter itself per version, for
            `vllm serve --enable-lora`; an `AdapterPublisher`, see
            `delta_sync.trainer.adapter`, which keeps `keep_anchors` adapter versions).

    Raises:
        ValueError: An option is out of range; the message names it.
    """

    anchor_every: int = 10
    anchor_bytes_ratio: float | None = 1.0
    keep_anchors: int = 2
    background: bool = True
    max_pending: int = 2
    run_id: str | None = None
    overwrite: bool = False
    signing_key: SigningKey | str | os.PathLike | None = None
    encoding: Encoding = Encoding.RAW
    bucket_id: str | None = None
    pointer_refresh: float | None = 60.0
    peft_publish: PeftPublish = PeftPublish.MERGED

    def __post_init__(self) -> None:
        if self.pointer_refresh is not None and not self.pointer_refresh > 0:
            raise ValueError(f"pointer_refresh must be > 0 seconds or None, got {self.pointer_refresh}")
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {self.anchor_every}")
        if self.anchor_bytes_ratio is not None and self.anchor_bytes_ratio <= 0:
            raise ValueError(f"anchor_bytes_ratio must be > 0 or None, got {self.anchor_bytes_ratio}")
        if self.keep_anchors < 1:
            raise ValueError(f"keep_anchors must be >= 1, got {self.keep_anchors}")
        try:
            encoding = Encoding(self.encoding)
        except ValueError:
            encoding = None
        if encoding not in _DELTA_ENCODINGS:
            raise ValueError(f"encoding must be 'raw' or 'compact', got {self.encoding!r}")
        object.__setattr__(self, "encoding", encoding)
        try:
            object.__setattr__(self, "peft_publish", PeftPublish(self.peft_publish))
        except ValueError:
            raise ValueError(f"peft_publish must be 'merged' or 'adapter', got {self.peft_publish!r}") from None


def signing_key_of(option: SigningKey | str | os.PathLike | None) -> SigningKey | None:
    """The key a publisher signs with.

    Args:
        option: `PublisherOptions.signing_key`: a key, or the path or PEM text of one; None
            for the key `DELTA_SYNC_SIGNING_KEY` names (None again: unsigned).
    """
    if option is None:
        return SigningKey.from_env()
    return option if isinstance(option, SigningKey) else SigningKey.load(option)
