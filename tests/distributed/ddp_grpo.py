"""Run under `accelerate launch` (2 CPU processes, DDP over gloo): TRL's GRPOTrainer with DeltaSyncCallback.

Rank 0 alone publishes; after every step it replays the bucket with a Receiver and
compares the result, bit for bit, with the trained model. At the end every rank reports
what it saw of the distributed run, so the test can tell real DDP (one process group,
each rank its own prompts, gradients averaged, parameters identical) from two trainers
that merely run side by side.

    accelerate launch --config_file CFG --num_processes 2 ddp_grpo.py --bucket DIR --steps 4

With `--forget-use-cpu` it makes a common mistake instead: the trainer's `use_cpu` left
False on a host without accelerators, where Accelerate then initializes torch.distributed
but runs every process as its own single-process trainer.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[2]
# The tiny model lives with the examples, the GRPO trainer factory with the tests.
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]

from delta_sync import DeltaSyncCallback  # noqa: E402

from trainers import FollowingReplica, grpo_trainer, reward_cats  # noqa: E402


class UnwrappingReplica(FollowingReplica):
    """A FollowingReplica that compares with the model inside DDP, whatever the trainer hands over."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if isinstance(model, DistributedDataParallel):
            model = model.module  # its parameters are named `module.…`; the checkpoint's are not
        return super().on_step_end(args, state, control, model=model, **kwargs)


def recording(seen: set[str]):
    """`reward_cats`, noting every prompt this rank scores (each DDP rank gets its own)."""

    @functools.wraps(reward_cats)
    def reward(prompts, completions, **kwargs):
        seen.update(prompts)
        return reward_cats(completions, **kwargs)

    return reward


def forget_use_cpu() -> None:
    """Make the GRPOConfig that `grpo_trainer` builds keep `use_cpu=False`."""
    import trl

    class ForgetfulConfig(trl.GRPOConfig):
        def __post_init__(self) -> None:
            self.use_cpu = False
            super().__post_init__()

    trl.GRPOConfig = ForgetfulConfig


def parameters_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's exact bytes (fp32 masters included), in name order."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--anchor-every", type=int, default=2)
    parser.add_argument("--forget-use-cpu", action="store_true")
    args = parser.parse_args()
    if args.forget_use_cpu:
        forget_use_cpu()

    # Anchors by count only, so that the test can predict the schedule.
    sync = DeltaSyncCallback(bucket=args.bucket, anchor_every=args.anchor_every, anchor_bytes_ratio=None)
    replica = UnwrappingReplica(sync, Path(args.bucket))
    prompts: set[str] = set()
    with tempfile.TemporaryDirectory() as scratch:
        trainer = grpo_trainer(Path(scratch), [sync, replica], steps=args.steps)
        trainer.reward_funcs[0] = recording(prompts)
        trainer.train()

    # Each rank's view, gathered on every rank: the process group, the wrapper and the result.
    mine = {
        "rank": dist.get_rank() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "accelerate_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "publisher": sync.publisher is not None,
        "prompts": sorted(prompts),
        "digest": parameters_digest(trainer.model),
    }
    everyone = [mine]
    if dist.is_initialized():
        everyone = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
    result = {
        **mine,
        "versions": [{"version": step, "exact": exact} for step, exact, _ in replica.results],
        "kinds": [report.kind for report in sync.reports],
        "changed_elements": [report.changed_elements for report in sync.reports],
        "digests": [seen["digest"] for seen in everyone],
        "prompts_per_rank": [seen["prompts"] for seen in everyone],
        "publishers": sum(seen["publisher"] for seen in everyone),
    }
    # Both ranks share one stdout pipe: the line goes out in one write (under PIPE_BUF, so
    # atomic) after everything buffered, never interleaved with the other rank's output.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"RESULT {json.dumps(result)}\n".encode())
    # Torn down before the interpreter exits: a process group left to its destructor can
    # abort the process on the way out ("terminate called without an active exception"), and
    # so can one torn down while its peer still uses it: every rank meets first.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
