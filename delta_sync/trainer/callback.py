"""`DeltaSyncCallback`: delta weight sync for any `transformers.Trainer`, including TRL's trainers."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..changes import Encoding
from ..checkpoint import CheckpointLayout, check_checkpoint_names
from ..control.client import PauseMode, ReplicaOptions
from ..errors import UnsupportedLayoutError
from . import trl_vllm
from .adapter import AdapterPublisher
from .detector import BF16ChangeDetector, checkpoint_tensors
from .merged import merged_weights
from .options import PeftPublish, PublisherOptions
from .publisher import Publisher, PublishReport
from .replicas import ReplicaSet
from .sharding import ModelLayout, describe_model, verify_across_ranks

if TYPE_CHECKING:
    from trl.generation.vllm_generation import VLLMGeneration

__all__ = ["DeltaSyncCallback", "DeltaSyncConfig"]

logger = logging.getLogger(__name__)

#: The `ReplicaOptions` field each `vllm_*` field of `DeltaSyncConfig` sets.
_REPLICA_FIELDS = {
    "timeout": "vllm_request_timeout",
    "retry_seconds": "vllm_retry_seconds",
    "pause_mode": "vllm_pause_mode",
    "headers": "vllm_headers",
    "token": "vllm_token",
}


@dataclass
class DeltaSyncConfig:
    """Configuration of [`DeltaSyncCallback`].

    The publisher's options and the replicas' are checked when the config is made, as a
    [`PublisherOptions`] ([`publisher_options`]) and a `ReplicaOptions`
    ([`replica_options`]: the `vllm_*` fields, without their prefix) that the callback
    hands on as they are.

    Args:
        bucket: Where to publish: a local directory, or a `file://`, `hf://buckets/...` or
            `s3://...` URL (see `delta_sync.storage.open_bucket`).
        sync_every: Publish a version every this many optimizer steps (the version number
            is the trainer's `global_step`).
        anchor_every: Write a full anchor every this many versions, besides the first.
        anchor_bytes_ratio: Also write an anchor once the deltas since the last one outweigh
            this fraction of it, so a replica joining late downloads at most about
            `1 + anchor_bytes_ratio` anchors' worth. None to count versions only.
        keep_anchors: Anchors to keep in the bucket; older files are deleted.
        background: Encode and upload on a worker thread, overlapping the next step.
        max_pending: Versions that may wait for the worker before training blocks.
        run_id: Identifier recorded in every file; random when None.
        snapshot_device: Where the detector keeps its bf16 snapshot (default: with the
            parameters). `"cpu"` saves accelerator memory at the cost of a copy per sync.
        host_mirror: Keep a host copy of an accelerator snapshot, advanced from the
            changes each sync brings back anyway, so anchors and compact deltas never copy
            the snapshot off the device (2 bytes of host memory per parameter). None (the
            default): whenever the snapshot is not on the CPU.
        overwrite: Delete another run's files found under `bucket` instead of refusing to
            start.
        vllm_url: Base URL(s) of vLLM servers (running `vllm_ext`) to update after every
            version. With TRL's `GRPOTrainer` in vLLM server mode it defaults to the
            trainer's own server, and TRL's NCCL weight sync is replaced.
        max_staleness: How many versions a replica may lag when a generation starts. 0
            (on-policy) waits until the replicas serve the newest version; k lets the
            generation for step n+1 run on weights as old as step n-k while updates go on
            in the background.
        sync_timeout: Longest wait, in seconds, for replicas before a generation; replicas
            still behind are reported and training goes on.
        vllm_request_timeout: Seconds allowed for one request to a replica (the file is
            downloaded during `/update_weights`).
        vllm_retry_seconds: How long transient request failures (connection errors, 429,
            502-504) are retried, with exponential backoff.
        vllm_pause_mode: How requests in flight are treated while tensors load: `"keep"`,
            `"wait"`, `"abort"` (vLLM's `/pause` modes, a `PauseMode`) or None to not pause.
        encoding: How deltas store their changes (an `Encoding`, or its value): `"raw"`
            (the published TRL format, 6 bytes per changed element) or `"compact"`
            (entropy-coded against the weights replicas hold, typically under 1 byte per
            changed element, for a few nanoseconds of CPU per model element on each side:
            worth it on links below a few hundred Mbit/s or where bytes are billed;
            sharded trainers code each rank's block).
        signing_key: Path (or PEM text) of the Ed25519 key that signs every version
            (`delta-sync keygen`); default: `DELTA_SYNC_SIGNING_KEY`, else unsigned.
        bucket_id: The bucket's name in signed statements (see `PublisherOptions.bucket_id`);
            default: `DELTA_SYNC_BUCKET_ID`, else the bucket's URL.
        pointer_refresh: Seconds without a new version after which `latest.json` is
            written again, so replicas can tell the trainer is alive (see
            `PublisherOptions.pointer_refresh`); None never.
        vllm_token: The replicas' weight-route token (`vllm_ext.auth` middleware), sent as
            `X-Delta-Sync-Token`; default: `DELTA_SYNC_API_TOKEN`, if set.
        vllm_headers: HTTP headers for every request to the replicas, e.g.
            `{"Authorization": "Bearer hf_..."}` for a private Space.
        peft_publish: What a PEFT LoRA model is published as: `"merged"` (the base
            checkpoint with the adapter merged, as anchors and deltas) or `"adapter"` (the
            adapter itself per version, for `vllm serve --enable-lora`; see docs/peft.md).
            A model that is no PEFT LoRA model is refused in adapter mode.
        adapter_name: In adapter mode, the name replicas serve the adapter under (vLLM's
            `lora_name`): requests name it as their `model`, as TRL's generation requests
            then do.
    """

    # The publisher's and the replicas' defaults are theirs (`PublisherOptions`, `ReplicaOptions`).
    bucket: str = "./delta-sync"
    sync_every: int = 1
    anchor_every: int = PublisherOptions.anchor_every
    anchor_bytes_ratio: float | None = PublisherOptions.anchor_bytes_ratio
    keep_anchors: int = PublisherOptions.keep_anchors
    background: bool = PublisherOptions.background
    max_pending: int = PublisherOptions.max_pending
    run_id: str | None = PublisherOptions.run_id
    snapshot_device: str | None = None
    host_mirror: bool | None = None
    overwrite: bool = PublisherOptions.overwrite
    vllm_url: str | list[str] | None = None
    max_staleness: int = 0
    sync_timeout: float = 600.0
    vllm_request_timeout: float = ReplicaOptions.timeout
    vllm_retry_seconds: float = ReplicaOptions.retry_seconds
    vllm_pause_mode: PauseMode | None = ReplicaOptions.pause_mode
    vllm_headers: dict[str, str] | None = None
    vllm_token: str | None = ReplicaOptions.token
    encoding: Encoding = PublisherOptions.encoding
    signing_key: str | None = None
    bucket_id: str | None = PublisherOptions.bucket_id
    pointer_refresh: float | None = PublisherOptions.pointer_refresh
    peft_publish: PeftPublish = PublisherOptions.peft_publish
    adapter_name: str = "delta-sync-adapter"

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        # Checked once, here; option strings become their enums.
        self.encoding = self.publisher_options.encoding
        self.vllm_pause_mode = self.replica_options.pause_mode
        self.peft_publish = self.publisher_options.peft_publish
        if not isinstance(self.adapter_name, str) or not self.adapter_name.strip():
            raise ValueError(f"adapter_name must be a non-empty string, got {self.adapter_name!r}")

    @property
    def publisher_options(self) -> PublisherOptions:
        """The [`Publisher`]'s share of this config."""
        return PublisherOptions(**{field.name: getattr(self, field.name) for field in fields(PublisherOptions)})

    @property
    def replica_options(self) -> ReplicaOptions:
        """The `vllm_*` fields, as each replica's client takes them."""
        return ReplicaOptions(**{option: getattr(self, field) for option, field in _REPLICA_FIELDS.items()})

    @property
    def vllm_urls(self) -> list[str]:
        if self.vllm_url is None:
            return []
        return [self.vllm_url] if isinstance(self.vllm_url, str) else list(self.vllm_url)


class DeltaSyncCallback(TrainerCallback):
    """Publishes the model's weights to a bucket as anchors and sparse deltas while training.

    At train begin it hooks the real optimizer with a [`BF16ChangeDetector`]; after every
    `sync_every` optimizer steps it publishes the new version through a [`Publisher`];
    at train end it publishes what is left and waits for the uploads.

    A PEFT model (e.g. TRL's trainers given `peft_config=LoraConfig(...)`) is published
    merged: the base model with the adapter merged in, under the base checkpoint's names
    (see `delta_sync.trainer.merged`); a model whose names a replica could not load is
    refused here, before anything is written.

    With `vllm_url`, or when TRL's `GRPOTrainer` runs with `use_vllm=True,
    vllm_mode="server"`, every stored version is announced to the vLLM replicas (running
    `vllm_ext`), which fetch it from the bucket themselves. In TRL's server mode the
    callback replaces TRL's NCCL weight sync entirely and, before each generation, waits
    until the replicas are at most `max_staleness` versions behind (see
    `delta_sync.trainer.trl_vllm`).

    Metrics: on each training log (the one with `loss`) the callback adds to the trainer's
    `logs`, averaged over the versions stored since the last log: `delta/version` (newest),
    `delta/sparsity`, `delta/changed_elements`, `delta/bytes` (all files written),
    `delta/delta_bytes` (the delta file alone), `delta/sync_seconds` (detect + encode +
    upload), `delta/detect_seconds` (the part that blocks training), `delta/catch_up_bytes`
    (what a replica joining now downloads: the newest anchor and the deltas after it) and, with replicas,
    `delta/replica_wait_seconds` and `delta/replicas_behind`. transformers hands one `logs`
    dict to its callbacks in turn, so the metrics reach:

    * the printed logs (transformers' progress bar or `PrinterCallback`, registered after
      the callbacks passed as `callbacks=[...]`) and every callback listed after this one;
    * not the reporting integrations that `report_to` turns on (W&B, TensorBoard, ...):
      transformers registers them before the user's callbacks. To report the metrics
      there, set `report_to="none"` and list the integrations after this callback:
      `callbacks=[DeltaSyncCallback(...), *get_reporting_integration_callbacks(["wandb"])]`
      (from `transformers.integrations`);
    * not `trainer.state.log_history`, which keeps its copy of a log before callbacks see
      it. [`DeltaSyncCallback.reports`] holds every version's numbers instead.

    Args:
        config: A [`DeltaSyncConfig`]; or pass its fields as keyword arguments.

    Example:
        ```python
        >>> from trl import GRPOConfig, GRPOTrainer
        >>> trainer = GRPOTrainer(
        ...     model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset,
        ...     callbacks=[DeltaSyncCallback(bucket="./deltas", anchor_every=10)],
        ... )
        >>> trainer.train()
        ```
    """

    def __init__(self, config: DeltaSyncConfig | None = None, **kwargs) -> None:
        if config is not None and kwargs:
            raise TypeError("pass either a DeltaSyncConfig or keyword arguments, not both")
        known = {f.name for f in fields(DeltaSyncConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown DeltaSyncCallback option(s) {unknown}; known: {sorted(known)}")
        self.config = config or DeltaSyncConfig(**kwargs)
        self.detector: BF16ChangeDetector | None = None
        self.publisher: Publisher | AdapterPublisher | None = None
        self.replicas: ReplicaSet | None = None
        self._vllm_generation: VLLMGeneration | None = None
        self._logged = 0
        self._sync_metrics: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        model = kwargs.get("model")
        if model is not None and _uses_vllm_server(args):
            # TRL builds its vLLM client after this event; take over its weight sync.
            trl_vllm.claim(model, self)

    def attach_vllm_generation(self, generation: VLLMGeneration) -> None:
        """Called by TRL's vLLM generation backend once it is connected (see `trl_vllm`)."""
        self._vllm_generation = generation

    def vllm_request_headers(self) -> dict[str, str]:
        """What TRL's own vLLM client sends too (see `trl_vllm`): the token and `vllm_headers`."""
        return self.config.replica_options.request_headers()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if _uses_vllm_server(args):
            if self._vllm_generation is None:
                raise RuntimeError(
                    "DeltaSyncCallback could not take over TRL's vLLM weight sync; pass the callback "
                    "when constructing the trainer (callbacks=[...]), not with add_callback()"
                )
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise RuntimeError("DeltaSyncCallback needs the model and optimizer at train begin")
        config = self.config
        _refuse_independent_trainers(args, config.bucket)
        if config.peft_publish == PeftPublish.ADAPTER:
            self._begin_adapter_mode(state, model)
            return
        # Every rank decides the layout (refusing any that cannot be published exactly) and
        # checks it against the others before anything is written, but only a rank that
        # publishes builds a detector: its snapshot and host mirror are a model's worth of
        # device and host memory, which with whole parameters (DDP, ZeRO-1/2) every rank but
        # rank 0 would copy only to drop again (8 ranks x 16 GB of host memory for an 8B model).
        layout, named_parameters = published_layout(model)
        verify_across_ranks(layout, named_parameters.items())
        if not (layout.sharded or state.is_world_process_zero):
            return  # whole parameters: rank 0 publishes them alone
        self.detector = BF16ChangeDetector(
            model,
            optimizer,
            snapshot_device=config.snapshot_device,
            host_mirror=config.host_mirror,
            layout=layout,
        )
        self.publisher = Publisher(
            config.bucket, self.detector, config.publisher_options, on_published=[self._announce]
        )
        if not state.is_world_process_zero:
            return  # rank 0 alone drives the replicas
        urls = config.vllm_urls
        if not urls and self._vllm_generation is not None:
            urls = [self._vllm_generation.vllm_client.base_url]
        if urls:
            self.replicas = ReplicaSet(urls, self.publisher.bucket.url, config.replica_options)
        logger.info(
            "delta-sync: publishing to %s every %d step(s), anchor every %d version(s), run %s",
            self.publisher.bucket.url,
            config.sync_every,
            config.anchor_every,
            self.publisher.run_id,
        )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.detector is not None and not self.detector.hooked:
            self.detector.record_step()  # DeepSpeed's optimizer cannot be hooked
        if self.publisher is not None and state.global_step % self.config.sync_every == 0:
            self._publish(state.global_step)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs,
    ):
        if self.publisher is None or logs is None or "loss" not in logs:
            return
        reports = self.publisher.reports[self._logged :]
        if not reports:
            return
        self._logged += len(reports)
        logs.update({**_metrics(reports), **self._sync_metrics})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.publisher is None:
            return
        try:
            self._publish(state.global_step)
            self.publisher.close()
            if self.replicas is not None and self.publisher.last_version is not None:
                self._wait_for_replicas(self.publisher.last_version)
        finally:
            if self.detector is not None:
                self.detector.close()
            if self.replicas is not None:
                self.replicas.close()

    # -- vLLM replicas ----------------------------------------------------------------------

    def _announce(self, report: PublishReport) -> None:
        if self.replicas is not None:
            self.replicas.announce(report.version, report.delta, report.model_checksum)

    def sync_vllm_weights(self) -> None:
        """Run by TRL right before a generation: wait until the replicas are recent enough.

        Replaces TRL's own `sync_weights` (see `delta_sync.trainer.trl_vllm`). Versions are
        published after each optimizer step and replicas fetch them in the background;
        this waits only for what `max_staleness` requires.
        """
        if self.publisher is None or self.replicas is None or self.publisher.last_version is None:
            return
        target = self.publisher.last_version - self.config.max_staleness
        if isinstance(self.publisher, AdapterPublisher):
            # A server serves no adapter under the name before its first load (a request
            # naming it fails): whatever the staleness, the first version must be there.
            target = max(target, self.publisher.first_version)
        self._wait_for_replicas(target)

    def _wait_for_replicas(self, version: int) -> None:
        assert self.replicas is not None and self.publisher is not None
        started = time.perf_counter()
        behind = self.replicas.wait(version, timeout=self.config.sync_timeout)
        for state in behind:
            logger.warning(
                "delta-sync: replica %s is not at version %d (serves %s): %s",
                state.url,
                version,
                state.version,
                state.error or "timed out",
            )
        self._sync_metrics = {
            "delta/replica_wait_seconds": time.perf_counter() - started,
            "delta/replicas_behind": len(behind),
        }

    # -- helpers --------------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        assert self.publisher is not None
        last = self.publisher.last_version
        if last is not None and version <= last:
            return
        if self.detector is not None and self.detector.steps_pending == 0:
            return  # no optimizer step since the last version (e.g. a skipped step)
        self.publisher.publish(version)

    # -- adapter mode ---------------------------------------------------------------------

    def _begin_adapter_mode(self, state: TrainerState, model) -> None:
        """Publish the PEFT adapter itself (`delta_sync.trainer.adapter`): no detector; rank 0
        publishes the whole adapter, first as it is now, since TRL generates before the
        first optimizer step; replicas load it under `adapter_name`."""
        config = self.config
        if self._vllm_generation is not None:
            # TRL's client names `model` in every generation request: the adapter's name
            # routes them through the adapter (on every rank: each generates).
            self._vllm_generation.vllm_client.model = config.adapter_name
        if not state.is_world_process_zero:
            return
        self.publisher = AdapterPublisher(config.bucket, model, config.publisher_options, on_published=[self._announce])
        urls = config.vllm_urls
        if not urls and self._vllm_generation is not None:
            urls = [self._vllm_generation.vllm_client.base_url]
        if urls:
            self.replicas = ReplicaSet(
                urls, self.publisher.bucket.url, config.replica_options, adapter_name=config.adapter_name
            )
        logger.info(
            "delta-sync: publishing the LoRA adapter to %s every %d step(s) (served as %r), run %s",
            self.publisher.bucket.url,
            config.sync_every,
            config.adapter_name,
            self.publisher.run_id,
        )
        self.publisher.publish(state.global_step)

    @property
    def reports(self) -> list[PublishReport]:
        """Every version published so far (stored ones only, in order)."""
        return [] if self.publisher is None else list(self.publisher.reports)


def published_layout(model: nn.Module) -> tuple[ModelLayout, dict[str, nn.Parameter]]:
    """What a rank publishes, found without copying a weight: the model's [`ModelLayout`] and
    its parameters by checkpoint name, as [`BF16ChangeDetector`] names them (a PEFT model's
    as its merged weights), with the same refusals of names and layouts it would make.

    Every rank runs it, so a refusal stops all ranks alike; the ranks that publish hand the
    layout on to their detector.
    """
    merged = merged_weights(model)
    params = checkpoint_tensors(model, merged)
    root = model if merged is None else merged.root
    check_checkpoint_names(params, root)
    layout = describe_model(params.items(), model)
    CheckpointLayout.of(root, layout.shapes).published_layout(layout)
    return layout, params


def _refuse_independent_trainers(args: TrainingArguments, bucket: str) -> None:
    """Refuse N processes of one launch that each train alone (e.g. Accelerate started with
    torchrun on a CPU host without `use_cpu=True`): each would publish its own trajectory."""
    import torch.distributed as dist

    trainer_world = getattr(args, "world_size", None)
    if not (dist.is_available() and dist.is_initialized()) or trainer_world is None:
        return
    if trainer_world != dist.get_world_size():
        raise UnsupportedLayoutError(
            f"the trainer runs as {trainer_world} process(es) but torch.distributed has {dist.get_world_size()} "
            f"ranks: each rank would train alone and publish to {bucket}. On a host without accelerators set "
            "use_cpu=True in the training arguments, or launch with a configuration where Accelerate runs DDP, "
            "FSDP2 or DeepSpeed"
        )


def _metrics(reports: list[PublishReport]) -> dict[str, float]:
    count = len(reports)
    return {
        "delta/version": reports[-1].version,
        "delta/sparsity": sum(r.sparsity for r in reports) / count,
        "delta/changed_elements": sum(r.changed_elements for r in reports) / count,
        "delta/bytes": sum(r.bytes_written for r in reports) / count,
        "delta/delta_bytes": sum(r.delta_bytes for r in reports) / count,
        "delta/sync_seconds": sum(r.detect_seconds + r.publish_seconds for r in reports) / count,
        "delta/detect_seconds": sum(r.detect_seconds for r in reports) / count,
        "delta/catch_up_bytes": reports[-1].catch_up_bytes,
    }


def _uses_vllm_server(args: TrainingArguments) -> bool:
    """Whether TRL will generate through a vLLM server (`GRPOConfig`, `RLOOConfig`)."""
    return getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "server"
