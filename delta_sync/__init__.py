"""delta-sync: bit-exact delta weight sync from an RL trainer to its rollout servers.

The package has three sides:

* the wire format and its checks, shared by both ends: `format` (the one gate that decides
  whether a file is valid), `encodings` (how a delta's changes are stored, one codec per
  encoding), `layout` (where files live in a bucket), `integrity`
  (checksums), `checkpoint` (a model's checkpoint, as `save_pretrained` writes it, in its
  run-time tensors), `control` (the HTTP contract between trainer and vLLM replicas),
  `storage` (local, Hugging Face and S3 buckets), `errors`;
* the trainer side, `delta_sync.trainer`: [`BF16ChangeDetector`], [`Publisher`] and
  [`DeltaSyncCallback`] for any `transformers.Trainer`, TRL's included;
* the replica side, `delta_sync.replica`: [`Receiver`], which applies anchors and deltas
  to a local snapshot, checking that the result is bit for bit the trainer's weights.

Every error this library raises on purpose is a [`DeltaSyncError`]; the specific classes
live in `delta_sync.errors`.
"""

import importlib

from .control.client import ReplicaOptions
from .errors import DeltaSyncError
from .format import read_file
from .replica.receiver import ApplyResult, Receiver, expected_shapes_of, module_weight_loader
from .replica.verify import verify_bucket
from .storage import Bucket, LocalBucket, open_bucket

__version__ = "0.1.0"

__all__ = [
    "ApplyResult",
    "BF16ChangeDetector",
    "Bucket",
    "DeltaSyncCallback",
    "DeltaSyncConfig",
    "DeltaSyncError",
    "LocalBucket",
    "PublishReport",
    "Publisher",
    "PublisherOptions",
    "Receiver",
    "ReplicaOptions",
    "expected_shapes_of",
    "module_weight_loader",
    "open_bucket",
    "read_file",
    "verify_bucket",
]


#: The trainer side's names, imported only when asked for, so the replica side (e.g. inside
#: a vLLM server) never imports `delta_sync.trainer` (and the callback's transformers).
_TRAINER_NAMES = {
    "BF16ChangeDetector": "detector",
    "DeltaSyncCallback": "callback",
    "DeltaSyncConfig": "callback",
    "PublishReport": "publisher",
    "Publisher": "publisher",
    "PublisherOptions": "publisher",
}


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        return getattr(importlib.import_module(f".trainer.{_TRAINER_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'delta_sync' has no attribute {name!r}")
