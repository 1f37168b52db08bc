"""The checkpoint a bucket holds is what `save_pretrained` writes: names, shapes and layout,
also for models that transformers keeps in another layout at run time (fused MoE experts,
renamed prefixes). Tiny random-init models of each family, nothing downloaded."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from delta_sync import BF16ChangeDetector, Publisher, Receiver, expected_shapes_of, module_weight_loader, verify_bucket
from delta_sync.checkpoint import CheckpointLayout, persistent_buffers
from delta_sync.errors import UnservableModelError
from delta_sync.format import SparseChange, read_file

transformers = pytest.importorskip("transformers")
core = pytest.importorskip("transformers.core_model_loading")

_ATTENTION = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 96}


def _qwen3():
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, **_ATTENTION)
    )


def _llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, **_ATTENTION)
    )


#: Four experts, two per token, in each of two layers.
_MOE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**_MOE, **_ATTENTION))


def _qwen2_moe():
    """With a shared expert beside the routed ones."""
    config = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=24, **_MOE, **_ATTENTION)
    return transformers.Qwen2MoeForCausalLM(config)


def _mixtral():
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_local_experts=4, **_ATTENTION
    )
    return transformers.MixtralForCausalLM(config)


def _olmoe():
    """OLMoE: Qwen2-MoE's conversion rule, no shared expert."""
    config = transformers.OlmoeConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, **_ATTENTION
    )
    return transformers.OlmoeForCausalLM(config)


def _glm4_moe():
    """GLM-4.5: Qwen2-MoE's conversion rule, a dense first layer, a shared expert, and a
    router score correction bias (a persistent buffer)."""
    config = transformers.Glm4MoeConfig(
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_ATTENTION,
    )
    return transformers.Glm4MoeForCausalLM(config)


def _qwen3_next():
    """Qwen3-Next: Qwen2-MoE's conversion rule in every layer, linear attention (gated delta
    net) in the first, full attention in the second."""
    config = transformers.Qwen3NextConfig(
        **_MOE,
        shared_expert_intermediate_size=24,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        **_ATTENTION,
    )
    return transformers.Qwen3NextForCausalLM(config)


def _gpt_oss():
    """gpt-oss keeps its experts fused, gate and up interleaved, at run time and on disk alike:
    no conversion, its checkpoint is its parameters."""
    config = transformers.GptOssConfig(
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention", "sliding_attention"],
        **_ATTENTION,
    )
    return transformers.GptOssForCausalLM(config)


def _gemma3_text():
    config = transformers.Gemma3TextConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, **_ATTENTION)
    return transformers.Gemma3ForCausalLM(config)


def _transposed_moe():
    """Qwen3-MoE with a conversion whose checkpoint tensors are transposed boxes of the fused
    experts (as `qwen3_vl_moe`'s `Transpose` gives): positions need sorting per box."""
    model = _qwen3_moe()
    model._weight_conversions = [
        core.WeightConverter(
            source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[core.MergeModulelist(dim=0), core.Concatenate(dim=1), core.Transpose(1, 2)],
        ),
        core.WeightConverter(
            source_patterns="mlp.experts.*.down_proj.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[core.MergeModulelist(dim=0)],
        ),
    ]
    return model


def _stored_transposed_moe():
    """Qwen3-MoE whose checkpoint stores each layer's fused experts transposed, as
    `qwen3_vl_moe`'s conversion does: one permuted box per run-time tensor."""
    model = _qwen3_moe()
    model._weight_conversions = [
        core.WeightConverter(
            source_patterns="mlp.experts.gate_up_proj",
            target_patterns="mlp.experts.gate_up_proj",
            operations=[core.Transpose(1, 2)],
        )
    ]
    return model


def _qwen2_5_vl():
    """A vision-language model: its checkpoint names the language model otherwise."""
    text = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 96}
    # Two heads of 16: multimodal rotary sections of 2, 3 and 3 frequencies.
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1}
    text |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 32}
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision | {"fullatt_block_indexes": [0]})
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _gemma3_vlm():
    text = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, **_ATTENTION, "vocab_size": 300}
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision | {"image_size": 28, "patch_size": 14}, mm_tokens_per_image=4
    )
    return transformers.Gemma3ForConditionalGeneration(config)


