"""`RankGroup`: the few collectives a sharded trainer's publishers need, on groups of their own.

Publishing runs partly on a background thread while training runs its own collectives
(FSDP's all-gathers) on the default group; collectives of two threads on one group could
interleave differently on different ranks and deadlock. So the caller thread and the
worker thread each get a separate gloo group. Only small Python objects travel (part
names, digests, counts, 64-bit checksums), never weights.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["RankGroup", "ThreadRole"]


class ThreadRole(Enum):
    """Which of a publisher's threads runs a collective: each has a process group of its own."""

    #: The training thread: `publish`, `flush`, `close`.
    CALLER = "caller"
    #: The publisher's worker thread, which writes the versions.
    WORKER = "worker"


class RankGroup:
    """Collectives among the ranks of one training job, or trivial ones for a single process.

    Must be created on every rank at the same point (creating process groups is itself
    collective).

    Args:
        world_size: Number of ranks; 1 needs no torch.distributed.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank = 0
        self._groups: dict[ThreadRole, Any] = {}
        if world_size > 1:
            import torch.distributed as dist

            self.rank = dist.get_rank()
            self._groups = {role: dist.new_group(backend="gloo") for role in ThreadRole}

    def gather(self, obj: Any, *, thread: ThreadRole) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank.

        Args:
            obj: A small picklable object.
            thread: The thread calling: [`ThreadRole.CALLER`] (the training thread) or
                [`ThreadRole.WORKER`] (the publisher's thread).
        """
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self._groups[thread])
        return gathered

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (from the training thread)."""
        return self.gather(obj, thread=ThreadRole.CALLER)[0]
