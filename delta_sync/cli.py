"""The `delta-sync` command line: inspect a file, verify a bucket, keep a vLLM server in step.

All take local paths and bucket URLs (`file://`, `hf://buckets/...`, `s3://...`):

    delta-sync inspect s3://my-bucket/run1/deltas/step_00000002.safetensors
    delta-sync inspect ./deltas/deltas/step_00000003.manifest.json   (a version written in parts)
    delta-sync verify hf://buckets/me/deltas
    delta-sync follow hf://buckets/me/deltas --vllm-url http://127.0.0.1:8000
    delta-sync plot ./deltas -o deltas.png   (needs the `plot` extra: matplotlib)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import stat
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path

from .errors import BucketFileNotFoundError, BucketPathError, DeltaSyncError, FormatError
from .format import Anchor, Delta, DeltaFile, read_file
from .layout import ANCHOR_DIR, DELTA_DIR, is_manifest, version_files
from .manifest import Manifest, PartedAnchor
from .replica.follow import Follower
from .replica.receiver import Receiver
from .replica.verify import verify_bucket
from .signing import SIGNING_KEY_ENV, VERIFY_KEY_ENV, SigningKey
from .storage import open_bucket
from .storage.cache import DownloadCache

__all__ = ["main"]

KEY_FILE, PUBLIC_KEY_FILE = "delta-sync.key", "delta-sync.pub"  # what SigningKey.save writes


def _inspect(args: argparse.Namespace) -> int:
    target = args.file[len("file://") :] if args.file.startswith("file://") else args.file
    located = _locate(target)
    if located is None:  # a file outside any bucket layout: read it as it is
        _refuse_special_file(target)
        with read_file(target) as file:
            return _describe(args, file)
    bucket, path = located
    with tempfile.TemporaryDirectory(prefix="delta-sync-inspect-") as tmp:
        receiver = Receiver(cache=DownloadCache(tmp))
        opened = open_bucket(bucket)
        try:
            file = receiver.reader.open_version(opened, path)
        except BucketFileNotFoundError as exc:
            raise BucketFileNotFoundError(f"{exc}; {_holdings(opened, path)}") from None
        with file:
            if args.decode and isinstance(file, DeltaFile):
                if file.coded:
                    _replay_to(receiver, opened, file.header.base_version)
                return _print_changes(file.decoded(receiver.weights))
            return _describe(args, file)


def _holdings(bucket, path: str) -> str:
    """What a bucket holds, for an error that names a file it lacks (retention deletes old ones)."""
    listing = bucket.list(ANCHOR_DIR) + bucket.list(DELTA_DIR)
    held = []
    for kind in ("anchor", "delta"):
        files = version_files(listing, kind)
        if files:
            newest = files[max(files)]
            held.append(f"{len(files)} {kind}(s), v{min(files)}-v{max(files)} (newest: {bucket.url}/{newest})")
    if not held:
        folder, _, name = path.rpartition("/")
        return (
            f"{bucket.url} holds no anchors or deltas (a bucket keeps them under BUCKET/{ANCHOR_DIR}/ and "
            f"BUCKET/{DELTA_DIR}/: for the bucket ./deltas, name deltas/{folder}/{name})"
        )
    return f"{bucket.url} holds " + " and ".join(held)


def _replay_to(receiver: Receiver, bucket, version: int) -> None:
    """Bring `receiver` to `version` from the bucket: its newest anchor at or before, then deltas."""
    listing = bucket.list("anchors") + bucket.list("deltas")
    anchors, deltas = version_files(listing, "anchor"), version_files(listing, "delta")
    start = max((v for v in anchors if v <= version), default=None)
    if start is None:
        raise FormatError(f"{bucket.url}: no anchor at or before v{version} to decode against")
    receiver.update(bucket, anchors[start])
    for step in range(start + 1, version + 1):
        receiver.update(bucket, deltas[step])


def _print_changes(delta: Delta) -> int:
    """Every change as a raw delta holds it: one JSON line per parameter."""
    for name in sorted(delta.changes):
        change = delta.changes[name]
        print(json.dumps({"name": name, "indices": change.indices.tolist(), "values": change.values.float().tolist()}))
    return 0


def _refuse_special_file(target: str) -> None:
    """A FIFO would block the reader and a device read without end: only regular files are read."""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return  # read_file names the missing file
    if not stat.S_ISREG(mode):
        raise FormatError(f"{target}: not a regular file (a directory, FIFO or device); nothing read")


def _locate(target: str) -> tuple[str, str] | None:
    """Split a version file's URL or path into its bucket and its path inside it, e.g.
    `s3://b/run1/deltas/step_00000002.manifest.json` -> (`s3://b/run1`, `deltas/step_00000002.manifest.json`)."""
    base, _, name = target.rstrip("/").rpartition("/")
    parent, _, folder = base.rpartition("/")
    if folder in (ANCHOR_DIR, DELTA_DIR):
        return parent or ".", f"{folder}/{name}"
    if "://" in target:
        raise BucketPathError(f"{target!r} does not name an anchor or delta inside a bucket")
    return None


def _describe(args: argparse.Namespace, file: Anchor | DeltaFile | PartedAnchor) -> int:
    header = file.header
    if isinstance(file, DeltaFile):
        # A coded delta's changes per tensor are known once decoded (`--decode`).
        changes = file.changes if isinstance(file, Delta) else {}
        per_tensor = {
            name: {"changed": len(change), "numel": _numel(header.shapes[name])} for name, change in changes.items()
        }
    else:
        per_tensor = {name: {"changed": _numel(shape), "numel": _numel(shape)} for name, shape in header.shapes.items()}
    for entry in per_tensor.values():
        entry["sparsity"] = 1.0 - entry["changed"] / entry["numel"] if entry["numel"] else 1.0
    summary = {
        "file": str(args.file),
        "kind": header.kind,
        "version": header.version,
        "base_version": header.base_version,
        "anchor_version": header.anchor_version,
        "encoding": header.encoding,
        "run_id": header.run_id,
        "changed_elements": header.changed_elements,
        "total_elements": header.total_elements,
        "sparsity": header.sparsity,
        "model_checksum": header.model_checksum,
        "tensors": per_tensor,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    base = f" on top of v{header.base_version}" if header.base_version is not None else ""
    print(
        f"{args.file}: {header.kind} v{header.version}{base}, anchor v{header.anchor_version}, encoding {header.encoding}"
    )
    print(f"run {header.run_id}, model checksum {header.model_checksum}")
    width = max((len(name) for name in per_tensor), default=4)
    print(f"{'tensor':<{width}}  {'changed':>12}  {'elements':>12}  {'sparsity':>9}")
    for name, entry in sorted(per_tensor.items()):
        print(f"{name:<{width}}  {entry['changed']:>12,}  {entry['numel']:>12,}  {entry['sparsity']:>9.4%}")
    print(f"{'total':<{width}}  {header.changed_elements:>12,}  {header.total_elements:>12,}  {header.sparsity:>9.4%}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = verify_bucket(args.bucket, verify_key=args.verify_key)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for step in report.steps:
            print(f"{'ok  ' if step.ok else 'FAIL'}  {step.path}: {step.message}")
        verdict = "passed" if report.ok else "FAILED"
        latest = "no latest.json" if report.latest_version is None else f"latest v{report.latest_version}"
        replayed = "nothing replayed" if report.replayed_version is None else f"replayed v{report.replayed_version}"
        print(f"{report.bucket}: verification {verdict} ({latest}, {replayed})")
    return 0 if report.ok else 1


def _keygen(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    existing = [path for path in (directory / KEY_FILE, directory / PUBLIC_KEY_FILE) if path.exists()]
    if existing:
        print(
            f"delta-sync: error: {existing[0]} exists already, and keys are never overwritten. To keep signing "
            f"with that pair, use it as it is ({SIGNING_KEY_ENV}={directory / KEY_FILE} on the trainer, "
            f"{VERIFY_KEY_ENV}={directory / PUBLIC_KEY_FILE} on replicas); to make a new pair, name another "
            f"directory (delta-sync keygen {directory}-new) and give replicas its public key when the trainer "
            "switches to it",
            file=sys.stderr,
        )
        return 2
    private, public = SigningKey.generate().save(directory)
    ignore = directory / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# Written by delta-sync keygen: the private key must never be committed.\n*\n")
    print(f"wrote {private} (the trainer's signing key: keep it secret) and {public} (for replicas)")
    print(f"trainer: {SIGNING_KEY_ENV}={private}   replicas: {VERIFY_KEY_ENV}={public} (or the file's PEM text)")
    print(
        f"never commit {directory}/ (a {ignore.name} there keeps git away from it): anyone holding "
        f"{private.name} can change what replicas serve"
    )
    return 0


def _plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib
    except ImportError:
        print("delta-sync: error: plot needs matplotlib: pip install 'delta-weight-sync[plot]'", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory(prefix="delta-sync-plot-") as tmp:
        receiver = Receiver(cache=DownloadCache(tmp))
        bucket = open_bucket(args.bucket)
        rows = _version_rows(receiver, bucket)
    if not rows:
        raise FormatError(f"{bucket.url}: no anchors or deltas to plot")
    anchors = [row for row in rows if row["kind"] == "anchor"]
    deltas = [row for row in rows if row["kind"] == "delta"]
    figure, (sizes, changed) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), constrained_layout=True)
    sizes.plot([r["version"] for r in deltas], [r["bytes"] for r in deltas], "o-", ms=3, label="delta")
    sizes.plot([r["version"] for r in anchors], [r["bytes"] for r in anchors], "s", color="C3", label="anchor")
    sizes.set_yscale("log")
    sizes.set_ylabel("bytes stored")
    sizes.set_title(f"{bucket.url}: {len(deltas)} deltas, {len(anchors)} anchors, run {rows[-1]['run_id']}")
    changed.bar([r["version"] for r in deltas], [100 * r["changed_fraction"] for r in deltas], color="0.6")
    changed.set_ylabel("% of elements changed")
    changed.set_xlabel("version")
    for axis in (sizes, changed):
        for row in anchors:
            axis.axvline(row["version"], color="C3", lw=0.8, ls=":")
    sizes.legend(loc="best")
    figure.savefig(args.output, dpi=120)
    plt.close(figure)
    mean = sum(r["bytes"] for r in deltas) / max(1, len(deltas))
    at = ", ".join(f"v{r['version']}" for r in anchors) or "none kept"
    print(
        f"wrote {args.output}: v{rows[0]['version']}-v{rows[-1]['version']}, {len(deltas)} deltas "
        f"({mean:,.0f} bytes on average), anchors at {at}"
    )
    return 0


def _version_rows(receiver: Receiver, bucket) -> list[dict]:
    """One row per stored version file (anchor or delta, whole or in parts), oldest first."""
    listing = bucket.list(ANCHOR_DIR) + bucket.list(DELTA_DIR)
    rows = []
    for kind in ("anchor", "delta"):
        for version, path in version_files(listing, kind).items():
            local = None if is_manifest(path) else bucket.local_path(path)
            if local is not None:  # a local bucket's file is read where it lies, not copied
                with read_file(local, source=f"{bucket.url}/{path}") as file:
                    header = file.header
                rows.append(_version_row(kind, version, local.stat().st_size, header))
                continue
            with receiver.reader.open_version(bucket, path) as file:
                header = file.header
            stored = receiver.cache.fetch(bucket, path)
            size = stored.stat().st_size
            if is_manifest(path):
                manifest = Manifest.from_json(stored.read_bytes(), source=f"{bucket.url}/{path}")
                size += sum(receiver.cache.fetch(bucket, part.path).stat().st_size for part in manifest.parts)
            rows.append(_version_row(kind, version, size, header))
    return sorted(rows, key=lambda row: (row["version"], row["kind"]))


def _version_row(kind: str, version: int, size: int, header) -> dict:
    return {
        "kind": kind,
        "version": version,
        "bytes": size,
        "changed_fraction": 1.0 - header.sparsity,
        "run_id": header.run_id,
    }


def _follow(args: argparse.Namespace) -> int:
    # Every module's records, a line per version even without -v: the package's root, by name
    # (run as `python -m delta_sync.cli`, this module is `__main__`).
    logging.getLogger("delta_sync").setLevel(logging.INFO)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        # Stop between polls, or after the update in flight: never leave a session open.
        signal.signal(signum, lambda *_: stop.set())
    max_backoff = args.max_backoff if args.max_backoff is not None else max(120.0, args.interval)
    with Follower(
        args.bucket, args.vllm_url, interval=args.interval, max_backoff=max_backoff, adapter_name=args.adapter_name
    ) as follower:
        logging.getLogger("delta_sync.cli").info(
            "delta-sync: following %s for %s", follower.bucket.url, follower.replica.url
        )
        follower.run(stop)
    return 0


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="delta-sync", description="Bit-exact delta weight sync: tools.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="describe an anchor or delta file")
    inspect.add_argument("file", help="a .safetensors anchor or delta: a local path or a bucket URL")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument(
        "--decode",
        action="store_true",
        help="print a delta's positions and new values, one JSON line per parameter (a compact delta is "
        "decoded against the bucket's previous version)",
    )
    inspect.set_defaults(run=_inspect)

    verify = commands.add_parser(
        "verify", help="replay a bucket's anchors and deltas (or fetch its adapter versions) and check each file"
    )
    verify.add_argument("bucket", help="bucket URL or local directory")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    verify.add_argument(
        "--verify-key", help=f"check every file's signature with this public key (default: ${VERIFY_KEY_ENV}, if set)"
    )
    verify.set_defaults(run=_verify)

    keygen = commands.add_parser("keygen", help="make the Ed25519 key pair that signs versions")
    keygen.add_argument("directory", help="where to write delta-sync.key and delta-sync.pub (never overwritten)")
    keygen.set_defaults(run=_keygen)

    plot = commands.add_parser(
        "plot", help="draw a bucket's bytes per version, changed fraction and anchors (needs matplotlib)"
    )
    plot.add_argument("bucket", help="bucket URL or local directory")
    plot.add_argument("-o", "--output", default="delta-sync-plot.png", help="image to write (default: %(default)s)")
    plot.set_defaults(run=_plot)

    follow = commands.add_parser(
        "follow", help="keep a vLLM server at the newest version of a bucket (runs until stopped)"
    )
    follow.add_argument("bucket", help="bucket URL or local directory, as the server resolves it")
    follow.add_argument("--vllm-url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    follow.add_argument("--interval", type=_seconds, default=5.0, help="seconds between polls (default 5)")
    follow.add_argument(
        "--max-backoff", type=_seconds, help="longest wait after failed polls (default 120, at least --interval)"
    )
    follow.add_argument(
        "--adapter-name",
        help="for a bucket published in adapter mode: the name the server serves the LoRA adapter under",
    )
    follow.set_defaults(run=_follow)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`delta-sync inspect ... | head`): stop quietly, as Python's
        # documentation on SIGPIPE advises; stdout goes to devnull so the final flush passes.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    except DeltaSyncError as exc:
        print(f"delta-sync: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # hostile input must not end in a traceback (unless -v asks for it)
        if args.verbose:
            traceback.print_exc()
        target = getattr(args, "file", None) or getattr(args, "bucket", None)
        where = f"{target}: " if target else ""
        print(f"delta-sync: error: {where}{type(exc).__name__}: {_describe_error(exc)}", file=sys.stderr)
        return 2


def _describe_error(exc: BaseException) -> str:
    """One line for an error this library did not foresee."""
    if isinstance(exc, RecursionError):
        return "input nested too deeply"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or exc}: {exc.filename!r}"
    return str(exc) or repr(exc)


if __name__ == "__main__":
    sys.exit(main())