FAMILIES = {
    "qwen3": _qwen3,
    "llama": _llama,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "glm4_moe": _glm4_moe,
    "qwen3_next": _qwen3_next,
    "gpt_oss": _gpt_oss,
    "gemma3_text": _gemma3_text,
    "transposed_moe": _transposed_moe,
    "stored_transposed_moe": _stored_transposed_moe,
    "qwen2_5_vl": _qwen2_5_vl,
    "gemma3_vlm": _gemma3_vlm,
}
FUSED = {
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "qwen3_next",
    "transposed_moe",
    "stored_transposed_moe",
}
#: Checkpoints that only name some tensors otherwise.
RENAMED = {"qwen2_5_vl", "gemma3_vlm"}


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return FAMILIES[family]().to(torch.bfloat16)


def saved(model, directory) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes for the model."""
    model.save_pretrained(directory)
    return load_file(str(directory / "model.safetensors"))


def assert_same_checkpoint(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert tuple(actual[name].shape) == tuple(tensor.shape), name
        assert torch.equal(actual[name].view(torch.int16), tensor.view(torch.int16)), f"{name} differs"


def runtime_tensors(model) -> dict[str, torch.Tensor]:
    """The parameters and the persistent buffers (a checkpoint holds both)."""
    return {name: param.detach() for name, param in model.named_parameters()} | persistent_buffers(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layout_values_are_save_pretrained(family, tmp_path):
    model = build(family)
    layout = CheckpointLayout.of(model)
    assert layout.identity == (family not in FUSED | RENAMED)
    assert layout.renames_only == (family not in FUSED)
    values = layout.values(runtime_tensors(model))
    assert_same_checkpoint(saved(model, tmp_path), values)
    assert layout.shapes == {name: tuple(tensor.shape) for name, tensor in values.items()}


@pytest.mark.parametrize("family", sorted(FUSED))
def test_changed_positions_map_to_checkpoint_positions(family):
    model = build(family)
    layout = CheckpointLayout.of(model)
    before = runtime_tensors(model)
    generator = torch.Generator().manual_seed(1)
    after, changes, old_values = {}, {}, {}
    for name, tensor in before.items():
        count = max(1, tensor.numel() // 7)
        positions = torch.randperm(tensor.numel(), generator=generator)[:count].sort().values.to(torch.int32)
        changed = tensor.clone()
        # A new bit pattern at every chosen element: flip its lowest mantissa bit.
        changed.view(-1).view(torch.int16)[positions.long()] ^= 1
        after[name] = changed
        changes[name] = SparseChange(positions, changed.view(-1)[positions.long()])
        old_values[name] = tensor.reshape(-1)[positions.long()]
    mapped, mapped_old = layout.map_changes(changes, old_values)
    converted_before = core.revert_weight_conversion(model, dict(before))
    converted_after = core.revert_weight_conversion(model, dict(after))
    assert sum(len(change) for change in mapped.values()) == sum(len(change) for change in changes.values())
    for name, change in mapped.items():
        indices = change.indices.long()
        assert change.indices.dtype == torch.int32
        assert bool((indices[1:] > indices[:-1]).all()), f"{name}: positions not ascending"
        new, old = converted_after[name].reshape(-1), converted_before[name].reshape(-1)
        assert torch.equal(new[indices].view(torch.int16), change.values.view(torch.int16)), name
        assert torch.equal(old[indices].view(torch.int16), mapped_old[name].view(torch.int16)), name
        # Exactly these elements differ in the converted tensors.
        differing = (new.view(torch.int16) != old.view(torch.int16)).nonzero().reshape(-1)
        assert torch.equal(differing, indices), name
    untouched = [name for name in converted_before if name not in mapped]
    for name in untouched:
        assert torch.equal(converted_before[name].view(torch.int16), converted_after[name].view(torch.int16))


def _train(model, optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, model.get_input_embeddings().num_embeddings, (2, 12), generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("encoding", ["raw", "compact"])
@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "glm4_moe",
        "qwen3_next",
        "gpt_oss",
        "transposed_moe",
        "stored_transposed_moe",
        "qwen3",
        "qwen2_5_vl",
        "gemma3_vlm",
    ],
)
def test_bucket_replays_to_save_pretrained(family, encoding, tmp_path):
    model = build(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer)
    bucket = tmp_path / "bucket"
    # Anchors at versions 1 and 4 (with a delta: the chain's checksums are checked against it).
    publisher = Publisher(
        bucket, detector, anchor_every=3, anchor_bytes_ratio=None, background=False, encoding=encoding
    )
    # A replica that follows every version (through the deltas), a transformers model that
    # loads the checkpoint into its own run-time layout.
    replica = build(family, seed=1)
    follower = Receiver(load_weights=module_weight_loader(replica), expected_shapes=expected_shapes_of(replica))
    for version in range(1, 6):
        _train(model, optimizer, steps=1, seed=version)
        publisher.publish(version)
        assert follower.update(bucket).version == version
    publisher.close()
    detector.close()
    expected = saved(model, tmp_path / "saved")

    assert expected_shapes_of(replica) == {name: tuple(t.shape) for name, t in expected.items()}
    assert_same_checkpoint(expected, dict(follower.weights))
    assert_same_checkpoint(runtime_tensors(model), runtime_tensors(replica))
    assert verify_bucket(bucket).ok
    joiner = Receiver(load_weights=lambda weights: None, expected_shapes={n: t.shape for n, t in expected.items()})
    joiner.update(bucket)
    assert joiner.version == 5
    assert_same_checkpoint(expected, dict(joiner.weights))


def test_deltas_name_only_changed_checkpoint_tensors(tmp_path):
    """An expert no token was routed to has no entry in a delta."""
    from delta_sync.format import read_file

    model = build("qwen3_moe")
    # Only the first layer's experts 0 and 1 train: the rest of the model is frozen.
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("model.layers.0.mlp.experts."))
    experts = model.model.layers[0].mlp.experts
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer)
    publisher = Publisher(tmp_path / "bucket", detector, anchor_every=100, anchor_bytes_ratio=None, background=False)
    publisher.publish(1)
    with torch.no_grad():
        experts.gate_up_proj.grad = torch.zeros_like(experts.gate_up_proj)
        experts.gate_up_proj.grad[:2] = 1.0
        experts.down_proj.grad = torch.zeros_like(experts.down_proj)
        experts.down_proj.grad[1] = 1.0
    optimizer.step()
    publisher.publish(2)
    publisher.close()
    with read_file(tmp_path / "bucket" / publisher.reports[-1].delta) as delta:
        names = sorted(delta.header.shapes)
    prefix = "model.layers.0.mlp.experts."
    assert names == sorted(
        [f"{prefix}{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up")] + [f"{prefix}1.down_proj.weight"]
    )


def test_refuses_a_conversion_that_is_no_box():
    model = build("qwen3_moe")
    model._weight_conversions = [
        core.WeightConverter(
            source_patterns="mlp.experts.w13_weight",
            target_patterns="mlp.experts.gate_up_proj",
            operations=[core.Interleave(dim=1)],
        )
    ]
    with pytest.raises(
        UnservableModelError, match=r"qwen3_moe: .*'model\.layers\.0\.mlp\.experts\.w13_weight'.*Interleave"
    ):
        CheckpointLayout.of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UnservableModelError, match=re.escape("Interleave")):
        BF16ChangeDetector(model, optimizer)


def test_refuses_a_checkpoint_tensor_made_of_several_parameters():
    """q, k and v fused into one checkpoint tensor: no box of one run-time tensor."""
    model = build("qwen3")
    model._weight_conversions = [
        core.WeightConverter(
            source_patterns="self_attn.qkv_proj.weight",
            target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            operations=[core.Chunk(dim=0)],
        )
    ]
    with pytest.raises(UnservableModelError, match=r"qwen3: .*qkv_proj\.weight'.*Chunk"):
        CheckpointLayout.of(model)


def test_a_model_without_transformers_conversion_is_its_own_checkpoint():
    from two_tower import TwoTower

    layout = CheckpointLayout.of(TwoTower())
    assert layout.identity
    assert layout.shapes == {name: tuple(p.shape) for name, p in TwoTower().named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_moe", "transposed_moe"])
def test_a_ranks_block_of_fused_experts_publishes_blocks_of_checkpoint_tensors(family):
    """A rank holding rows 1-2 of the experts and columns 10-25 of their fused gate/up rows
    (as an FSDP2 shard of two dimensions would): its blocks of the per-expert tensors, and
    positions in them, are those of the whole checkpoint tensors cut to the block."""
    from delta_sync.blocks import Block, ModelLayout, ParamShard

    model = build(family)
    layout = CheckpointLayout.of(model)
    source = "model.layers.0.mlp.experts.gate_up_proj"
    full = dict(model.named_parameters())[source].detach()
    held = Block((1, 10, 0), (2, 16, full.shape[2]))
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    runtime = ModelLayout(1, 2, shapes, {source: ParamShard(source, shapes[source], held)}, sharded=True)
    published = layout.published_layout(runtime)
    whole = layout.values({source: full})
    values = layout.block_values({source: full[held.slices()]}, runtime, published, list(published.shards))
    # Experts 1 and 2, each with its gate rows 10-15 and its up rows 0-9.
    assert len(values) == 4 and sum(value.numel() for value in values.values()) == held.numel
    for name, value in values.items():
        assert torch.equal(
            value.view(torch.int16), whole[name][published.shards[name].block.slices()].view(torch.int16)
        )
    # Positions: every element of the block changed, mapped, then placed in each checkpoint block.
    positions = torch.arange(full.numel()).view(full.shape)[held.slices()].reshape(-1).to(torch.int32)
    mapped, _ = layout.map_changes({source: SparseChange(positions, full.view(-1)[positions.long()])})
    assert sorted(mapped) == sorted(values)
    for name, change in mapped.items():
        local = layout.block_positions(name, change.indices, published)
        assert torch.equal(local, torch.arange(values[name].numel())), name


def test_a_zero3_partition_of_fused_experts_is_refused():
    from delta_sync.blocks import Block, ModelLayout, ParamShard

    model = build("qwen3_moe")
    source = "model.layers.0.mlp.experts.gate_up_proj"
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    flat = Block((0,), (100,))
    zero3 = ModelLayout(0, 2, shapes, {source: ParamShard(source, shapes[source], flat)}, sharded=True)
    with pytest.raises(UnservableModelError, match=r"qwen3_moe: DeepSpeed ZeRO-3 partitions 'model\.layers\.0"):
        CheckpointLayout.of(model).published_layout(zero3)


def test_without_weight_conversions_the_checkpoint_is_the_parameters(monkeypatch):
    """transformers 4.x has no weight conversions: it saves MoE experts as they are held."""
    from delta_sync import checkpoint

    monkeypatch.setattr(checkpoint, "_revert_function", lambda: None)
    model = build("qwen3_moe")
    layout = CheckpointLayout.of(model)
    assert layout.identity
    assert layout.model_type == "qwen3_moe"
    assert "model.layers.0.mlp.experts.gate_up_proj" in layout.shapes


def test_a_sharded_model_whose_conversion_only_renames_keeps_its_blocks():
    from delta_sync.blocks import Block, ModelLayout, ParamShard

    model = build("qwen3")
    model._weight_conversions = [core.WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")]
    layout = CheckpointLayout.of(model)
    assert layout.renames_only and not layout.identity
    name, renamed = "model.layers.1.mlp.up_proj.weight", "model.layers.1.block_sparse_moe.up_proj.weight"
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    block = Block((8, 0), (8, shapes[name][1]))
    sharded = ModelLayout(1, 2, shapes, {name: ParamShard(name, shapes[name], block)}, sharded=True)
    published = layout.published_layout(sharded)
    assert set(published.shapes) == set(saved_names(model))
    assert published.shards == {renamed: ParamShard(renamed, shapes[name], block)}


def saved_names(model) -> list[str]:
    return sorted(core.revert_weight_conversion(model, {n: p.detach() for n, p in model.named_parameters()}))


def test_a_trainer_with_the_callback_publishes_the_checkpoint(tmp_path):
    """transformers' Trainer with DeltaSyncCallback on Mixtral (fused experts, renamed MoE block)."""
    from delta_sync import DeltaSyncCallback

    model = build("mixtral")
    generator = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, model.config.vocab_size, (12, 12), generator=generator)
    ]
    bucket = tmp_path / "bucket"
    sync = DeltaSyncCallback(bucket=str(bucket), background=False, anchor_every=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-3,
        save_strategy="no",
        disable_tqdm=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[sync]).train()
    assert [report.version for report in sync.reports] == [1, 2, 3]
    expected = saved(model, tmp_path / "saved")
    assert verify_bucket(bucket).ok
    receiver = Receiver(load_weights=lambda weights: None, expected_shapes={n: t.shape for n, t in expected.items()})
    receiver.update(bucket)
    assert_same_checkpoint(expected, dict(receiver.weights))


