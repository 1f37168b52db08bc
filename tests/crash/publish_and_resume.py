"""A publisher that SIGKILLs itself at its Nth bucket operation (upload or delete).

    python publish_and_resume.py BUCKET PHASE [CRASH_AT]

Phase A publishes versions 1-6 of a run; phase B resumes the same run from its state at
version 3 and publishes versions 4-6 again (a different trajectory: phase A's 4-6 are
abandoned). Training is seeded, so the test can recompute every state (`states`). Without
CRASH_AT it prints the number of bucket operations it made.

The crash is real (SIGKILL, no cleanup); only the point where it happens is chosen here, by
counting the operations a real LocalBucket performs.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from delta_sync import BF16ChangeDetector, LocalBucket, Publisher

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from two_tower import TwoTower, train_step  # noqa: E402

RUN_ID = "crash-matrix"


class CrashingBucket(LocalBucket):
    def __init__(self, root: str, crash_at: int | None) -> None:
        super().__init__(root)
        self.crash_at = crash_at
        self.operations = 0

    def _count(self) -> None:
        self.operations += 1
        if self.operations == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def upload(self, path, source, *, overwrite=True):
        self._count()
        super().upload(path, source, overwrite=overwrite)
        self._count()  # right after, too: the file is stored, nothing after it is

    def delete(self, paths):
        for path in paths:
            self._count()
            super().delete([path])


def trained(steps: int, *, seed_offset: int = 0) -> tuple[TwoTower, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(1, steps + 1):
        train_step(model, optimizer, seed=step + (seed_offset if step > 3 else 0))
    return model, optimizer


def publish(bucket: CrashingBucket, first: int, last: int, *, seed_offset: int) -> None:
    model, optimizer = trained(first - 1, seed_offset=seed_offset)
    publisher = Publisher(
        bucket,
        BF16ChangeDetector(model, optimizer),
        anchor_every=3,
        keep_anchors=1,
        background=False,
        run_id=RUN_ID,
    )
    for version in range(first, last + 1):
        train_step(model, optimizer, seed=version + (seed_offset if version > 3 else 0))
        publisher.publish(version)
    publisher.close()


PHASES = {"A": (1, 6, 0), "B": (4, 6, 100)}


def states(phase: str) -> dict[int, dict[str, torch.Tensor]]:
    """The bf16 state of every version the phase publishes (and of those it keeps from before)."""
    first, last, offset = PHASES[phase]
    model, optimizer = trained(0)
    result = {}
    for version in range(1, last + 1):
        train_step(model, optimizer, seed=version + (offset if version > 3 else 0))
        result[version] = {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}
    return result


def main() -> None:
    crash_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    bucket = CrashingBucket(sys.argv[1], crash_at)
    first, last, offset = PHASES[sys.argv[2]]
    publish(bucket, first, last, seed_offset=offset)
    print(f"OPERATIONS {bucket.operations}", flush=True)


if __name__ == "__main__":
    main()
