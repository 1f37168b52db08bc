"""PEFT (LoRA) models are published merged, under the base checkpoint's names, bit-exact
against peft's own `merge_and_unload()`; models whose names a replica cannot load are
refused at train begin with nothing written."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import peft
import pytest
import torch
from torch import nn
from transformers import TrainerCallback

from delta_sync import BF16ChangeDetector, DeltaSyncCallback, Receiver, expected_shapes_of, module_weight_loader
from delta_sync.errors import UnservableModelError
from delta_sync.integrity import model_checksum, tensor_checksum

from tiny_model import build_tiny_model
from trainers import grpo_trainer

LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
ADAPTED = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in ("q", "v")}


def merged_bits(model: nn.Module) -> dict[str, torch.Tensor]:
    """What peft's own merge gives for the trainer's model now, as bf16 bit patterns."""
    merged = copy.deepcopy(model).merge_and_unload()
    return {name: p.detach().to(torch.bfloat16).view(torch.int16) for name, p in merged.named_parameters()}


def assert_same_bits(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(actual)
    differing = [name for name in expected if not torch.equal(expected[name], actual[name].view(torch.int16))]
    assert not differing, f"differ from merge_and_unload(): {differing}"


def lora_train_step(model: nn.Module, optimizer, seed: int) -> None:
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("base_dtype", "adapter_in_fp32"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32", "bf16-base-fp32-adapter", "bf16"],
)
def test_the_detector_tracks_merged_weights_bit_exact_with_peft(base_dtype, adapter_in_fp32):
    """bf16 adapters are upcast to fp32 inside peft's get_delta_weight on CPU and added in
    the weight's dtype; fp32 adapters on a bf16 base add in fp32 and round: all three match."""
    base, _ = build_tiny_model(dtype=base_dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA), autocast_adapter_dtype=adapter_in_fp32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    detector = BF16ChangeDetector(model, optimizer)
    try:
        assert sorted(name for name, _ in detector.named_parameters()) == sorted(merged_bits(model))
        assert_same_bits(merged_bits(model), detector.snapshot)
        for step in range(2):
            lora_train_step(model, optimizer, seed=step)
            change_set = detector.changes()
            # Only adapted modules can change; they all did.
            assert set(change_set.changes) == ADAPTED
            assert_same_bits(merged_bits(model), detector.snapshot)
    finally:
        detector.close()


class Wrapped(nn.Module):
    """A wrapper delta-sync does not know: it puts `inner.` in front of every name."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.inner(input_ids=input_ids, labels=labels).loss}


def test_an_unknown_wrapper_is_refused_at_train_begin_with_nothing_written(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    base, _ = build_tiny_model(dtype=torch.float32)
    bucket = tmp_path / "bucket"
    tokens = torch.randint(0, 500, (8, 16), generator=torch.Generator().manual_seed(0)).tolist()
    trainer = Trainer(
        model=Wrapped(base),
        args=TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, report_to="none", save_strategy="no"
        ),
        train_dataset=Dataset.from_dict({"input_ids": tokens, "labels": tokens}),
        callbacks=[DeltaSyncCallback(bucket=str(bucket))],
    )
    with pytest.raises(UnservableModelError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "'inner.lm_head.weight'" in message and "Qwen3ForCausalLM" in message
    assert "'lm_head.weight'" in message and "PEFT LoRA" in message
    assert not bucket.exists() or not any(bucket.rglob("*"))
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**LORA, "use_dora": True}, r"q_proj' uses the LoRA variant DoraLinearVariant"),
        ({**LORA, "modules_to_save": ["lm_head"]}, r"'lm_head' is a PEFT ModulesToSaveWrapper"),
        ({"r": 4, "target_modules": ["embed_tokens"]}, r"embed_tokens' is a PEFT peft.tuners.lora.layer.Embedding"),
    ],
    ids=["dora", "modules-to-save", "lora-embedding"],
)
def test_peft_features_merged_mode_cannot_publish_are_refused(config, match):
    base, _ = build_tiny_model(dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**config))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(UnservableModelError, match=match) as refused:
        BF16ChangeDetector(model, optimizer)
    assert "merge_and_unload()" in str(refused.value)


class MergedReplica(TrainerCallback):
    """Replays the bucket into a plain base model after every version and compares it,
    bit for bit, with merge_and_unload() of the trainer's model at that step."""

    def __init__(self, sync: DeltaSyncCallback, bucket) -> None:
        self.sync = sync
        self.bucket = bucket
        self.replica, _ = build_tiny_model(seed=123)
        self.receiver = Receiver(
            load_weights=module_weight_loader(self.replica), expected_shapes=expected_shapes_of(self.replica)
        )
        self.checked: list[int] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.sync.publisher.flush()
        assert self.receiver.update(self.bucket).version == state.global_step
        expected = merged_bits(model)
        assert_same_bits(expected, self.receiver.weights)
        assert_same_bits(expected, {name: p.detach() for name, p in self.replica.named_parameters()})
        self.checked.append(state.global_step)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["raw", "compact"])
