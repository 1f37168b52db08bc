"""Run under torchrun (2 ranks, gloo): FSDP1 is refused at train begin on every rank, nothing written.

torchrun --standalone --nproc_per_node 2 fsdp1_refused.py --bucket DIR [--use-orig-params]
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from delta_sync.errors import UnsupportedLayoutError
from delta_sync.trainer.callback import DeltaSyncCallback


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--use-orig-params", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 128), nn.Linear(128, 301, bias=False)).to(torch.bfloat16)
    model = FullyShardedDataParallel(model, use_orig_params=args.use_orig_params, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    callback = DeltaSyncCallback(bucket=args.bucket, background=False)
    state = SimpleNamespace(global_step=0, is_world_process_zero=dist.get_rank() == 0, log_history=[])
    try:
        callback.on_train_begin(SimpleNamespace(use_vllm=False), state, None, model=model, optimizer=optimizer)
        outcome = {"refused": False}
    except UnsupportedLayoutError as exc:
        outcome = {"refused": True, "message": str(exc)}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **outcome}), flush=True)
    dist.barrier()  # every rank done before any tears the group down (see index_mapping.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
