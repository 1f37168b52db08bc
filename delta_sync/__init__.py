"""delta-sync: bit-exact delta weight sync from an RL trainer to its rollout servers.

The trainer side detects exactly which bf16 elements an optimizer step changed
([`BF16ChangeDetector`]), writes anchors and sparse deltas to a bucket ([`Publisher`]),
and plugs into a TRL trainer as a callback ([`DeltaSyncCallback`]). The replica side
([`Receiver`]) applies them to a local snapshot, checking that the result is bit for bit
the trainer's weights.
"""

from .detector import BF16ChangeDetector, ChangeSet, canonical_name
from .errors import (
    ApplyError,
    BaseVersionError,
    BucketConflictError,
    BucketError,
    BucketFileNotFoundError,
    BucketNotFoundError,
    BucketPathError,
    BucketPermissionError,
    BucketUnavailableError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    PublishError,
    UntrustedBucketError,
)
from .format import Anchor, Delta, FileHeader, SparseChange, read_file
from .layout import Latest, anchor_path, delta_path
from .publisher import Publisher, PublishReport
from .receiver import ApplyResult, Receiver, expected_shapes_of, module_weight_loader
from .storage import Bucket, LocalBucket, open_bucket

__version__ = "0.1.0"

__all__ = [
    "Anchor",
    "ApplyError",
    "ApplyResult",
    "BF16ChangeDetector",
    "BaseVersionError",
    "Bucket",
    "BucketConflictError",
    "BucketError",
    "BucketFileNotFoundError",
    "BucketNotFoundError",
    "BucketPathError",
    "BucketPermissionError",
    "BucketUnavailableError",
    "ChangeSet",
    "Delta",
    "DeltaSyncCallback",
    "DeltaSyncConfig",
    "DeltaSyncError",
    "FileHeader",
    "FormatError",
    "IntegrityError",
    "Latest",
    "LocalBucket",
    "PublishError",
    "PublishReport",
    "Publisher",
    "Receiver",
    "SparseChange",
    "UntrustedBucketError",
    "anchor_path",
    "canonical_name",
    "delta_path",
    "expected_shapes_of",
    "module_weight_loader",
    "open_bucket",
    "read_file",
]


def __getattr__(name: str):
    # The callback needs transformers; import it only when asked for, so the replica
    # side (e.g. inside a vLLM server) never pulls in the training stack.
    if name in ("DeltaSyncCallback", "DeltaSyncConfig"):
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'delta_sync' has no attribute {name!r}")
