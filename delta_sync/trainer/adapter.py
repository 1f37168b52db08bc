"""Adapter mode: publish a PEFT LoRA model's adapter itself, for `vllm serve --enable-lora`.

In merged mode (the default, `delta_sync.trainer.merged`) a replica serves the base
checkpoint with the adapter merged in, and every version is an anchor or a delta of the
merged weights. In adapter mode ([`PeftPublish.ADAPTER`]) every version is the whole
adapter in `peft`'s own format, as `PeftModel.save_pretrained` writes it:

```
adapters/step_00000003/adapter_model.safetensors   the LoRA A/B weights under peft's saved names
adapters/step_00000003/adapter_config.json         the adapter's LoraConfig
latest.json                                        names the version ("adapter": "adapters/step_00000003")
```

An adapter is small (rank r per adapted module), so each version holds it whole: no
snapshot, no change detection, no delta chain, and a replica that joins late downloads
one version. The weights are stored in the adapter's own dtype (fp32 when `peft` upcasts
the adapter, as TRL's trainers do), so that `PeftModel.from_pretrained` on the base model
gives the trainer's adapter bit for bit; vLLM casts them to its LoRA dtype when it loads
them. Every file is signed like anchors and deltas (its `.sig` lands first), and
`latest.json` moves to a version only once both files are stored, through the same
[`PointerWriter`] (signed pointer, a counter that only increases) as every other version.

Replicas fetch a version with the worker extension's `delta_sync_fetch_adapter` and load
it with vLLM's `/v1/load_lora_adapter` (`delta_sync.control.client.Replica.load_adapter`).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import DeltaSyncError, PublishError, UnservableModelError
from ..layout import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    LATEST,
    Latest,
    adapter_dir,
    parse_adapter_path,
)
from ..signing import SigningKey, file_sha256
from ..storage import Bucket, open_bucket
from ..version import VersionId
from .background import BackgroundWriter
from .options import PeftPublish, PublisherOptions, signing_key_of
from .prefix import PointerWriter, claim_prefix
from .writer import PublishReport

__all__ = ["AdapterJob", "AdapterPublisher", "PeftPublish", "adapter_state", "peft_model_of"]

logger = logging.getLogger(__name__)


_ADAPTER_OPTIONS = (
    "peft_publish='adapter' publishes a peft LoRA adapter (a PeftModel with one LoRA adapter on nn.Linear "
    "modules, without DoRA, lora_bias or modules_to_save) in the format vLLM's --enable-lora loads; "
    "use peft_publish='merged' (the default) for other models"
)


def peft_model_of(model: nn.Module) -> nn.Module:
    """The `peft.PeftModel` inside `model` (under DDP, Accelerate or torch.compile), checked
    to be one adapter mode can publish.

    Raises:
        UnservableModelError: There is none, several, or one that vLLM's LoRA support
            cannot load as it is (another PEFT method, DoRA, a LoRA bias,
            `modules_to_save`, several adapters); the message names the problem and the options.
    """
    try:
        from peft import PeftModel, PeftType
    except ImportError:
        raise UnservableModelError(
            f"peft is not installed, so the model is no PEFT model. {_ADAPTER_OPTIONS}"
        ) from None
    found = [module for module in model.modules() if isinstance(module, PeftModel)]
    if len(found) != 1:
        what = "no peft PeftModel" if not found else f"{len(found)} PeftModels"
        raise UnservableModelError(f"the model ({type(model).__name__}) holds {what}. {_ADAPTER_OPTIONS}")
    peft_model = found[0]
    if len(peft_model.peft_config) != 1:
        raise UnservableModelError(
            f"the PeftModel holds {len(peft_model.peft_config)} adapters ({sorted(peft_model.peft_config)}); "
            f"publish one. {_ADAPTER_OPTIONS}"
        )
    name, config = next(iter(peft_model.peft_config.items()))
    problem = None
    if config.peft_type != PeftType.LORA:
        problem = f"is a {config.peft_type.value} adapter"
    elif getattr(config, "use_dora", False):
        problem = "uses DoRA"
    elif getattr(config, "lora_bias", False):
        problem = "trains a LoRA bias"
    elif getattr(config, "modules_to_save", None):
        problem = f"trains modules_to_save {sorted(config.modules_to_save)}"
    if problem is not None:
        raise UnservableModelError(f"the PeftModel's adapter {name!r} {problem}. {_ADAPTER_OPTIONS}")
    if any(type(param).__name__ == "DTensor" for param in peft_model.parameters()):
        raise UnservableModelError(
            "the PeftModel is sharded (FSDP2): adapter mode publishes the whole adapter from one process; "
            "train it with DDP or on one process"
        )
    return peft_model


def adapter_state(peft_model: nn.Module) -> tuple[dict[str, torch.Tensor], object]:
    """A copy of the adapter's weights, under `peft`'s saved names and in their own dtype,
    and a copy of its config with `inference_mode=True`: what `save_pretrained` writes.

    Args:
        peft_model: A `peft.PeftModel` ([`peft_model_of`]).
    """
    from peft import get_peft_model_state_dict

    name = next(iter(peft_model.peft_config))
    with torch.no_grad():
        state = get_peft_model_state_dict(peft_model, adapter_name=name)
        tensors = {key: value.detach().to("cpu", copy=True).contiguous() for key, value in state.items()}
    config = copy.deepcopy(peft_model.peft_config[name])
    config.inference_mode = True
    return tensors, config


@dataclass(frozen=True)
class AdapterJob:
    """One adapter version handed from the training thread to the thread that stores it.

    Args:
        id: The version's identity (an adapter version is its own anchor).
        tensors: A copy of the adapter's weights ([`adapter_state`]).
        config: A copy of its `peft` config.
        detect_seconds: Time the training thread spent copying them.
    """

    id: VersionId
    tensors: dict[str, torch.Tensor]
    config: object
    detect_seconds: float

    @property
    def version(self) -> int:
        return self.id.version

    def release(self) -> None:
        """Nothing to release: the job holds copies, not the trainer's tensors."""


