"""Run under torchrun (2 ranks, gloo): DDP, whole parameters. Every rank checks the layout
with the others, only rank 0 builds a detector (a snapshot of the model) and publishes.

torchrun --standalone --nproc_per_node 2 ddp_no_snapshot.py --bucket DIR
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from delta_sync.trainer import callback as callback_module
from delta_sync.trainer.callback import DeltaSyncCallback
from delta_sync.trainer.detector import BF16ChangeDetector


class CountingDetector(BF16ChangeDetector):
    """Counts the detectors built on this rank (each copies a snapshot of the model)."""

    built = 0

    def __init__(self, *args, **kwargs) -> None:
        CountingDetector.built += 1
        super().__init__(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    callback_module.BF16ChangeDetector = CountingDetector
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    callback = DeltaSyncCallback(bucket=args.bucket, background=False)
    state = SimpleNamespace(global_step=0, is_world_process_zero=dist.get_rank() == 0, log_history=[])
    trainer_args = SimpleNamespace(use_vllm=False)
    callback.on_train_begin(trainer_args, state, None, model=model, optimizer=optimizer)
    for step in range(1, 3):
        tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
        model(tokens).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.global_step = step
        callback.on_step_end(trainer_args, state, None)
    callback.on_train_end(trainer_args, state, None)
    versions = [report.version for report in callback.reports] if callback.publisher is not None else []
    print(
        "RESULT " + json.dumps({"rank": dist.get_rank(), "detectors": CountingDetector.built, "versions": versions}),
        flush=True,
    )
    dist.barrier()  # both ranks done before either tears the group down (see index_mapping.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