def test_a_lora_model_with_fused_experts_publishes_the_merged_checkpoint(tmp_path):
    """PEFT merged mode on Qwen3-MoE: the base checkpoint's names and layout, adapter merged."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build("qwen3_moe"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer)
    bucket = tmp_path / "bucket"
    publisher = Publisher(bucket, detector, anchor_every=100, anchor_bytes_ratio=None, background=False)
    for version in range(1, 4):
        _train(model, optimizer, steps=1, seed=version)
        publisher.publish(version)
    publisher.close()
    detector.close()
    expected = saved(model.merge_and_unload(), tmp_path / "saved")
    receiver = Receiver(load_weights=lambda weights: None, expected_shapes={n: t.shape for n, t in expected.items()})
    receiver.update(bucket)
    assert_same_checkpoint(expected, dict(receiver.weights))


def deepseek_v3_config():
    """A tiny DeepSeek-V3: latent attention, a dense first layer, then four routed experts."""
    return transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=96,
    )  # fmt: skip


def test_deepseek_v3_publishes_its_router_bias_a_buffer_no_optimizer_steps(tmp_path):
    """DeepSeek-V3's (and GLM-4.5's) checkpoint holds each MoE router's score correction
    bias, which transformers keeps as a buffer: anchors carry it like every checkpoint
    tensor, and a change made to it outside the optimizer (as auxiliary-loss-free load
    balancing does) reaches the next delta. The replayed bucket is save_pretrained of the
    trained model, and a transformers replica fed from it holds the same buffers."""
    config = deepseek_v3_config()
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = model.get_buffer(bias_name)
    bias.copy_(torch.randn(bias.shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer)
    bucket = tmp_path / "bucket"
    publisher = Publisher(bucket, detector, anchor_every=100, anchor_bytes_ratio=None, background=False)
    publisher.publish(1)
    assert bias_name in read_file(bucket / publisher.reports[-1].anchor).header.names
    bias.add_(0.25)  # outside any optimizer step
    publisher.publish(2)
    assert list(read_file(bucket / publisher.reports[-1].delta).changes) == [bias_name]
    _train(model, optimizer, steps=1, seed=2)
    publisher.publish(3)
    publisher.close()
    detector.close()
    expected = saved(model, tmp_path / "saved")
    assert bias_name in expected
    receiver = Receiver(load_weights=lambda weights: None, expected_shapes={n: t.shape for n, t in expected.items()})
    receiver.update(bucket)
    assert_same_checkpoint(expected, dict(receiver.weights))
    torch.manual_seed(1)
    replica = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    Receiver(load_weights=module_weight_loader(replica)).update(bucket)
    assert torch.equal(replica.get_buffer(bias_name).view(torch.int16), bias.view(torch.int16))
    assert_same_checkpoint(expected, saved(replica, tmp_path / "replica"))
