"""Train with FSDP2 and sync the weights through a bucket, each rank publishing its own part.

A tiny random-init Qwen3-style model is sharded with `torch.distributed.fsdp.fully_shard`
and trained with a small GRPO loop (sample a group of completions per prompt, reward them,
push up the log-probability of the better ones) on CPU with the gloo backend.
`DeltaSyncCallback` publishes an anchor, then a sparse delta after every optimizer step:
every rank detects the changes of its own shard and writes them straight to the bucket;
rank 0 only adds a small manifest naming the parts. No rank ever gathers another rank's
weights for this. After every version, a replica (a `Receiver` fed only from the bucket) is
compared bit for bit with the full weights, which this example gathers for the check alone.

    torchrun --nproc_per_node 2 examples/fsdp2_delta_sync.py --bucket ./deltas-fsdp2 --steps 10 --anchor-every 5

Then check the bucket on its own:

    delta-sync verify ./deltas-fsdp2

Accelerate 1.15 cannot select FSDP on a CPU-only machine, so this example drives the
callback's events itself; with `accelerate launch` and an FSDP2 configuration on GPUs,
pass `DeltaSyncCallback` to the trainer as usual (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from delta_sync import DeltaSyncCallback, Receiver
from delta_sync.layout import step_versions

from tiny_model import build_tiny_model

PROMPTS = [f"{subject} {verb} the" for subject in ("the cat", "a dog", "one fox") for verb in ("sat on", "saw", "is")]


def reward(text: str) -> float:
    """Toy reward: mentions of "cat", plus a little for length, so rewards vary within a group."""
    return text.count("cat") + len(text) / 20


def grpo_loss(model, tokenizer, prompt: str, group: int, generator: torch.Generator) -> torch.Tensor:
    """One prompt's GRPO loss: sample `group` completions, weight their log-probabilities by
    their reward relative to the group's mean."""
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        sequences = model.generate(
            prompt_ids.repeat(group, 1),
            do_sample=True,
            max_new_tokens=8,
            pad_token_id=tokenizer.pad_token_id,
        )
    completions = sequences[:, prompt_ids.shape[1] :]
    rewards = torch.tensor([reward(tokenizer.decode(c, skip_special_tokens=True)) for c in completions])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    logits = model(sequences).logits[:, prompt_ids.shape[1] - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    return -(advantages.unsqueeze(1) * logprobs).mean()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket", default="./deltas-fsdp2", help="local directory or bucket URL")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    parser.add_argument("--anchor-every", type=int, default=5, help="full anchor every N versions (default: 5)")
    parser.add_argument(
        "--encoding",
        choices=("raw", "compact"),
        default="raw",
        help="delta encoding: raw (TRL's int32 + bf16) or compact (each rank's blocks entropy-coded; default: raw)",
    )
    parser.add_argument("--learning-rate", type=float, default=2e-5, help="AdamW learning rate (default: 2e-5)")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (default: 4)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # fp32 sharded master weights, bf16 compute; the bucket carries their bf16 rounding.
    model, tokenizer = build_tiny_model(seed=args.seed, dtype=torch.float32)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)

    sync = DeltaSyncCallback(bucket=args.bucket, anchor_every=args.anchor_every, encoding=args.encoding, overwrite=True)
    state = SimpleNamespace(global_step=0, is_world_process_zero=rank == 0, log_history=[])
    training_args = SimpleNamespace(use_vllm=False)
    sync.on_train_begin(training_args, state, None, model=model, optimizer=optimizer)
    receiver = Receiver(expected_shapes=shapes) if rank == 0 else None
    checked: list[bool] = []

    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for step in range(1, args.steps + 1):
        prompt = PROMPTS[(step * world + rank) % len(PROMPTS)]
        grpo_loss(model, tokenizer, prompt, args.group, generator).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.global_step = step
        sync.on_step_end(training_args, state, None)
        sync.publisher.flush()
        # The check only: gather the full weights and compare them with the replica.
        full = {name: p.full_tensor().to(torch.bfloat16) for name, p in model.named_parameters()}
        if rank == 0:
            receiver.update(args.bucket)
            checked.append(
                receiver.version == step
                and all(
                    torch.equal(t.view(torch.int16), receiver.weights[n].view(torch.int16)) for n, t in full.items()
                )
            )
    snapshot_bytes = [0] * world
    held = sum(t.numel() * t.element_size() for t in sync.detector.snapshot.values())
    dist.all_gather_object(snapshot_bytes, held)
    sync.on_train_end(training_args, state, None)
    if rank == 0:
        _summary(args, sync, checked, shapes, snapshot_bytes, time.perf_counter() - started)
    exact = [bool(checked) and all(checked)]
    dist.broadcast_object_list(exact, src=0)
    dist.destroy_process_group()
    return 0 if exact[0] else 1


def _summary(args, sync: DeltaSyncCallback, checked: list[bool], shapes, snapshot_bytes, seconds: float) -> None:
    reports = sync.reports
    files = sync.publisher.bucket.list()
    full_bytes = 2 * sum(torch.Size(shape).numel() for shape in shapes.values())
    deltas = [r for r in reports if r.delta]
    delta_bytes = sum(r.delta_bytes for r in deltas) / max(1, len(deltas))
    rows = [
        ("steps", f"{args.steps}"),
        ("ranks", f"{len(snapshot_bytes)} (FSDP2, gloo)"),
        ("versions published", f"{len(reports)}"),
        ("anchors written / kept", f"{sum(1 for r in reports if r.anchor)} / {len(step_versions(files, 'anchor'))}"),
        ("deltas written / kept", f"{len(deltas)} / {len(step_versions(files, 'delta'))}"),
        ("parts per version", f"{len(snapshot_bytes)} + 1 manifest"),
        ("mean sparsity of deltas", f"{sum(r.sparsity for r in deltas) / max(1, len(deltas)):.4%}"),
        ("bytes per delta, all parts (mean)", f"{delta_bytes:,.0f}"),
        ("full bf16 model", f"{full_bytes:,} bytes ({delta_bytes / full_bytes:.2%} per delta)"),
        ("snapshot per rank", " / ".join(f"{b:,}" for b in snapshot_bytes) + " bytes"),
        ("replica checks", f"{len(checked)}"),
        ("replica bit-exact", "yes" if checked and all(checked) else "no"),
        ("wall time", f"{seconds:.1f} s"),
    ]
    width = max(len(label) for label, _ in rows)
    print()
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(f"\nbucket: {sync.publisher.bucket.url}   (check it with: delta-sync verify {args.bucket})")


if __name__ == "__main__":
    sys.exit(main())
