"""`NodeSnapshot`: one snapshot of the model per machine, shared by its replica processes.

Every vLLM worker needs the full weights of the version it loads (tensor-parallel
ranks cut their own shard out of them), but a node running eight workers should not hold
eight copies. The node snapshot is one memory-mapped file that every process on the
machine maps (`MAP_SHARED`: one copy in the page cache however many map it), advanced by
one process at a time under an exclusive `flock` while the others wait.

Processes need not hold the same version: a worker asked for version 7 while another
server on the node has already moved the snapshot to 9 rebuilds the tensors it loads at
version 7 from *undo records*, the values each recent delta overwrote, kept on disk for
the last `history` versions. Beyond those, or across an anchor, an older version cannot
be rebuilt and the request fails with [`SnapshotMovedError`]; a catch-up then brings the
worker to the snapshot's version.

Crash safety: before a process changes the data it writes the undo record and marks the
state `writing`. A process killed mid-write leaves that mark; the next one to take the lock
restores the overwritten values from the record (or, for an anchor, which has no undo,
empties the snapshot so that the next update loads an anchor), so no process ever reads a
half-written version. The state also names the machine's boot: after a reboot, whatever
the page cache had not yet written back is not trusted.

Files in the snapshot's directory:

| file | what it holds |
| --- | --- |
| `weights.bin` | every tensor's bf16 values, in name order, 64-byte aligned |
| `float32-<digest>.bin` | the float32 values of the tensors that travel in float32 (the state's `float32`), in name order, 64-byte aligned |
| `state.json` | version, run, epoch, per-tensor checksums, history, `writing` mark, the tensors held in float32 |
| `undo/<version>.safetensors` | the flat `indices` and `values` every tensor that version changed held before it, concatenated in the order of the metadata's `names` (`[[name, count], ...]`); those of float32 tensors in `indices_f32`, `values_f32` and `names_f32` |
| `lock` | the `flock` that orders writers and readers |

Which tensors are float32 is the bucket's to say (its files' `dtypes`), so each anchor sets it:
an anchor whose float32 tensors differ from the snapshot's puts them in a file of their own,
named after them, while processes that still map the previous one keep reading it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import IntegrityError, SnapshotMovedError
from ..integrity import model_checksum, tensor_checksum
from ..sparse import scatter_
from ..version import HeldVersion, VersionId

__all__ = ["HistoryEntry", "NodeSnapshot", "SnapshotState", "mapped_memory", "snapshot_directory"]

logger = logging.getLogger(__name__)

_STATE_FORMAT = 3  # 2: one undo record holds every tensor's changes in two tensors; 3: float32 tensors
_ALIGN = 64  # bytes: tensors start on 64-byte boundaries
_DATA, _STATE, _LOCK, _UNDO = "weights.bin", "state.json", "lock", "undo"
_FLOAT32_SUFFIX = "_f32"  # of an undo record's entries for the float32 tensors


def snapshot_directory(root: str | os.PathLike, bucket_url: str, shapes: Mapping[str, tuple[int, ...]]) -> Path:
    """The directory of the node snapshot for one bucket and one parameter layout.

    Replicas of the same model following the same bucket share it; another bucket or
    another model gets its own, so they never overwrite each other's weights.
    """
    key = hashlib.sha256(f"{bucket_url.rstrip('/')}\n{_layout_digest(shapes)}".encode()).hexdigest()[:16]
    return Path(root) / key


@dataclass(frozen=True)
class HistoryEntry:
    """One version a snapshot held recently: what it changed, so that a model holding an
    older version loads only that.

    Args:
        held: The version and every parameter's checksum at it.
        kind: `"anchor"` (every tensor written, nothing older can be rebuilt) or `"delta"`.
        names: Parameters this version changed.
    """

    held: HeldVersion
    kind: str
    names: tuple[str, ...]

    @property
    def version(self) -> int:
        return self.held.version


@dataclass
class SnapshotState:
    """What `state.json` says of the snapshot's data.

    Args:
        held: The version held with its per-parameter checksums, or None (nothing
            trustworthy yet).
        anchor_needed: Why the next update must load an anchor, or None.
        history: The last versions held, oldest first, ending with `held` (all of the same
            run and start: an anchor clears it).
        writing: `{"version", "kind"}` while a process changes the data, else None.
        boot_id: The machine boot that wrote the state.
        float32: The tensors held in float32 (sorted), as the last anchor carried them;
            every other one is bf16.
    """

    held: HeldVersion | None = None
    anchor_needed: str | None = None
    history: list[HistoryEntry] = field(default_factory=list)
    writing: dict | None = None
    boot_id: str = ""
    float32: tuple[str, ...] = ()

    @property
    def version(self) -> int | None:
        return None if self.held is None else self.held.version

    def entry(self, version: int | None) -> HistoryEntry | None:
        return next((entry for entry in self.history if entry.version == version), None)

    def to_json(self) -> str:
        held = self.held
        data = {
            "format": _STATE_FORMAT,
            "version": None if held is None else held.version,
            "anchor_version": None if held is None else held.id.anchor_version,
            "run_id": None if held is None else held.id.run_id,
            "epoch": None if held is None else held.id.epoch,
            "checksums": {} if held is None else _dump(held.checksums),
            "anchor_needed": self.anchor_needed,
            "history": [
                {
                    "version": entry.version,
                    "kind": entry.kind,
                    "anchor_version": entry.held.id.anchor_version,
                    "names": list(entry.names),
                    "checksums": _dump(entry.held.checksums),
                }
                for entry in self.history
            ],
            "writing": self.writing,
            "boot_id": self.boot_id,
            "float32": list(self.float32),
        }
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> SnapshotState:
        data = json.loads(text)
        if data.get("format") != _STATE_FORMAT:
            raise ValueError(f"state format {data.get('format')!r}, this version of delta-sync keeps {_STATE_FORMAT}")
        held = None
        if data["version"] is not None:
            identity = VersionId(data["version"], data["anchor_version"], data["run_id"], data["epoch"] or "")
            held = HeldVersion(identity, _load(data["checksums"]))
        history = [
            HistoryEntry(
                HeldVersion(
                    VersionId(entry["version"], entry["anchor_version"], held.id.run_id, held.id.epoch),
                    _load(entry["checksums"]),
                ),
                entry["kind"],
                tuple(entry["names"]),
            )
            for entry in (data["history"] if held is not None else [])
        ]
        return cls(held, data["anchor_needed"], history, data["writing"], data["boot_id"], tuple(data["float32"]))


def _dump(checksums: Mapping[str, int]) -> dict[str, str]:
    return {name: str(value) for name, value in checksums.items()}


def _load(checksums: Mapping[str, str]) -> dict[str, int]:
    return {name: int(value) for name, value in checksums.items()}


class NodeSnapshot:
    """A snapshot in memory-mapped files, shared by every process of a machine: bf16, and
    float32 for the tensors the bucket carries in float32.

    A writer holds [`exclusive`] while it changes the data and announces each change with
    [`begin_delta`] or [`begin_anchor`] before it writes, and [`finish`] after; readers
    hold [`shared`] while they read the tensors of a version with [`tensors_at`].

    Args:
        directory: The snapshot's directory (see [`snapshot_directory`]); created if absent.
        shapes: Parameter name -> shape: the layout of the file.
        history: How many recent versions can be rebuilt for a process that asks for one
            the snapshot has moved past.

    Example:
        ```python
        >>> node = NodeSnapshot(snapshot_directory(root, bucket.url, shapes), shapes)
        >>> with node.shared() as state:
        ...     tensors = node.tensors_at(state, 7, ["lm_head.weight"])
        ```
    """

    def __init__(self, directory: str | os.PathLike, shapes: Mapping[str, tuple[int, ...]], *, history: int = 8):
        if history < 1:
            raise ValueError("history must keep at least the version held")
        self.directory = Path(directory)
        self.history = history
        self.shapes = {name: tuple(shape) for name, shape in sorted(shapes.items())}
        (self.directory / _UNDO).mkdir(parents=True, exist_ok=True)
        # 0666 less the umask, like every file of the snapshot (its tensors, state and undo records).
        self._lock_fd = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        self._views: dict[str, torch.Tensor] = {}
        self._float32: tuple[str, ...] = ()
        self._float32_bytes = 0
        with self._locked(fcntl.LOCK_EX):
            self._bf16_bytes = self._map(self.path, self.shapes, torch.bfloat16)
        self._state: SnapshotState | None = None

    @property
    def nbytes(self) -> int:
        """Size of the data files this process maps."""
        return self._bf16_bytes + self._float32_bytes

    @property
    def path(self) -> Path:
        """The memory-mapped data file."""
        return self.directory / _DATA

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter as a view of the shared file, at whatever version it holds now."""
        return self._views

    def close(self) -> None:
        """Release the lock file (the mapping stays valid while views of it live)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- locks ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[SnapshotState]:
        """Hold the snapshot alone to change it; yields its state, recovered from any
        write a crashed process left half done."""
        with self._locked(fcntl.LOCK_EX):
            state = self._read_state()
            self._state = state if state.writing is None else self._recover(state)
            self._hold_in_float32(self._state.float32)
            try:
                yield self._state
            finally:
                self._state = None

    @contextlib.contextmanager
    def shared(self) -> Iterator[SnapshotState]:
        """Hold the snapshot against writers to read it; yields its state."""
        with self._locked(fcntl.LOCK_SH):
            state = self._read_state()
            if state.writing is not None:
                # A writer died mid-write and nobody has recovered yet: nothing here is a version.
                state = SnapshotState(boot_id=state.boot_id)
            self._hold_in_float32(state.float32)
            yield state

    # -- writing (under `exclusive`) ------------------------------------------------------------

    def begin_delta(self, version: int, previous: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Announce a delta: store the values it overwrites, then mark the data as being written.

        Args:
            version: The version the delta produces.
            previous: Parameter name -> (flat indices, values there now, of the tensor's dtype).
        """
        tensors, metadata = {}, {}
        for suffix, dtype in (("", torch.bfloat16), (_FLOAT32_SUFFIX, torch.float32)):
            names = [name for name, (_, values) in previous.items() if values.dtype == dtype]
            if names:
                # Two tensors per dtype whatever the model's size: a record per tensor cost the
                # prefetch thread a Python round trip (and a wait for vLLM's thread to hand back
                # the GIL) per changed tensor.
                indices = torch.cat([previous[name][0] for name in names]).to(torch.int64)
                values = torch.cat([previous[name][1] for name in names])
            else:
                indices, values = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dtype)
            tensors |= {f"indices{suffix}": indices, f"values{suffix}": values}
            metadata[f"names{suffix}"] = json.dumps([[name, previous[name][0].numel()] for name in names])
        target = self._undo_path(version)
        temporary = target.with_suffix(".tmp")
        # save_file writes without the GIL, but creates 0600 files: the record takes the
        # data file's permissions (0666 less the umask), so that every replica user reads it.
        save_file(tensors, str(temporary), metadata=metadata)
        os.chmod(temporary, os.stat(self.path).st_mode & 0o777)
        os.replace(temporary, target)
        self._mark_writing(version, "delta")

    def begin_anchor(self, version: int, float32: Iterable[str] = ()) -> None:
        """Announce an anchor: every tensor is about to be overwritten, so no version held
        before it can be rebuilt any more.

        Args:
            version: The anchor's version.
            float32: The tensors it carries in float32: from now on held in float32.
        """
        state = self._writer_state()
        dropped, state.history = state.history, []
        # Marked first: a process killed while the records go leaves a state that says so.
        self._mark_writing(version, "anchor")
        for entry in dropped:
            self._undo_path(entry.version).unlink(missing_ok=True)
        float32 = tuple(sorted(float32))
        if float32 != state.float32:
            unknown = sorted(set(float32) - set(self.shapes))
            if unknown:
                raise ValueError(f"{self.directory}: no tensor {unknown[0]!r} in the snapshot's layout")
            previous = state.float32
            self._hold_in_float32(float32)
            state.float32 = float32
            self._write_state(state)
            if previous:
                self._float32_path(previous).unlink(missing_ok=True)  # processes that map it keep their pages

    def finish(self, held: HeldVersion, *, kind: str, names: Iterable[str]) -> None:
        """Record the version the data now holds and forget the oldest beyond `history`.

        Args:
            held: The version written, with every parameter's checksum.
            kind: `"anchor"` or `"delta"`.
            names: Parameters it changed.
        """
        state = self._writer_state()
        if kind == "anchor":
            state.history = []
        held = HeldVersion(held.id, dict(held.checksums))
        state.history.append(HistoryEntry(held, kind, tuple(sorted(names))))
        dropped, state.history = state.history[: -self.history], state.history[-self.history :]
        state.held = held
        state.writing = None
        # The state stops naming the oldest versions before their records go.
        self._write_state(state)
        for entry in dropped:
            self._undo_path(entry.version).unlink(missing_ok=True)

    def save(self, *, anchor_needed: str | None) -> None:
        """Record why the next update must load an anchor (None: it need not)."""
        state = self._writer_state()
        if state.anchor_needed != anchor_needed:
            state.anchor_needed = anchor_needed
            self._write_state(state)

    # -- reading (under `shared` or `exclusive`) ------------------------------------------------

    def tensors_at(
        self, state: SnapshotState, version: int, names: Iterable[str], checksums: Mapping[str, int]
    ) -> dict[str, torch.Tensor]:
        """The tensors `names` as they were at `version`: views of the file when it holds
        that version, otherwise copies rebuilt from the undo records and checked against
        `checksums` (the version's own).

        Args:
            state: The state [`shared`] or [`exclusive`] yielded.
            version: The version wanted.
            names: Parameters wanted.
            checksums: Every parameter's checksum at `version`, as the caller holds it.

        Raises:
            SnapshotMovedError: The snapshot no longer holds that version nor can rebuild it.
            IntegrityError: A rebuilt tensor does not match its checksum.
        """
        names = sorted(names)
        entry = state.entry(version)
        if entry is None or entry.held.model_checksum != model_checksum(checksums):
            raise self.moved_past(state, version)
        if version == state.version:
            return {name: self._views[name] for name in names}
        newer = [e.version for e in state.history if e.version > version]
        try:
            records = [_read_undo(self._undo_path(v)) for v in sorted(newer, reverse=True)]
        except FileNotFoundError:  # a record another process removed: the version is out of reach
            raise self.moved_past(state, version) from None
        rebuilt = {}
        for name in names:
            tensor = self._views[name].clone()
            for record in records:
                if name in record:
                    scatter_(tensor, *record[name])
            if tensor_checksum(tensor) != checksums[name]:
                raise IntegrityError(f"{self.directory}: {name!r} rebuilt at version {version} fails its checksum")
            rebuilt[name] = tensor
        return rebuilt

    def positions(self, version: int) -> dict[str, torch.Tensor]:
        """The flat positions the delta producing `version` changed, per parameter, from its
        undo record (under [`shared`] or [`exclusive`]).

        Raises:
            SnapshotMovedError: The record is gone (the version left the history).
        """
        try:
            record = _read_undo(self._undo_path(version))
        except FileNotFoundError:
            raise SnapshotMovedError(
                f"{self.directory}: no undo record of version {version}", held=None, wanted=version
            ) from None
        return {name: indices for name, (indices, _) in record.items()}

    def moved_past(self, state: SnapshotState, version: int) -> SnapshotMovedError:
        """The error for a version the snapshot can no longer rebuild."""
        held = "nothing" if state.version is None else f"version {state.version}"
        return SnapshotMovedError(
            f"{self.directory}: the node's snapshot holds {held} and can no longer rebuild version {version} "
            f"(it keeps the last {self.history}, none across an anchor); catch up to the newest version instead",
            held=state.version,
            wanted=version,
        )

    # -- internals ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        fcntl.flock(self._lock_fd, mode)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _map(self, path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> int:
        """Map a data file of `shapes` (in name order, each tensor 64-byte aligned) as
        `dtype`, creating it at its size (sparse: no memory until written); returns its size.
        A new file means no version is held: the state says so."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        offsets, numel = {}, 0
        for name, shape in sorted(shapes.items()):
            offsets[name] = numel
            numel += -(-math.prod(shape) * itemsize // _ALIGN) * _ALIGN // itemsize
        nbytes = numel * itemsize
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides
        try:
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
                if dtype == torch.bfloat16:
                    self._write_state(SnapshotState(boot_id=_boot_id()))
        finally:
            os.close(fd)
        if numel:
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
            self._views |= {
                name: flat[offset : offset + math.prod(shapes[name])].view(shapes[name])
                for name, offset in offsets.items()
            }
        return nbytes

    def _hold_in_float32(self, names: tuple[str, ...]) -> None:
        """Map the float32 tensors of the state (their file is created by the anchor that
        first carries them), and the others from the bf16 file, if not mapped so already."""
        if names == self._float32:
            return
        self._bf16_bytes = self._map(self.path, self.shapes, torch.bfloat16)
        self._float32_bytes = 0
        if names:
            shapes = {name: self.shapes[name] for name in names}
            self._float32_bytes = self._map(self._float32_path(names), shapes, torch.float32)
        self._float32 = names

    def _float32_path(self, names: tuple[str, ...]) -> Path:
        digest = hashlib.sha256(json.dumps(names).encode()).hexdigest()[:16]
        return self.directory / f"float32-{digest}.bin"

    def _writer_state(self) -> SnapshotState:
        if self._state is None:
            raise RuntimeError("the node snapshot is changed only under exclusive()")
        return self._state

    def _mark_writing(self, version: int, kind: str) -> None:
        state = self._writer_state()
        state.writing = {"version": version, "kind": kind}
        self._write_state(state)

    def _recover(self, state: SnapshotState) -> SnapshotState:
        """Undo a write a crashed process left half done; returns the state recovered."""
        version, kind = state.writing["version"], state.writing["kind"]
        record = self._undo_path(version)
        if kind == "delta" and record.is_file():
            # The record was stored before the first value was overwritten: restoring it
            # is right however far the write got.
            for name, (indices, values) in _read_undo(record).items():
                scatter_(self._views[name], indices, values)
            record.unlink()
            state.writing = None
            logger.warning(
                "delta-sync: a process died writing version %s; the node snapshot is back at version %s",
                version,
                state.version,
            )
        else:
            for entry in state.history:
                self._undo_path(entry.version).unlink(missing_ok=True)
            # What the anchor had begun holding in float32 stays so: the next anchor decides.
            state = SnapshotState(boot_id=state.boot_id, float32=state.float32)
            logger.warning(
                "delta-sync: a process died writing anchor v%s; the node snapshot waits for an anchor", version
            )
        self._write_state(state)
        return state

    def _read_state(self) -> SnapshotState:
        try:
            state = SnapshotState.from_json((self.directory / _STATE).read_text())
        except FileNotFoundError:
            return SnapshotState(boot_id=_boot_id())
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("delta-sync: %s is unreadable (%s); the node snapshot starts empty", _STATE, exc)
            return SnapshotState(boot_id=_boot_id())
        if state.boot_id != _boot_id():
            # Written before the machine restarted: the data may not have reached the disk.
            return SnapshotState(boot_id=_boot_id())
        return state

    def _write_state(self, state: SnapshotState) -> None:
        target = self.directory / _STATE
        temporary = target.with_suffix(".tmp")
        temporary.write_text(state.to_json())
        os.replace(temporary, target)

    def _undo_path(self, version: int) -> Path:
        return self.directory / _UNDO / f"{version:08d}.safetensors"


def _read_undo(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An undo record's `(flat indices, values)` per parameter (views of its tensors).

    Raises:
        FileNotFoundError: No record at `path`.
    """
    if not path.is_file():
        raise FileNotFoundError(path)
    found = {}
    with safe_open(str(path), framework="pt") as record:
        metadata = record.metadata()
        for suffix in ("", _FLOAT32_SUFFIX):
            counts = json.loads(metadata[f"names{suffix}"])
            indices, values = record.get_tensor(f"indices{suffix}"), record.get_tensor(f"values{suffix}")
            sizes = [count for _, count in counts]
            found |= {name: pair for (name, _), pair in zip(counts, zip(indices.split(sizes), values.split(sizes)))}
    return found


def mapped_memory(path: str | os.PathLike) -> dict[str, int]:
    """This process's resident (`rss`) and proportional (`pss`) bytes of the mapped file `path`,
    and its copy-on-write copies of the file's pages (`private`), from `/proc/self/smaps`;
    zeros where that cannot be read.

    smaps' own `Private_*` counts pages no other process happens to map (a tensor-parallel
    rank reads only its half of a split weight): they are still the one page-cache copy,
    so they are not what `private` means here.
    """
    totals = {"rss": 0, "pss": 0, "private": 0}
    keys = {"Rss:": "rss", "Pss:": "pss", "Anonymous:": "private"}
    target = str(path)
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return totals
    inside = False
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping's first line: address range ... path
            inside = fields[-1] == target
        elif inside and fields[0] in keys:
            totals[keys[fields[0]]] += int(fields[1]) * 1024
    return totals


def _layout_digest(shapes: Mapping[str, tuple[int, ...]]) -> str:
    layout = json.dumps(sorted((name, list(shape)) for name, shape in shapes.items()))
    return hashlib.sha256(layout.encode()).hexdigest()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
