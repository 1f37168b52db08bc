"""Run under torchrun (2 ranks, gloo): a LoRA model sharded with FSDP2 is refused at train
begin on every rank, nothing written (merged mode needs each adapted weight whole).

torchrun --standalone --nproc_per_node 2 fsdp2_peft_refused.py --bucket DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard

from delta_sync.errors import UnservableModelError
from delta_sync.trainer.callback import DeltaSyncCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tiny_model import build_tiny_model  # noqa: E402


def train_begin_refusal(model: torch.nn.Module, bucket: str) -> str | None:
    """What the callback raises at train begin for this model, or None if it starts."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = SimpleNamespace(global_step=0, is_world_process_zero=dist.get_rank() == 0, log_history=[])
    try:
        DeltaSyncCallback(bucket=bucket, background=False).on_train_begin(
            SimpleNamespace(use_vllm=False), state, None, model=model, optimizer=optimizer
        )
    except UnservableModelError as refused:
        return str(refused)
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", required=True)
    bucket = parser.parse_args().bucket
    dist.init_process_group("gloo")
    base, _ = build_tiny_model(dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for layer in base.model.layers:
        fully_shard(layer)
    fully_shard(model)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "refusal": train_begin_refusal(model, bucket)}), flush=True)
    dist.barrier()  # every rank done before any tears the group down (see index_mapping.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
