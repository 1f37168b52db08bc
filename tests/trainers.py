"""A real TRL GRPOTrainer on a tiny local model, for the end-to-end tests."""

from __future__ import annotations

import os

import torch
from transformers import TrainerCallback

from delta_sync import DeltaSyncCallback, Receiver, expected_shapes_of, module_weight_loader

from tiny_model import build_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [f"{s} {v} the" for s in ("the cat", "a dog", "one fox", "my red") for v in ("sat on", "saw", "ran to", "is")]


def reward_cats(completions, **kwargs):
    return [completion.count("cat") + len(completion) / 20 for completion in completions]


def grpo_trainer(
    tmp_path,
    callbacks,
    *,
    steps: int,
    gradient_accumulation_steps: int = 1,
    learning_rate: float = 2e-5,
    model=None,
    tokenizer=None,
    peft_config=None,
    **config_overrides,
):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if model is None:
        model, tokenizer = build_tiny_model(dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(tmp_path / "trainer"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_completion_length=8,
        max_steps=steps,
        learning_rate=learning_rate,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **config_overrides,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_cats,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
    )


def trainer_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).view(torch.int16).clone() for name, p in model.named_parameters()}


def same_bits(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> bool:
    return sorted(expected) == sorted(weights) and all(
        torch.equal(expected[name], weights[name].view(torch.int16)) for name in expected
    )


class FollowingReplica(TrainerCallback):
    """A transformers replica that catches up from the bucket after every published version."""

    def __init__(self, sync: DeltaSyncCallback, bucket, *, start_at: int = 0, stop_after: int | None = None) -> None:
        self.sync = sync
        self.bucket = bucket
        self.start_at = start_at
        self.stop_after = stop_after
        self.replica, _ = build_tiny_model(seed=123)
        self.receiver = Receiver(
            load_weights=module_weight_loader(self.replica), expected_shapes=expected_shapes_of(self.replica)
        )
        self.results: list[tuple[int, bool, tuple[str, ...]]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step < self.start_at or (self.stop_after is not None and step > self.stop_after):
            return
        if self.sync.publisher is None or self.sync.publisher.last_version != step:
            return
        self.sync.publisher.flush()
        result = self.receiver.update(self.bucket)
        expected = trainer_bits(model)
        exact = same_bits(expected, self.receiver.weights) and same_bits(
            expected, {n: p.detach() for n, p in self.replica.named_parameters()}
        )
        self.results.append((step, exact, result.applied))


class LogRecorder(TrainerCallback):
    """Keeps a copy of every `logs` dict the trainer hands on, with what earlier callbacks added."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))
