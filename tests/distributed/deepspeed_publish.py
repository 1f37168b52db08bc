"""Run under torchrun (gloo, DeepSpeed's CPU accelerator): a model trained by a DeepSpeed ZeRO
engine, published by DeltaSyncCallback.

The callback gets what `transformers.Trainer` hands its callbacks under DeepSpeed (the
unwrapped model and Accelerate's `DeepSpeedOptimizerWrapper` of the ZeRO optimizer) or,
with `--pass engine`, the engine and its optimizer as `deepspeed.initialize` returns them.
With ZeRO-1/2 rank 0 publishes whole tensors; with ZeRO-3 every rank publishes its own
partition. After every version rank 0 replays the bucket with a Receiver and compares it
bit for bit with the full bf16 weights (gathered here, for the check only). While the
callback runs, gathering weights is made to fail.

    torchrun --standalone --nproc_per_node 2 deepspeed_publish.py --bucket DIR --stage 3 --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import deepspeed.comm
import torch
import torch.distributed as dist
from transformers import Qwen3ForCausalLM

from delta_sync import Receiver
from delta_sync.trainer.callback import DeltaSyncCallback
from delta_sync.trainer.detector import canonical_name

ROOT = Path(__file__).resolve().parents[2]
# The tiny model lives with the examples, the shared test helpers with the tests.
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]

from helpers import uneven_qwen3_config  # noqa: E402


@contextlib.contextmanager
def no_weight_gathers():
    """Make every way of gathering a partitioned weight fail while the callback runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("delta-sync gathered weights")

    saved = []
    for module, name in [
        (dist, "all_gather_into_tensor"),
        *(
            (deepspeed.comm, name)
            for name in ("allgather_fn", "all_gather_into_tensor", "all_gather", "all_gather_base")
        ),
        (deepspeed.zero.GatheredParameters, "__enter__"),
    ]:
        if hasattr(module, name):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, refuse)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def build_model() -> torch.nn.Module:
    config = uneven_qwen3_config()  # a third rank holds an empty ZeRO-3 partition of the q/k norms
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def deepspeed_config(stage: int, precision: str) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        # The norms (50 elements) stay gathered between steps, the matrices do not: both
        # kinds of ZeRO-3 parameter are published from their partitions.
        zero["stage3_param_persistence_threshold"] = 100
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
    }


def full_bf16(module: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter at full shape in bf16 (all ranks take part under ZeRO-3)."""
    params = dict(module.named_parameters())
    gather = deepspeed.zero.GatheredParameters(list(params.values())) if stage == 3 else contextlib.nullcontext()
    with gather:
        return {canonical_name(name): p.detach().to(torch.bfloat16).clone() for name, p in params.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], required=True)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--pass", dest="passed", choices=["trainer", "engine"], default="trainer")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--anchor-every", type=int, default=2)
    parser.add_argument("--encoding", choices=["raw", "compact"], default="raw")
    args = parser.parse_args()
    # DeepSpeed's shared-memory all-reduce for CPUs is compiled on first use (minutes);
    # gloo does the same job.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build_model()
    # What transformers.Trainer does without an "optimizer" entry in the DeepSpeed config.
    # A small learning rate, as in RL fine-tuning: few bf16 elements change per step.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    config = deepspeed_config(args.stage, args.precision)
    if args.passed == "trainer":
        # transformers.Trainer prepares both through Accelerate and hands its callbacks the
        # unwrapped model and Accelerate's wrapper of the ZeRO optimizer.
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        engine, passed_optimizer = accelerator.prepare(model, optimizer)
        passed_model = accelerator.unwrap_model(engine)
    else:
        engine, passed_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        passed_model = engine
    assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
    callback = DeltaSyncCallback(
        bucket=args.bucket, anchor_every=args.anchor_every, background=False, encoding=args.encoding
    )
    state = SimpleNamespace(global_step=0, is_world_process_zero=rank == 0, log_history=[])
    training_args = SimpleNamespace(use_vllm=False)
    expected = full_bf16(engine.module, args.stage)
    receiver = Receiver(expected_shapes={name: tuple(t.shape) for name, t in expected.items()}) if rank == 0 else None
    with no_weight_gathers():
        callback.on_train_begin(training_args, state, None, model=passed_model, optimizer=passed_optimizer)
    detector = callback.detector
    sharded = detector is not None and detector.layout.sharded
    snapshot = 0 if detector is None else sum(t.numel() for t in detector.snapshot.values())
    if args.stage == 3:
        partition = sum(p.ds_tensor.numel() for p in engine.module.parameters())
        assert sharded and snapshot <= partition, f"rank {rank}: snapshot {snapshot} > partition {partition}"
    versions = []
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        state.global_step = step
        with no_weight_gathers():
            callback.on_step_end(training_args, state, None)
        expected = full_bf16(engine.module, args.stage)
        if rank == 0:
            result = receiver.update(args.bucket)
            assert result.version == step, (result.version, step)
            for name, tensor in expected.items():
                assert torch.equal(tensor.view(torch.int16), receiver.weights[name].view(torch.int16)), name
            report = callback.reports[-1]
            assert report.version == step, (report.version, step)
            versions.append({"version": step, "applied": list(result.applied), "changed": report.changed_elements})
    with no_weight_gathers():
        callback.on_train_end(training_args, state, None)
    outcome = {"rank": rank, "sharded": sharded, "publishes": callback.publisher is not None, "snapshot": snapshot}
    if rank == 0:
        outcome.update(versions=versions, checksum=receiver.model_checksum)
    print("RESULT " + json.dumps(outcome), flush=True)
    dist.barrier()  # every rank done before any tears the group down (see index_mapping.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
