"""Run under torchrun (gloo): an FSDP2 model trained with AdamW, published by DeltaSyncCallback.

Every rank publishes its own part of every version; rank 0 replays the bucket with a
Receiver after every version and compares it, bit for bit, with the full weights
(gathered here, for the check only). While the callback runs, gathering weights is made
to fail, so the test proves the callback never does it.

    torchrun --standalone --nproc_per_node 2 fsdp2_publish.py --bucket DIR --steps 4 --anchor-every 2

With `--host-mirror`, anchors and compact parts are written from each rank's host mirror
of its blocks, checked against the snapshot after every version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from delta_sync import Receiver
from delta_sync.checkpoint import CheckpointLayout
from delta_sync.trainer.callback import DeltaSyncCallback

ROOT = Path(__file__).resolve().parents[2]
# The tiny model lives with the examples, the shared test helpers with the tests.
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]

from helpers import uneven_qwen3_config  # noqa: E402


@contextlib.contextmanager
def no_weight_gathers():
    """Make every way of gathering a sharded weight fail while the callback runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("delta-sync gathered weights")

    saved = (DTensor.full_tensor, DTensor.redistribute, dist.all_gather_into_tensor)
    DTensor.full_tensor, DTensor.redistribute, dist.all_gather_into_tensor = refuse, refuse, refuse
    try:
        yield
    finally:
        DTensor.full_tensor, DTensor.redistribute, dist.all_gather_into_tensor = saved


def build_model(master: bool, model_dir: str | None = None, moe: bool = False) -> torch.nn.Module:
    config = uneven_qwen3_config()  # a third rank holds an empty shard of the q/k norms
    torch.manual_seed(0)
    dtype = torch.float32 if master else torch.bfloat16
    if model_dir is not None:  # e.g. the checkpoint a vLLM server serves
        model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=dtype)
    elif moe:  # fused experts, which the checkpoint holds one tensor per expert
        # Widths of whole 16-byte rows (the grouped expert product needs them); 5 experts
        # divide evenly by no rank count.
        moe_config = Qwen3MoeConfig(
            vocab_size=301, hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2,
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(moe_config).to(dtype)
    else:
        model = Qwen3ForCausalLM(config).to(dtype)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if master else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().to(torch.bfloat16) for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--anchor-every", type=int, default=2)
    parser.add_argument("--encoding", choices=["raw", "compact"], default="raw")
    parser.add_argument("--fp32-masters", action="store_true", help="fp32 sharded masters, bf16 published")
    parser.add_argument("--model-dir", help="train this checkpoint instead of a random model")
    parser.add_argument("--host-mirror", action="store_true", help="anchors and compact parts from a host mirror")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE model: fused experts, per-expert checkpoint")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model(args.fp32_masters, args.model_dir, args.moe)
    # What the bucket must hold: the checkpoint's tensors (gathered for the check only).
    checkpoint = CheckpointLayout.of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    callback = DeltaSyncCallback(
        bucket=args.bucket,
        anchor_every=args.anchor_every,
        background=False,
        encoding=args.encoding,
        host_mirror=args.host_mirror or None,
    )
    state = SimpleNamespace(global_step=0, is_world_process_zero=rank == 0, log_history=[])
    training_args = SimpleNamespace(use_vllm=False)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    receiver = Receiver(expected_shapes=checkpoint.shapes) if rank == 0 else None
    with no_weight_gathers():
        callback.on_train_begin(training_args, state, None, model=model, optimizer=optimizer)
    detector = callback.detector
    local = sum(p.to_local().numel() for p in model.parameters())
    rows = sum(math.prod(shape[1:]) for shape in shapes.values())
    snapshot = sum(t.numel() for t in detector.snapshot.values())
    assert snapshot <= local + rows, f"rank {rank}: snapshot {snapshot} > shard {local} + one row per parameter"
    versions = []
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state.global_step = step
        with no_weight_gathers():
            callback.on_step_end(training_args, state, None)
        if args.host_mirror:  # this rank's blocks, advanced from the changes alone
            for name, tensor in detector.snapshot.items():
                assert torch.equal(detector.mirror.tensors[name].view(torch.int16), tensor.view(torch.int16)), name
        expected = checkpoint.values(full_bf16(model))
        if rank == 0:
            result = receiver.update(args.bucket)
            assert result.version == step, (result.version, step)
            assert sorted(expected) == sorted(receiver.weights)
            for name, tensor in expected.items():
                assert torch.equal(tensor.view(torch.int16), receiver.weights[name].view(torch.int16)), name
            versions.append({"version": step, "applied": list(result.applied)})
    with no_weight_gathers():
        callback.on_train_end(training_args, state, None)
    if rank == 0:
        print("RESULT " + json.dumps({"versions": versions, "checksum": receiver.model_checksum}), flush=True)
    dist.barrier()  # every rank done before any tears the group down (see index_mapping.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
