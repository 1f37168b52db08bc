"""[`AdapterFetcher`]: bring an adapter version (adapter mode) from a bucket to a local
directory that vLLM's `/v1/load_lora_adapter` loads.

A version published in adapter mode (`delta_sync.trainer.adapter`) is two files,
`adapters/step_XXXXXXXX/adapter_config.json` and `.../adapter_model.safetensors`, and
`latest.json` names it in its `adapter` field. The fetcher follows the same trust rules
as a receiver applying anchors and deltas, with the receiver's own configuration (allow
list, verify key, bucket name, record of accepted pointers):

* the bucket must be on the allow list;
* with a verify key, `latest.json` must be signed for this bucket and no older than the
  newest pointer accepted from it, and each file must carry its signature (`.sig`), by
  that key, for its path in this bucket and for the pointer's run and epoch; a file is
  downloaded no further than its signed size and its SHA-256 checked;
* the weights file's SHA-256 must be the one `latest.json` records (without a key too).

Each version lands in its own directory under the download cache
(`adapters/<bucket>/<run_id>/<epoch>/step_XXXXXXXX`): a new path per version, so vLLM's
prefix cache, which keys an adapter's blocks by name and path, never serves blocks an
older version computed. The directory appears whole (downloaded beside it, then renamed);
the newest few are kept, since vLLM reads a path again when it has evicted an adapter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..control import AdapterStatus
from ..errors import ApplyError, FormatError, SignatureError
from ..layout import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS, LATEST, Latest, adapter_dir, parse_adapter_path
from ..signing import FileSignature, file_sha256
from ..storage import Bucket

__all__ = ["AdapterFetcher"]

logger = logging.getLogger(__name__)

#: The most bytes an unsigned adapter config may have.
_MAX_CONFIG_BYTES = 1 << 20


class AdapterFetcher:
    """Fetches adapter versions of the buckets a receiver trusts, as that receiver would.

    Args:
        receiver: The replica's `Receiver`: its `reader` (allow list, verify key, bucket
            name, record of accepted pointers: see `delta_sync.replica.trust.BucketReader`)
            and download cache (`cache.root`, under which versions are written) apply.
        keep: Versions to keep per bucket (the newest); older directories are removed.
    """

    def __init__(self, receiver, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.receiver = receiver
        self.keep = keep
        self.root = Path(receiver.cache.root) / "adapters"

    def fetch(self, bucket: Bucket | str | os.PathLike, version: int | None = None) -> AdapterStatus:
        """Bring an adapter version to a local directory, checked.

        Args:
            bucket: The bucket (on the allow list).
            version: The version to fetch; None: the one `latest.json` names. It must be
                published (at or before `latest.json`'s) and of the pointer's run.

        Returns:
            Where the version is (`path`) and which it is.

        Raises:
            DeltaSyncError: The bucket is not trusted; `latest.json` is malformed, unsigned,
                older than one accepted or names no adapter; a file is missing, unsigned,
                signed by another key or for another bucket, run or epoch, larger than
                signed, or not the file signed; the weights are not those `latest.json`
                records. Nothing is left in the cache then.
        """
        reader = self.receiver.reader
        opened = reader.open(bucket)
        identity = reader.identity(opened)
        latest = reader.read_latest(opened)
        source = f"{opened.url}/{LATEST}"
        if latest.adapter is None:
            raise FormatError(
                f"{source}: names version {latest.version} as anchors and deltas, not as an adapter; "
                "this bucket is published in merged mode (update the weights instead)"
            )
        target = latest.version if version is None else version
        if target > latest.version:
            raise ApplyError(
                f"{source}: adapter version {target} is not published (latest.json names {latest.version})"
            )
        directory = adapter_dir(target)
        if target == latest.version and latest.adapter != directory:
            raise FormatError(
                f"{source}: names adapter {latest.adapter!r} for version {target}, expected {directory!r}"
            )
        home = self.root / hashlib.sha256(identity.encode()).hexdigest()[:16]
        final = home / AdapterStatus.local_name(latest.run_id, latest.epoch, target)
        expected = latest.model_checksum if target == latest.version else None
        if final.is_dir():
            try:
                return self._check_local(opened, latest, directory, final, expected)
            except (FormatError, SignatureError) as exc:
                logger.warning("delta-sync: %s no longer matches the bucket (%s); fetching it again", final, exc)
                shutil.rmtree(final, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=final.parent))
        try:
            for name in ADAPTER_FILES:
                self._download(opened, latest, f"{directory}/{name}", staging / name)
            status = self._check_local(opened, latest, directory, staging, expected, signatures=False)
            try:
                os.rename(staging, final)
            except OSError:
                if not final.is_dir():
                    raise
                # Another worker of this server put the same version there first: use theirs, checked.
                return self._check_local(opened, latest, directory, final, expected)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._prune(home, keep=final)
        logger.info("delta-sync: fetched adapter v%d of run %s into %s", target, latest.run_id, final)
        return AdapterStatus(status.version, status.run_id, status.epoch, str(final), status.model_checksum)

    # -- checks ---------------------------------------------------------------------------

    def _signature(self, bucket: Bucket, latest: Latest, path: str) -> FileSignature | None:
        """With a verify key: the file's signature, checked for the key, path, bucket, run and
        epoch (any epoch of the run for a version before `latest.epoch_start`: the run's history)."""
        signature = self.receiver.reader.read_signature(bucket, path)
        if signature is None:
            return None
        version = parse_adapter_path(path)
        history = bool(latest.epoch_start) and version is not None and version < latest.epoch_start
        if signature.about.run_id != latest.run_id or (not history and signature.about.epoch != latest.epoch):
            raise SignatureError(
                f"{bucket.url}/{path}: signed for run {signature.about.run_id} (epoch {signature.about.epoch or '-'}), "
                f"but latest.json names run {latest.run_id} (epoch {latest.epoch or '-'})"
            )
        return signature

    def _download(self, bucket: Bucket, latest: Latest, path: str, local: Path) -> None:
        unsigned_limit = _MAX_CONFIG_BYTES if path.endswith(ADAPTER_CONFIG) else None
        signature = self._signature(bucket, latest, path)
        self.receiver.reader.download(bucket, path, local, signature=signature, unsigned_limit=unsigned_limit)

    def _check_local(
        self,
        bucket: Bucket,
        latest: Latest,
        directory: str,
        local: Path,
        expected: str | None,
        *,
        signatures: bool = True,
    ) -> AdapterStatus:
        """Check a local copy: (a directory already there) each file against its signature,
        the weights against `latest.json`'s digest, and that both files are an adapter."""
        digests = {name: file_sha256(local / name) for name in ADAPTER_FILES if (local / name).is_file()}
        missing = [name for name in ADAPTER_FILES if name not in digests]
        if missing:
            raise FormatError(f"{local}: lacks {missing}")
        if signatures:
            for name in ADAPTER_FILES:
                signature = self._signature(bucket, latest, f"{directory}/{name}")
                if signature is not None:
                    signature.check_digest(digests[name])
        weights = digests[ADAPTER_WEIGHTS]
        source = f"{bucket.url}/{directory}"
        if expected is not None and weights != expected:
            raise FormatError(
                f"{source}/{ADAPTER_WEIGHTS}: SHA-256 {weights[:16]}... is not the {expected[:16]}... latest.json records"
            )
        _check_adapter_files(local, source)
        return AdapterStatus(int(directory.rsplit("_", 1)[1]), latest.run_id, latest.epoch, str(local), weights)

    def _prune(self, home: Path, *, keep: Path) -> None:
        """Keep the newest `keep` version directories of a bucket (and `keep` itself)."""
        versions = sorted(
            (path for path in home.glob("*/*/step_*") if path.is_dir()), key=lambda path: path.stat().st_mtime
        )
        for path in versions[: -self.keep]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)


def _check_adapter_files(local: Path, source: str) -> None:
    """Both files are a LoRA adapter: a JSON config of `peft_type` LORA, and safetensors of
    lora_A / lora_B weights (vLLM checks the rest when it loads them)."""
    try:
        config = json.loads((local / ADAPTER_CONFIG).read_bytes())
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{source}/{ADAPTER_CONFIG}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise FormatError(f"{source}/{ADAPTER_CONFIG}: not a LoRA adapter config (peft_type {kind!r})")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(local / ADAPTER_WEIGHTS), framework="pt") as handle:
            names = list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise FormatError(f"{source}/{ADAPTER_WEIGHTS}: not a safetensors file ({exc})") from None
    if not names or not all(".lora_A." in name or ".lora_B." in name for name in names):
        odd = [name for name in names if ".lora_A." not in name and ".lora_B." not in name]
        raise FormatError(f"{source}/{ADAPTER_WEIGHTS}: holds tensors that are no LoRA weights: {odd[:3] or 'none'}")
