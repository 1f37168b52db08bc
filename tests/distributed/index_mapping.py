"""Run under torchrun (4 ranks, gloo): every element of every DTensor layout gets exactly one publisher.

For each layout, each rank maps its block's flat positions to full-tensor positions with
`ParamShard.global_indices` and checks the values there; rank 0 then checks that the
positions of all publishing ranks together cover the tensor exactly once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from delta_sync.trainer.sharding import describe_model

LAYOUTS = [
    ("1d", (4,), (7, 5), [Shard(0)]),
    ("1d-empty", (4,), (3, 5), [Shard(0)]),
    ("1d-dim1", (4,), (5, 3), [Shard(1)]),
    ("1d-3d", (4,), (3, 6, 5), [Shard(1)]),
    ("hsdp", (2, 2), (5, 3), [Replicate(), Shard(0)]),
    ("2d", (2, 2), (5, 3), [Shard(0), Shard(1)]),
    ("2d-nested", (2, 2), (7, 2), [Shard(0), Shard(0)]),
    ("2d-empty", (2, 2), (1, 3), [Shard(0), Shard(1)]),
    ("replicated", (4,), (3, 2), [Replicate()]),
]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for label, mesh_shape, shape, placements in LAYOUTS:
        mesh = init_device_mesh("cpu", mesh_shape)
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        param = torch.nn.Parameter(distribute_tensor(full, mesh, placements))
        layout = describe_model([("w", param)])
        positions: list[int] = []
        if "w" in layout.shards:
            shard = layout.shards["w"]
            local = param.to_local().reshape(-1)
            mapped = shard.global_indices(torch.arange(local.numel()))
            assert torch.equal(full.reshape(-1)[mapped], local), f"{label}: rank {rank} values differ"
            assert bool((mapped[1:] > mapped[:-1]).all()), f"{label}: not ascending"
            positions = mapped.tolist()
        gathered: list[list[int]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, positions)
        every = sorted(p for part in gathered for p in part)
        assert every == list(range(full.numel())), f"{label}: positions {every} do not cover {shape} exactly once"
        assert layout.sharded, label
        if rank == 0:
            print(f"ok {label}", flush=True)
    check_refusals(rank)
    # Every rank done with its last collective before any tears its groups down: in one
    # run, after every check had passed, a rank aborted at exit ("terminate called without
    # an active exception"), as a gloo thread does when its peer has gone first.
    dist.barrier()
    dist.destroy_process_group()


def check_refusals(rank: int) -> None:
    """Layouts that cannot be mapped, or that only look replicated, are refused on every rank."""
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    from delta_sync.errors import UnsupportedLayoutError
    from delta_sync.trainer.sharding import verify_across_ranks

    mesh = init_device_mesh("cpu", (4,))
    for label, placement in (("partial", Partial()), ("strided", _StridedShard(0, split_factor=2))):
        param = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [placement], run_check=False))
        try:
            describe_model([("w", param)])
        except UnsupportedLayoutError as exc:
            assert "'w'" in str(exc), exc
        else:
            raise AssertionError(f"{label} placement was not refused")
    # Hand-made tensor parallelism: same shape on every rank, different content.
    torch.manual_seed(rank)
    named = [("w", torch.nn.Parameter(torch.randn(4, 3)))]
    try:
        verify_across_ranks(describe_model(named), named)
    except UnsupportedLayoutError as exc:
        assert "differs between rank 0" in str(exc), exc
    else:
        raise AssertionError("a plain tensor that differs across ranks was not refused")
    if rank == 0:
        print("ok refusals", flush=True)


if __name__ == "__main__":
    main()
