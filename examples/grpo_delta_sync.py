"""Train a tiny model with TRL's GRPOTrainer and sync its weights through a bucket, bit-exactly.

A random-init Qwen3-style model and tokenizer are built locally (nothing is downloaded)
and trained on CPU with a toy reward. `DeltaSyncCallback` publishes an anchor, then a
sparse delta after every optimizer step. A replica, a separate transformers model fed
only from the bucket through `delta_sync.Receiver`, follows along and is compared with
the trainer bit for bit after every sync. At the end, the tensors the replica replayed from
the bucket are compared with what `save_pretrained` writes for the trained model: the
same names (the checkpoint's, e.g. one tensor per MoE expert where transformers fuses them
at run time), shapes and bits: bf16, and float32 for what the model keeps in float32 (a MoE
router of DeepSeek-V3 or GLM-4.5), which the bucket carries unrounded.

    python examples/grpo_delta_sync.py --bucket ./deltas --steps 20

`--model` trains any causal LM checkpoint instead, a Hub id or a local directory (the
replica is built from the same config with random weights until the first anchor lands):

    python examples/grpo_delta_sync.py --model Qwen/Qwen3-0.6B --bucket ./deltas --steps 5

`--bucket` takes any bucket URL (see docs/buckets.md for the one-time setup):

    python examples/grpo_delta_sync.py --bucket hf://buckets/me/deltas/run1
    python examples/grpo_delta_sync.py --bucket s3://my-bucket/run1

Then check the bucket on its own:

    delta-sync verify ./deltas

With `--vllm-url`, the trainer generates through a real vLLM server running
`vllm_ext` (started on the model `--base-model-dir` saved, or on `--model`), whose
weights follow the bucket too: TRL's own NCCL weight sync is replaced, and after every
step the server's weight checksum is compared with the trainer's. vLLM itself need not be
installed where this script runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from delta_sync import DeltaSyncCallback, Receiver, expected_shapes_of, module_weight_loader
from delta_sync.checkpoint import CheckpointLayout, kept_in_float32, persistent_buffers, pretrained_model
from delta_sync.integrity import model_checksum, tensor_checksum
from delta_sync.layout import step_versions
from delta_sync.signing import SigningKey

from tiny_model import build_tiny_model

PROMPTS = [
    f"{subject} {verb} the"
    for subject in ("the cat", "a dog", "one fox", "my red")
    for verb in ("sat on", "saw", "ran to", "is")
]


def reward_cats(completions: list[str], **kwargs) -> list[float]:
    """Toy reward: mentions of "cat", plus a little for length, so rewards vary within a group."""
    return [completion.count("cat") + len(completion) / 20 for completion in completions]


def host_published(model: torch.nn.Module, float32: Iterable[str]) -> dict[str, torch.Tensor]:
    """A model's weights as published (bf16, but the tensors `float32` names), on the host: the
    replica and the bucket's tensors are there, and `torch.equal` refuses tensors on two
    devices (a trainer on a GPU). Its parameters and the buffers its checkpoint holds
    (DeepSeek-V3's router bias)."""
    float32 = set(float32)
    return {
        name: t.detach().to("cpu", torch.float32 if name in float32 else torch.bfloat16)
        for name, t in weights_of(model).items()
    }


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A bf16 or float32 tensor's bit patterns (exact comparisons: NaN, -0.0)."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and the buffers its checkpoint holds, by name."""
    return {**dict(model.named_parameters()), **persistent_buffers(model)}


class ReplicaCheck(TrainerCallback):
    """After each sync, compares the trainer's bf16 weights with a replica that follows the
    bucket on its own and, with `--vllm-url`, with what the vLLM server reports serving."""

    def __init__(self, sync: DeltaSyncCallback, bucket: str, replica: torch.nn.Module) -> None:
        self.sync = sync
        self.bucket = bucket
        self.replica = replica
        # The trainer signs with DELTA_SYNC_SIGNING_KEY (or signing_key=) when one is set: the
        # replica then checks every signature with the matching public key.
        key = sync.config.signing_key
        signing_key = SigningKey.load(key) if key else SigningKey.from_env()
        self.receiver = Receiver(
            load_weights=module_weight_loader(replica),
            expected_shapes=expected_shapes_of(replica),
            verify_key=signing_key.verify_key if signing_key else None,
        )
        self.checkpoint: CheckpointLayout | None = None
        self.checked: list[tuple[int, bool]] = []
        self.server_checked: list[tuple[int, bool]] = []
        #: (version, error) for every version a server refused or failed to reach.
        self.server_refused: list[tuple[int, str]] = []
        #: Whether the replayed bucket is what save_pretrained writes for the trained model,
        #: and what was compared (or why not); None until training ends.
        self.saved_check: tuple[bool, str] | None = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        version = state.global_step
        if self.sync.publisher is None or self.sync.publisher.last_version != version:
            return
        float32 = self.sync.detector.float32
        trainer_params = host_published(model, float32)
        trainer_bits = self._checkpoint_of(model, trainer_params)
        self.sync.publisher.flush()
        self.receiver.update(self.bucket)
        # The bucket holds the trainer's checkpoint (what save_pretrained writes); the replica
        # loads it into its own run-time parameters, which must equal the trainer's.
        held = self.receiver.weights
        exact = sorted(trainer_bits) == sorted(held) and all(
            tensor.dtype == held[name].dtype and torch.equal(bits(tensor), bits(held[name]))
            for name, tensor in trainer_bits.items()
        )
        replica = host_published(self.replica, float32)
        exact = exact and all(
            tensor.dtype == replica[name].dtype and torch.equal(bits(tensor), bits(replica[name]))
            for name, tensor in trainer_params.items()
        )
        self.checked.append((version, exact))
        if not exact:
            logging.error("replica differs from the trainer at version %d", version)
        if self.sync.replicas is not None and self.sync.config.max_staleness == 0:
            self._check_server(version, trainer_bits)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        # With max_staleness > 0 replicas may lag during training; DeltaSyncCallback has
        # waited for the last version by now.
        if self.sync.replicas is not None and self.sync.config.max_staleness > 0:
            published = host_published(model, self.sync.detector.float32)
            self._check_server(state.global_step, self._checkpoint_of(model, published))
        if self.sync.publisher is not None and self.sync.publisher.last_version is not None:
            self.saved_check = self._check_save_pretrained(model)

    def _check_save_pretrained(self, model: torch.nn.Module) -> tuple[bool, str]:
        """Compares the bucket, as the replica replayed it, with what `save_pretrained` writes
        for the trained model (as published: its bf16 rounding, but what the model keeps in
        float32): names, shapes and bits."""
        self.receiver.update(self.bucket)  # the last version (the trainer has closed its publisher)
        if self.receiver.version != self.sync.publisher.last_version:
            return False, f"no (the replica holds v{self.receiver.version}, not v{self.sync.publisher.last_version})"
        found = pretrained_model(model)
        if found is None:
            return False, "not compared (not a transformers model)"
        _, pretrained = found
        with tempfile.TemporaryDirectory(prefix="save-pretrained-") as directory:
            pretrained.save_pretrained(directory)
            saved = {}
            for path in sorted(Path(directory).glob("*.safetensors")):
                saved.update(load_file(path))
        bucket = self.receiver.weights
        if set(saved) != set(bucket):
            only_bucket, only_saved = sorted(set(bucket) - set(saved)), sorted(set(saved) - set(bucket))
            first = (only_bucket or only_saved)[0]
            return False, (
                f"no (names differ: {len(only_bucket)} only in the bucket, {len(only_saved)} only in "
                f"save_pretrained, e.g. {first!r})"
            )
        differing = [
            name
            for name, tensor in saved.items()
            if tuple(tensor.shape) != tuple(bucket[name].shape)
            or not torch.equal(bits(tensor.to(bucket[name].dtype)), bits(bucket[name]))
        ]
        if differing:
            return False, f"no ({len(differing)} of {len(saved)} tensors differ, e.g. {differing[0]!r})"
        float32 = sum(tensor.dtype == torch.float32 for tensor in bucket.values())
        kept = f", float32 for the {float32} the model keeps in float32" if float32 else ""
        return True, f"yes ({len(saved)} tensors: names, shapes and bf16 bits{kept})"

    def _checkpoint_of(self, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The trainer's weights as its checkpoint names and lays them out (fused MoE experts
        cut into the checkpoint's per-expert tensors), through transformers' own conversion."""
        if self.checkpoint is None:
            self.checkpoint = CheckpointLayout.of(model)
        return self.checkpoint.values(params)

    def _check_server(self, version: int, trainer_bits: dict[str, torch.Tensor]) -> None:
        expected = model_checksum({name: tensor_checksum(tensor) for name, tensor in trainer_bits.items()})
        behind = self.sync.replicas.wait(version, timeout=600)
        if behind:  # it refused the update (or never answered): nothing to compare
            for state in behind:
                error = state.error or f"still at version {state.version} after 600 s"
                self.server_refused.append((version, f"{state.url}: {error}"))
                logging.error("vLLM server did not take version %d: %s: %s", version, state.url, error)
            return
        served = [state.model_checksum for state in self.sync.replicas.states.values()]
        exact = all(checksum == expected for checksum in served)
        self.server_checked.append((version, exact))
        if not exact:
            logging.error("vLLM server differs from the trainer at version %d: %s", version, served)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--bucket",
        default="./deltas",
        help="local directory or bucket URL: file://, hf://buckets/..., s3://... (default: ./deltas)",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20; 0 only builds the model)")
    parser.add_argument("--anchor-every", type=int, default=10, help="full anchor every N versions (default: 10)")
    parser.add_argument(
        "--encoding",
        choices=("raw", "compact"),
        default="raw",
        help="delta encoding: raw (TRL's int32 + bf16) or compact (entropy-coded; default: raw)",
    )
    parser.add_argument("--keep-anchors", type=int, default=2, help="anchors kept in the bucket (default: 2)")
    parser.add_argument("--learning-rate", type=float, default=2e-5, help="AdamW learning rate (default: 2e-5)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model", help="train this causal LM checkpoint (a Hub id or a local directory) instead of the tiny one"
    )
    source.add_argument("--base-model-dir", help="also save the generated tiny model and tokenizer here")
    parser.add_argument("--vllm-url", help="generate through this vLLM server (running vllm_ext) and sync it too")
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="versions the server may lag when a generation starts (default 0: on-policy)",
    )
    parser.add_argument("--output-dir", default=None, help="trainer output directory (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete another run's files found in the bucket (default: refuse to start, as the library does)",
    )
    return parser.parse_args(argv)


def load_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """The model to train (fp32 master weights, as most trainers keep them; the bucket carries
    their bf16 rounding), a bf16 replica of the same architecture with other weights, and
    the tokenizer."""
    if args.model is None:
        model, tokenizer = build_tiny_model(args.base_model_dir, seed=args.seed, dtype=torch.float32)
        replica, _ = build_tiny_model(seed=args.seed + 1)
        return model, as_loaded_in_bf16(replica.to(torch.bfloat16)), tokenizer
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(args.seed + 1)  # random weights: the replica only matches once the first anchor lands
    replica = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.bfloat16)
    return model, as_loaded_in_bf16(replica), tokenizer


def as_loaded_in_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """A bf16 model built from its config, as `from_pretrained(dtype=torch.bfloat16)` would
    hold it: what it keeps in float32 (a MoE router) in float32."""
    weights = weights_of(model)
    for name in kept_in_float32(model, weights):
        weights[name].data = weights[name].data.float()
    return model


def server_verdict(check: ReplicaCheck) -> str:
    """`yes` when every version the server took matched the trainer, `no` when one diverged;
    a server that refused every update was never compared."""
    if any(not ok for _, ok in check.server_checked):
        return "no (diverged)"
    if not check.server_checked:
        return "not compared (it took no version)"
    return "yes" if not check.server_refused else "yes, for the versions it took"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.perf_counter()

    if args.steps == 0:
        if args.base_model_dir:
            build_tiny_model(args.base_model_dir, seed=args.seed, dtype=torch.float32)
        print(
            f"saved the base model and tokenizer to {args.base_model_dir}" if args.base_model_dir else "nothing to do"
        )
        return 0
    model, replica, tokenizer = load_models(args)

    sync = DeltaSyncCallback(
        bucket=args.bucket,
        anchor_every=args.anchor_every,
        encoding=args.encoding,
        keep_anchors=args.keep_anchors,
        overwrite=args.overwrite,
        max_staleness=args.max_staleness,
    )
    check = ReplicaCheck(sync, args.bucket, replica)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="grpo-delta-sync-")
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        **(
            dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=args.vllm_url, vllm_server_timeout=600)
            if args.vllm_url
            else {}
        ),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_cats,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
        callbacks=[sync, check],
    )
    trainer.train()

    reports = sync.reports
    files = sync.publisher.bucket.list()
    full_bytes = 2 * sum(tensor.numel() for tensor in weights_of(model).values())
    deltas = [r for r in reports if r.delta]
    delta_bytes = sum(r.delta_bytes for r in deltas) / max(1, len(deltas))
    exact = bool(check.checked) and all(ok for _, ok in check.checked)
    exact = exact and check.saved_check is not None and check.saved_check[0]
    if args.vllm_url:
        exact = exact and bool(check.server_checked) and all(ok for _, ok in check.server_checked)
        exact = exact and not check.server_refused
    rows = [
        ("steps", f"{trainer.state.global_step}"),
        ("versions published", f"{len(reports)}"),
        ("anchors written / kept", f"{sum(1 for r in reports if r.anchor)} / {len(step_versions(files, 'anchor'))}"),
        ("deltas written / kept", f"{len(deltas)} / {len(step_versions(files, 'delta'))}"),
        ("mean sparsity of deltas", f"{sum(r.sparsity for r in deltas) / max(1, len(deltas)):.4%}"),
        ("bytes per delta file (mean)", f"{delta_bytes:,.0f}"),
        ("full bf16 model", f"{full_bytes:,} bytes ({delta_bytes / full_bytes:.2%} per delta)"),
        ("replica checks", f"{len(check.checked)}"),
        ("replica bit-exact", "yes" if all(ok for _, ok in check.checked) and check.checked else "no"),
        ("bucket = save_pretrained", check.saved_check[1] if check.saved_check else "not compared (nothing published)"),
        *(
            [
                ("vLLM server checks", f"{len(check.server_checked)}"),
                ("vLLM server bit-exact", server_verdict(check)),
                *(
                    [
                        (
                            "vLLM server refused",
                            f"{len(check.server_refused)} update(s); first: {check.server_refused[0][1]}",
                        )
                    ]
                    if check.server_refused
                    else []
                ),
            ]
            if args.vllm_url
            else []
        ),
        ("wall time", f"{time.perf_counter() - started:.1f} s"),
    ]
    width = max(len(label) for label, _ in rows)
    print()
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(f"\nbucket: {sync.publisher.bucket.url}   (check it with: delta-sync verify {args.bucket})")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
