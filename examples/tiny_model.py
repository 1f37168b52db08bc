"""A tiny random-init Qwen3 model and tokenizer, built locally with no downloads.

Used by the examples and tests: `vllm serve` accepts the saved directory like any Hub
checkpoint, and TRL trains it on CPU in well under a second per step.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

__all__ = ["build_tiny_model", "build_tokenizer", "tiny_qwen3_config"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the a cat dog runs jumps over under quick brown lazy fox red blue green one two three four five "
    "six seven eight nine ten plus minus equals is what how why when hello world answer question"
).split()


def _corpus(size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(size):
        if rng.random() < 0.3:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        else:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
    return lines


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """Train a small byte-level BPE tokenizer with a ChatML-style chat template.

    Returns:
        A `transformers.PreTrainedTokenizerFast` with `<|im_end|>` as EOS and
        `<|endoftext|>` as padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(5000, seed), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_qwen3_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int | None = None,
    num_layers: int = 2,
    head_dim: int = 64,
    **fields,
):
    """The `transformers.Qwen3Config` of a tiny model: two attention heads sharing one KV
    head, untied embeddings, the MLP twice as wide unless `intermediate_size` says otherwise.

    `fields` are more `Qwen3Config` arguments (e.g. `max_position_embeddings`).
    """
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size if intermediate_size is None else intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        tie_word_embeddings=False,
        **fields,
    )


def build_tiny_model(
    save_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    lm_head_scale: float = 1.0,
):
    """Build a random-init Qwen3 causal LM and its tokenizer.

    The shapes (head_dim 64, one KV head, untied embeddings) are ones vLLM's CPU
    backend serves.

    Args:
        save_dir: If given, save the model (safetensors) and tokenizer there, ready for
            `vllm serve save_dir` or `from_pretrained(save_dir)`.
        seed: Seeds the weights and the tokenizer's training text.
        vocab_size: Model vocabulary (the tokenizer's may be a little smaller).
        hidden_size: Width; the MLP is twice as wide.
        num_layers: Decoder layers.
        dtype: Parameter dtype.
        lm_head_scale: Multiplies the output projection; a large value makes greedy
            decoding robust to kernel rounding differences.

    Returns:
        `(model, tokenizer)`.

    Example:
        ```python
        >>> model, tokenizer = build_tiny_model("./base-model")
        >>> sum(p.numel() for p in model.parameters())
        427264
        ```
    """
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tokenizer(vocab_size, seed)
    config = tiny_qwen3_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=str(dtype).removeprefix("torch."),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
    return model, tokenizer