class _AdapterWriter(PointerWriter):
    """Stores adapter versions, in order, from one thread: both files signed, then the
    pointer, then retention (the newest `keep` versions stay)."""

    def __init__(
        self,
        bucket: Bucket,
        *,
        signing_key: SigningKey | None,
        bucket_id: str | None,
        keep: int,
        resumed: list[str],
    ) -> None:
        super().__init__(bucket, signing_key=signing_key, bucket_id=bucket_id)
        self.keep = keep
        self._resumed = resumed
        self._staging = Path(tempfile.mkdtemp(prefix="delta-sync-adapter-"))
        self._epoch_start: int | None = None

    def close(self) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)

    def store(self, job: AdapterJob, earlier_failure: BaseException | None = None) -> PublishReport:
        """Store one adapter version: both files signed, then the pointer, then retention.

        Args:
            job: The version.
            earlier_failure: Not used: with no ranks to keep in step, a version after a
                failure is dropped before it gets here.
        """
        from safetensors.torch import save_file

        started = time.perf_counter()
        id, tensors, config = job.id, job.tensors, job.config
        if self._resumed:
            self._rewind(id.version)
        directory = adapter_dir(id.version)
        local = self._staging / f"step_{id.version:08d}"
        local.mkdir()
        try:
            config.save_pretrained(str(local))  # peft's own adapter_config.json
            save_file(tensors, str(local / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            written = 0
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                written += self.store_signed(f"{directory}/{name}", local / name, id)
            sha256 = file_sha256(local / ADAPTER_WEIGHTS)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        if self._epoch_start is None:  # version 0 (the adapter as training starts) counts too
            self._epoch_start = id.version
        latest = Latest(
            id=id, anchor="", delta=None, model_checksum=sha256, epoch_start=self._epoch_start, adapter=directory
        )
        written += self._point(latest)
        self._apply_retention()
        elements = sum(tensor.numel() for tensor in tensors.values())
        return PublishReport(
            version=id.version,
            files=(f"{directory}/{ADAPTER_CONFIG}", f"{directory}/{ADAPTER_WEIGHTS}"),
            delta=None,
            anchor=None,
            changed_elements=elements,
            total_elements=elements,
            bytes_written=written,
            delta_bytes=0,
            steps=1,
            detect_seconds=job.detect_seconds,
            publish_seconds=time.perf_counter() - started,
            model_checksum=sha256,
            catch_up_bytes=written,
            adapter=directory,
        )

    def _versions(self) -> dict[int, list[str]]:
        found: dict[int, list[str]] = {}
        for path in self.bucket.list(ADAPTER_DIR):
            version = parse_adapter_path(path)
            if version is not None:
                found.setdefault(version, []).append(path)
        return found

    def _apply_retention(self) -> None:
        versions = self._versions()
        doomed = sorted(versions)[: -self.keep]
        if doomed:
            self.bucket.delete([path for version in doomed for path in versions[version]])
            logger.info("delta-sync: retention removed adapter version(s) %s", doomed)

    def _rewind(self, version: int) -> None:
        """A resumed run writes `version` again: its pointer goes first (so that it never
        names a file that is gone; the version now stored puts it back), then this run's
        adapter files of `version` and later."""
        resumed, self._resumed = self._resumed, []
        stale = [path for path in resumed if (parse_adapter_path(path) or 0) >= version]
        if not stale:
            return
        logger.warning(
            "delta-sync: resuming at v%d, deleting %d later adapter file(s) of this run", version, len(stale)
        )
        self.withdraw_pointer()
        self.bucket.delete(stale)


class AdapterPublisher:
    """Publishes a PEFT LoRA model's adapter, whole, as every version (adapter mode).

    The training thread copies the adapter's weights (a few MB at most); a worker thread
    (with `background`; a `delta_sync.trainer.background.BackgroundWriter`, as for anchors
    and deltas) writes, signs and uploads the two files and moves `latest.json`. Versions
    are stored in order; a failure is raised by the next [`publish`], [`flush`] or
    [`close`], and versions queued behind it are dropped. While there is nothing new to
    publish, `latest.json` is written again every `pointer_refresh` seconds, so that
    replicas with a staleness bound see a live trainer. `keep_anchors` is the number of
    adapter versions kept in the bucket.

    Args:
        bucket: Where to write (a `Bucket` or a URL).
        model: The model being trained: a `peft.PeftModel` with one LoRA adapter, under
            any wrapper (DDP, Accelerate, torch.compile).
        options: The publisher's options (`anchor_every`, `encoding` and the other delta
            options do not apply).
        on_published: Called (on the worker thread) with each version's report.

    Raises:
        UnservableModelError: The model is not one adapter mode can publish ([`peft_model_of`]).
        PublishError: The prefix holds another run's files (and not `overwrite`).
    """

    def __init__(
        self,
        bucket: Bucket | str | os.PathLike,
        model: nn.Module,
        options: PublisherOptions,
        *,
        on_published: Iterable[Callable[[PublishReport], None]] = (),
    ) -> None:
        self.peft_model = peft_model_of(model)
        self.options = options
        self.bucket = open_bucket(bucket)
        self.signing_key = signing_key_of(options.signing_key)
        self.run_id = options.run_id or uuid.uuid4().hex[:12]
        self.epoch = uuid.uuid4().hex[:8]
        resumed = _claim_adapters(self.bucket, self.run_id, overwrite=options.overwrite)
        writer = _AdapterWriter(
            self.bucket,
            signing_key=self.signing_key,
            bucket_id=options.bucket_id,
            keep=options.keep_anchors,
            resumed=resumed,
        )
        self._jobs = BackgroundWriter(
            writer,
            background=options.background,
            max_pending=options.max_pending,
            pointer_refresh=options.pointer_refresh,
            describe=_describe,
            on_published=on_published,
            bucket_url=self.bucket.url,
            noun="adapter version",
            thread_name="delta-sync-adapter-publisher",
        )
        #: Every version stored, in order.
        self.reports: list[PublishReport] = self._jobs.reports
        #: Called with each report once stored (see `on_published` above).
        self.on_published: list[Callable[[PublishReport], None]] = self._jobs.on_published
        self._last_version: int | None = None
        self._first_version: int | None = None

    @property
    def last_version(self) -> int | None:
        """The last version handed to [`publish`]."""
        return self._last_version

    @property
    def first_version(self) -> int | None:
        """The first version handed to [`publish`]."""
        return self._first_version

    @property
    def pending_error(self) -> BaseException | None:
        """A background failure not yet raised (it will be, by the next publish, flush or close)."""
        return self._jobs.pending_failure

    def publish(self, version: int) -> None:
        """Publish the adapter as it is now as `version`.

        Raises:
            PublishError: An earlier background publish failed.
            ValueError: `version` does not increase.
        """
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"version {version} must be greater than the last published {self._last_version}")
        self._raise()
        started = time.perf_counter()
        tensors, config = adapter_state(self.peft_model)
        job = AdapterJob(
            VersionId(version, version, self.run_id, self.epoch), tensors, config, time.perf_counter() - started
        )
        self._last_version = version
        if self._first_version is None:
            self._first_version = version
        self._jobs.submit(job)
        if not self._jobs.background:
            self._raise()

    def flush(self) -> None:
        """Wait until every published version is stored; raise [`PublishError`] if one failed."""
        self._jobs.flush()
        self._raise()

    def close(self) -> None:
        """Flush, stop the worker, remove staging files. Raises a pending [`PublishError`]."""
        try:
            self.flush()
        finally:
            self._jobs.close()

    def _raise(self) -> None:
        """Raise a failure of an earlier version, if the worker kept one."""
        failure = self._jobs.take_failure()
        if failure is not None:
            raise PublishError(f"publishing to {self.bucket.url} failed: {failure}") from failure


def _describe(report: PublishReport) -> str:
    """The line logged for a stored adapter version."""
    return (
        f"v{report.version} adapter: {report.changed_elements} elements, {report.bytes_written} bytes in "
        f"{report.detect_seconds + report.publish_seconds:.3f} s"
    )


def _claim_adapters(bucket: Bucket, run_id: str, *, overwrite: bool) -> list[str]:
    """Claim the prefix for `run_id` ([`claim_prefix`] for the pointer and any anchors and
    deltas); returns this run's adapter files found there (a resumed run replaces them from
    its first version on). Another run's adapter files are deleted with `overwrite`, else refused."""
    try:
        owner = Latest.from_json(bucket.read_bytes(LATEST)).run_id
    except DeltaSyncError:
        owner = None
    adapters = [path for path in bucket.list(ADAPTER_DIR) if parse_adapter_path(path) is not None]
    if adapters and owner != run_id and not overwrite:
        raise PublishError(
            f"{bucket.url} already holds {len(adapters)} adapter file(s) of run {owner or 'unknown'}; "
            "use another prefix, pass the same run_id to resume that run, or overwrite=True to delete them"
        )
    claim_prefix(bucket, run_id, overwrite=overwrite)
    if owner == run_id:
        return adapters
    if adapters:
        logger.warning("delta-sync: deleting %d adapter file(s) of run %s from %s", len(adapters), owner, bucket.url)
        bucket.delete(adapters)
    return []
