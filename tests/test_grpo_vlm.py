"""A vision-language model trained by TRL's GRPOTrainer on image prompts, synced through a bucket:
the bucket's replay is what `save_pretrained` writes for the trained model, language model and
vision tower, name for name and bit for bit. A tiny random-init Qwen2.5-VL and its processor
are built here (nothing downloaded)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import bf16_bits

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
# The image processor without torchvision, and the configs' `rope_parameters`: transformers 5.
pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

#: A ChatML template that puts an image's placeholder where the message has an image part;
#: the processor expands `<|image_pad|>` to one token per merged patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: Every image is resized to 56 x 56 pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens.
IMAGE_PIXELS = 56 * 56


class ImageProcessor(transformers.Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor for images and text only: its video processor needs torchvision,
    which the image path (the PIL image processor) does not."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def build_processor() -> ImageProcessor:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    # Prompts are padded on the left, as TRL loads a processor it is given no processor for: the
    # processor's per-token image mask must line up with TRL's left-padded prompts.
    tokenizer.padding_side = "left"
    image_processor = Qwen2VLImageProcessorPil(min_pixels=IMAGE_PIXELS, max_pixels=IMAGE_PIXELS)
    return ImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def tiny_qwen2_5_vl_config(tokenizer):
    """Two decoder layers of width 128 (two heads of 64, multimodal rotary sections of 8, 12 and
    12 frequencies) and a two-block vision tower of width 64 whose merger feeds them."""
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = {"vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1}
    text |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}}
    text |= {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 128}
    return transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision | {"fullatt_block_indexes": [1]},
        tie_word_embeddings=False,
        vision_start_token_id=start,
        vision_end_token_id=end,
        image_token_id=image,
        video_token_id=video,
    )


def image_prompts(count: int):
    """Conversational prompts, each with an image of random pixels (TRL puts the image into the
    user's message)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(count)]
    questions = ["What is in the picture?", "Which colour is it?", "Is there a cat?", "How many dogs?"]
    prompts = [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(count)]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def reward_cats(completions, **kwargs) -> list[float]:
    """Mentions of "cat", plus a little for length, so rewards vary within a group."""
    texts = [completion[-1]["content"] for completion in completions]
    return [text.count("cat") + len(text) / 20 for text in texts]


def test_grpo_on_image_prompts_publishes_save_pretrained_of_the_vlm(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from delta_sync import DeltaSyncCallback, Receiver, expected_shapes_of, module_weight_loader

    processor = build_processor()
    config = tiny_qwen2_5_vl_config(processor.tokenizer)
    torch.manual_seed(3)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)  # fp32 master weights
    initial = {name: bf16_bits(p).clone() for name, p in model.named_parameters()}
    bucket = tmp_path / "deltas"
    sync = DeltaSyncCallback(bucket=str(bucket), anchor_every=10, encoding="raw")
    args = GRPOConfig(
        output_dir=str(tmp_path / "trainer"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=8,  # two images per step, four completions each
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=2e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_cats,
        args=args,
        train_dataset=image_prompts(16),
        processing_class=processor,
        callbacks=[sync],
    )
    assert trainer._is_vlm
    trainer.train()
    assert trainer.state.global_step == 2
    trained = trainer.accelerator.unwrap_model(trainer.model)

    # Both the language model and the vision tower were trained.
    moved = {name for name, p in trained.named_parameters() if not torch.equal(bf16_bits(p), initial[name])}
    assert any(name.startswith("model.language_model.") for name in moved), sorted(moved)
    assert any(name.startswith("model.visual.") for name in moved), sorted(moved)

    trained.save_pretrained(tmp_path / "saved")
    saved = {}
    for path in sorted((tmp_path / "saved").glob("*.safetensors")):
        saved.update(load_file(str(path)))
    # The checkpoint names the language model and the vision tower otherwise than the run-time model.
    assert any(name.startswith("model.layers.") for name in saved), sorted(saved)
    assert any(name.startswith("visual.blocks.") for name in saved), sorted(saved)

    # The last delta names vision tower tensors by their checkpoint names.
    with safe_open(str(bucket / "deltas" / "step_00000002.safetensors"), "pt") as delta:
        metadata = delta.metadata()
    assert metadata["encoding"] == "raw"
    changed = set(json.loads(metadata["changed_params"]))
    assert changed <= set(saved)
    assert any(name.startswith("visual.") for name in changed), sorted(changed)

    # A replica that joins now replays exactly what save_pretrained wrote, bit for bit.
    joiner = Receiver(load_weights=lambda weights: None, expected_shapes={name: t.shape for name, t in saved.items()})
    joiner.update(bucket)
    assert joiner.version == 2
    replayed = joiner.weights
    assert sorted(replayed) == sorted(saved)
    for name, tensor in saved.items():
        assert tuple(replayed[name].shape) == tuple(tensor.shape), name
        assert replayed[name].dtype == torch.bfloat16, name
        assert torch.equal(replayed[name].view(torch.int16), bf16_bits(tensor)), f"{name} differs"

    # A transformers replica with other weights, fed only from the bucket, holds the trainer's.
    torch.manual_seed(4)
    replica = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    follower = Receiver(load_weights=module_weight_loader(replica), expected_shapes=expected_shapes_of(replica))
    follower.update(bucket)
    assert follower.version == 2
    for name, p in trained.named_parameters():
        assert torch.equal(replica.get_parameter(name).view(torch.int16), bf16_bits(p)), f"{name} differs"