def test_grpo_with_lora_publishes_merge_and_unload_bit_exact(tmp_path, encoding):
    bucket = tmp_path / "bucket"
    sync = DeltaSyncCallback(bucket=str(bucket), anchor_every=3, anchor_bytes_ratio=None, encoding=encoding)
    replica = MergedReplica(sync, bucket)
    trainer = grpo_trainer(tmp_path, [sync, replica], steps=5, learning_rate=1e-3, peft_config=peft.LoraConfig(**LORA))
    assert isinstance(trainer.model, peft.PeftModel)
    trainer.train()
    assert replica.checked == [1, 2, 3, 4, 5]
    assert [report.kind for report in sync.reports] == ["anchor", "delta", "delta", "delta+anchor", "delta"]
    # Only the four adapted weights change: a delta holds nothing else.
    adapted_elements = sum(math.prod(expected_shapes_of(replica.replica)[name]) for name in ADAPTED)
    assert all(0 < report.changed_elements <= adapted_elements for report in sync.reports[1:])


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serving_the_base_checkpoint_follows_a_lora_trainer(vllm_server, served_model, bucket_root, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_server import PROMPT, greedy, unpacked_checksums_match

    bucket = bucket_root / "peft-merged"
    sync = DeltaSyncCallback(bucket=str(bucket), anchor_every=2, vllm_url=vllm_server.url)

    class ServerCheck(TrainerCallback):
        def __init__(self) -> None:
            self.checked: list[int] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            sync.publisher.flush()
            assert not sync.replicas.wait(state.global_step, timeout=300), vllm_server.log_tail()
            merged = copy.deepcopy(model).merge_and_unload().eval()
            bf16 = {name: p.detach().to(torch.bfloat16) for name, p in merged.named_parameters()}
            assert vllm_server.status()["model_checksum"] == model_checksum(
                {name: tensor_checksum(t) for name, t in bf16.items()}
            )
            matched = unpacked_checksums_match(vllm_server, SimpleNamespace(bf16=lambda: bf16))
            assert "lm_head.weight" in matched and "model.layers.0.input_layernorm.weight" in matched
            with torch.no_grad():
                for name, param in merged.named_parameters():
                    param.copy_(bf16[name].float())
            assert vllm_server.greedy(PROMPT) == greedy(merged, PROMPT)
            self.checked.append(state.global_step)

    check = ServerCheck()
    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(served_model)
    trainer = grpo_trainer(
        tmp_path,
        [sync, check],
        steps=3,
        learning_rate=1e-2,
        model=model,
        tokenizer=tokenizer,
        peft_config=peft.LoraConfig(**LORA),
    )
    trainer.train()
    assert check.checked == [1, 2, 3]
    assert vllm_server.status()["version"] == 3
    assert all(report.changed_elements > 0 for report in sync.reports[1:])


@pytest.mark.slow
def test_a_lora_model_sharded_with_fsdp2_is_refused_on_every_rank(tmp_path):
    from test_distributed import torchrun

    bucket = tmp_path / "bucket"
    results = torchrun("fsdp2_peft_refused.py", 2, "--bucket", str(bucket))
    assert len(results) == 2 and all(result["refusal"] for result in results), results
    assert all("sharded PEFT model" in result["refusal"] and "DDP" in result["refusal"] for result in results)
    assert not bucket.exists() or not any(bucket.rglob("*"))
