"""A replica that SIGKILLs itself at its Nth write to the node snapshot.

    python node_snapshot_writer.py BUCKET SNAPSHOT_DIR [CRASH_AT]

It applies `FILES` of BUCKET in order through a `Receiver` over the node snapshot in
SNAPSHOT_DIR. The writes counted are the snapshot's own: every file it replaces (undo
records, the state), every file it unlinks, the first tensor a delta overwrites, and the
moment an anchor has marked the state and dropped the old records. Without CRASH_AT it
prints how many it made.

The crash is real (SIGKILL, no cleanup); only the point where it happens is chosen here.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from delta_sync import Receiver, expected_shapes_of, module_weight_loader
from delta_sync.layout import anchor_path, delta_path
from delta_sync.replica import shared, snapshot
from delta_sync.replica.shared import NodeStore

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from two_tower import TwoTower  # noqa: E402

#: What the replica applies: anchors replace the whole snapshot, deltas change it in place.
FILES = [anchor_path(1), delta_path(2), delta_path(3), anchor_path(4), delta_path(5), delta_path(6), delta_path(7)]


class Counter:
    def __init__(self, crash_at: int | None) -> None:
        self.crash_at = crash_at
        self.writes = 0

    def __call__(self) -> None:
        self.writes += 1
        if self.writes == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)


def instrument(count: Counter, directory: Path) -> None:
    replace, unlink = os.replace, Path.unlink

    class CountingOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def replace(source, target):
            replace(source, target)
            count()

    def counting_unlink(path, missing_ok=False):
        inside = directory in Path(path).absolute().parents
        if inside:
            count()
        unlink(path, missing_ok=missing_ok)

    snapshot.os = CountingOs()
    Path.unlink = counting_unlink

    scatter, first = shared.scatter_many_, {"pending": False}

    def counting_scatter(changes):
        for change in changes:  # tensor by tensor, so that a crash can land between two
            scatter([change])
            if first["pending"]:
                first["pending"] = False
                count()  # one tensor written, the others not yet

    write_delta = NodeStore.write_delta

    def counted_write_delta(self, *args, **kwargs):
        first["pending"] = True
        write_delta(self, *args, **kwargs)

    begin_anchor = snapshot.NodeSnapshot.begin_anchor

    def counted_begin_anchor(self, version, *args, **kwargs):
        begin_anchor(self, version, *args, **kwargs)
        count()  # about to overwrite every tensor

    shared.scatter_many_ = counting_scatter
    NodeStore.write_delta = counted_write_delta
    snapshot.NodeSnapshot.begin_anchor = counted_begin_anchor


def main() -> None:
    bucket, directory = sys.argv[1], Path(sys.argv[2]).absolute()
    count = Counter(int(sys.argv[3]) if len(sys.argv) > 3 else None)
    replica = TwoTower()
    receiver = Receiver(
        load_weights=module_weight_loader(replica),
        expected_shapes=expected_shapes_of(replica),
        store=NodeStore(directory),
    )
    instrument(count, directory)
    for path in FILES:
        receiver.update(bucket, path)
    print(f"WRITES {count.writes}", flush=True)


if __name__ == "__main__":
    main()
