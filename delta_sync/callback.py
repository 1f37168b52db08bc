"""`DeltaSyncCallback`: delta weight sync for any `transformers.Trainer`, including TRL's trainers."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, fields

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from .detector import BF16ChangeDetector
from .publisher import PublishReport, Publisher

__all__ = ["DeltaSyncCallback", "DeltaSyncConfig"]

logger = logging.getLogger("delta_sync")


@dataclass
class DeltaSyncConfig:
    """Configuration of [`DeltaSyncCallback`].

    Args:
        bucket: Where to publish: a local directory or `file://` URL.
        sync_every: Publish a version every this many optimizer steps (the version number
            is the trainer's `global_step`).
        anchor_every: Write a full anchor every this many versions, besides the first.
        keep_anchors: Anchors to keep in the bucket; older files are deleted.
        background: Encode and upload on a worker thread, overlapping the next step.
        max_pending: Versions that may wait for the worker before training blocks.
        run_id: Identifier recorded in every file; random when None.
        snapshot_device: Where the detector keeps its bf16 snapshot (default: with the
            parameters). `"cpu"` saves accelerator memory at the cost of a copy per sync.
        overwrite: Delete another run's files found under `bucket` instead of refusing to
            start.
    """

    bucket: str = "./delta-sync"
    sync_every: int = 1
    anchor_every: int = 10
    keep_anchors: int = 2
    background: bool = True
    max_pending: int = 2
    run_id: str | None = None
    snapshot_device: str | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")


class DeltaSyncCallback(TrainerCallback):
    """Publishes the model's weights to a bucket as anchors and sparse deltas while training.

    At train begin it hooks the real optimizer with a [`BF16ChangeDetector`]; after every
    `sync_every` optimizer steps it publishes the new version through a [`Publisher`];
    at train end it publishes what is left and waits for the uploads. Metrics
    join the trainer's own logs, averaged over the versions stored since the last log:
    `delta/version` (newest), `delta/sparsity`, `delta/changed_elements`, `delta/bytes`
    (all files written), `delta/delta_bytes` (the delta file alone), `delta/sync_seconds`
    (detect + encode + upload) and `delta/detect_seconds` (the part that blocks training).

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
        self.publisher: Publisher | None = None
        self._logged = 0

    # -- lifecycle ------------------------------------------------------------------------

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        # Our metrics are added to `logs` in on_log; run first so that printers and reporting
        # integrations (registered before user callbacks) see them.
        handler = _dispatching_handler()
        if handler is not None and self in handler.callbacks:
            handler.callbacks.remove(self)
            handler.callbacks.insert(0, self)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero:
            return
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise RuntimeError("DeltaSyncCallback needs the model and optimizer at train begin")
        config = self.config
        self.detector = BF16ChangeDetector(model, optimizer, snapshot_device=config.snapshot_device)
        self.publisher = Publisher(
            config.bucket,
            self.detector,
            anchor_every=config.anchor_every,
            keep_anchors=config.keep_anchors,
            background=config.background,
            max_pending=config.max_pending,
            run_id=config.run_id,
            overwrite=config.overwrite,
        )
        logger.info(
            "delta-sync: publishing to %s every %d step(s), anchor every %d version(s), run %s",
            self.publisher.bucket.url,
            config.sync_every,
            config.anchor_every,
            self.publisher.run_id,
        )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.publisher is not None and state.global_step % self.config.sync_every == 0:
            self._publish(state.global_step)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if self.publisher is None or logs is None or "loss" not in logs:
            return
        reports = self.publisher.reports[self._logged :]
        if not reports:
            return
        self._logged += len(reports)
        metrics = _metrics(reports)
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.publisher is None:
            return
        try:
            self._publish(state.global_step)
            self.publisher.close()
        finally:
            assert self.detector is not None
            self.detector.close()

    # -- helpers --------------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        assert self.publisher is not None and self.detector is not None
        last = self.publisher.last_version
        if self.detector.steps_pending == 0 or (last is not None and version <= last):
            return  # no optimizer step since the last version (e.g. a skipped step)
        self.publisher.publish(version)

    @property
    def reports(self) -> list[PublishReport]:
        """Every version published so far (stored ones only, in order)."""
        return [] if self.publisher is None else list(self.publisher.reports)


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
    }


def _dispatching_handler() -> CallbackHandler | None:
    """The `CallbackHandler` that is calling the current event, found on the call stack.

    transformers hands callbacks no reference to the trainer or the handler; the
    handler's `call_event` is always a few frames up when an event runs.
    """
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, CallbackHandler):
            return candidate
        frame = frame.f_back
    return None
