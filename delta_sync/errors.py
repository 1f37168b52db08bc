"""Exception classes raised by delta-sync.

Every error names the file, tensor, bucket or field at fault. All of them derive from
[`DeltaSyncError`], so `except DeltaSyncError` catches anything this library raises on
purpose.
"""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Base class of every error raised by delta-sync.

    Errors pickle with their fields, so one raised in another process (a vLLM worker, a
    torch.distributed rank, a multiprocessing pool) reaches the caller as itself.
    """

    def __reduce__(self) -> tuple:
        # Exception's own reduction calls `cls(*args)`, which loses (or, where they are
        # required, fails on) the keyword-only fields some subclasses take.
        return _rebuilt, (type(self), self.args), self.__dict__


def _rebuilt(cls: type[DeltaSyncError], args: tuple) -> DeltaSyncError:
    """An error of `cls` with `args`, its fields set afterwards from the pickled state."""
    return cls.__new__(cls, *args)


class FormatError(DeltaSyncError):
    """A file is not a well-formed delta-sync anchor or delta.

    Raised for unreadable safetensors, missing or malformed metadata, tensors with the
    wrong dtype or rank, indices that are unsorted or out of range, and payloads whose
    digest does not match the one recorded in the file.
    """


class IntegrityError(DeltaSyncError):
    """Applying a file would not reproduce the trainer's weights bit for bit.

    Raised when a recomputed checksum differs from the one the trainer recorded. Nothing
    has been applied when this is raised.
    """


class ApplyError(DeltaSyncError):
    """A well-formed file cannot be applied to the weights held by a receiver.

    Examples: a parameter name the receiver does not hold, a shape that differs from the
    held tensor's, or a file from another training run. Nothing has been applied when
    this is raised.
    """


class BaseVersionError(ApplyError):
    """A delta was made against a version other than the one the receiver holds."""

    def __init__(self, message: str, *, held: int | None, base: int | None) -> None:
        super().__init__(message)
        self.held = held
        self.base = base


class SnapshotMovedError(ApplyError):
    """The node's shared snapshot has moved past the version asked for and can no longer
    rebuild it (see `delta_sync.replica.snapshot`); a catch-up reaches the node's version."""

    def __init__(self, message: str, *, held: int | None, wanted: int) -> None:
        super().__init__(message)
        self.held = held
        self.wanted = wanted


class BucketError(DeltaSyncError):
    """A storage operation failed permanently (after any retries)."""


class BucketPathError(BucketError, ValueError):
    """A path inside a bucket is empty, absolute, or escapes the bucket's prefix."""


class BucketFileNotFoundError(BucketError, FileNotFoundError):
    """The requested file does not exist in the bucket."""


class BucketNotFoundError(BucketError):
    """The bucket itself does not exist."""


class BucketPermissionError(BucketError, PermissionError):
    """The credentials in use may not read or write the bucket."""


class BucketConflictError(BucketError, FileExistsError):
    """A file that must not be overwritten already exists (e.g. another trainer wrote that version)."""


class BucketUnavailableError(BucketError, ConnectionError):
    """The store kept failing with transient errors (connection, 429, 5xx) until the retry budget ran out."""


class SignatureError(DeltaSyncError):
    """A file is not signed by the trainer's key: unsigned, signed by another key, or
    changed since it was signed. Raised only by replicas configured with a verify key;
    nothing has been applied."""


class ReplayError(SignatureError):
    """A genuinely signed pointer is older than one the replica already accepted from the
    bucket: an old `latest.json` put back (a rollback or a replay of an abandoned epoch)."""


class OversizedFileError(BucketError, FormatError):
    """A bucket file is larger than its signature, or the model's shapes, allow: refused
    before it is downloaded past that size."""


class UntrustedBucketError(ApplyError):
    """A receiver was asked to load weights from a bucket it is not configured to trust."""


class UnsupportedLayoutError(DeltaSyncError):
    """The trainer's parameters are laid out in a way delta-sync cannot publish exactly
    (e.g. FSDP1's flattened parameters, a `DTensor` placement other than `Shard` or
    `Replicate`). Raised at train begin, before anything is written; the message says what
    is supported (`delta_sync.trainer.sharding.SUPPORTED`)."""


class PublishError(DeltaSyncError):
    """A background publish failed; raised at the next publish, flush or close."""


class IncompleteTransfer(ConnectionError):
    """A transfer ended with fewer bytes than the file has.

    A transport fault, not a decision of this library (so not a [`DeltaSyncError`]): the
    storage backends retry it, and it reaches a caller only as the cause of
    [`BucketUnavailableError`].
    """


class ReplicaError(DeltaSyncError):
    """A vLLM replica refused an update, could not be reached (after retries), or reported
    a state other than the one expected.

    Callers decide on the fields, never on the message text.

    Args:
        message: What went wrong, naming the replica.
        url: The replica's base URL.
        route: The route that failed (e.g. `/update_weights`), or None when no request did.
        status: The HTTP status of the answer, or None when there was none.
        server_message: The error message the server sent, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str,
        route: str | None = None,
        status: int | None = None,
        server_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.route = route
        self.status = status
        self.server_message = server_message


class UnservableModelError(UnsupportedLayoutError):
    """The model's parameters are not named like the checkpoint a replica serves (an
    unknown wrapper inserts segments into the names), or it is a PEFT model whose merged
    weights cannot be computed exactly: refused at train begin, before anything is written."""
