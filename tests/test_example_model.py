"""The main example trains a checkpoint given with `--model` (here a local directory) instead of its built-in model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO

EXAMPLE = REPO / "examples" / "grpo_delta_sync.py"


def test_model_and_base_model_dir_exclude_each_other(capsys):
    from grpo_delta_sync import parse_args

    assert parse_args(["--model", "./checkpoint"]).model == "./checkpoint"
    with pytest.raises(SystemExit, match="^2$"):  # argparse's exit status for a usage error
        parse_args(["--model", "./checkpoint", "--base-model-dir", "./base-model"])
    assert "not allowed with argument" in capsys.readouterr().err


def run_example(checkpoint: Path, bucket: Path, cwd: Path) -> str:
    """Runs the example on `checkpoint` for three steps (anchors at v1 and v3); its output."""
    args = ["--model", str(checkpoint), "--bucket", str(bucket), "--steps", "3", "--anchor-every", "2"]
    result = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert re.search(r"replica checks\s+3\n", output), output[-3000:]
    assert re.search(r"replica bit-exact\s+yes", output), output[-3000:]
    return output


def assert_bucket_verifies(bucket: Path) -> None:
    verify = subprocess.run(
        [str(Path(sys.executable).parent / "delta-sync"), "verify", str(bucket)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "verification passed (latest v3, replayed v3)" in verify.stdout


@pytest.mark.slow
def test_the_example_trains_a_checkpoint_directory_bit_exactly(tmp_path):
    from tiny_model import build_tiny_model

    # Not the example's built-in shape, so the table shows which model was trained.
    checkpoint = tmp_path / "checkpoint"
    model, _ = build_tiny_model(checkpoint, seed=3, hidden_size=64, num_layers=1)
    parameters = sum(p.numel() for p in model.parameters())
    bucket = tmp_path / "deltas"
    output = run_example(checkpoint, bucket, tmp_path)
    assert re.search(rf"full bf16 model\s+{2 * parameters:,} bytes", output), output[-3000:]
    tensors = len(list(model.named_parameters()))
    assert re.search(rf"bucket = save_pretrained\s+yes \({tensors} tensors: names, shapes and bf16 bits\)", output)
    assert_bucket_verifies(bucket)


@pytest.mark.slow
def test_the_example_trains_a_qwen3_moe_checkpoint_and_its_bucket_is_save_pretrained(tmp_path):
    """transformers fuses a Qwen3-MoE's experts at run time; the bucket holds the checkpoint's
    per-expert tensors, and the example checks them against save_pretrained of the trained model."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from tiny_model import build_tokenizer

    from delta_sync import Receiver

    checkpoint = tmp_path / "checkpoint"
    tokenizer = build_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(3)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    saved = load_file(str(checkpoint / "model.safetensors"))
    # Per expert in the checkpoint (fused into one tensor per layer at run time in transformers 5).
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in saved
    bucket = tmp_path / "deltas"
    output = run_example(checkpoint, bucket, tmp_path)
    parameters = sum(tensor.numel() for tensor in saved.values())
    assert re.search(rf"full bf16 model\s+{2 * parameters:,} bytes", output), output[-3000:]
    assert re.search(
        rf"bucket = save_pretrained\s+yes \({len(saved)} tensors: names, shapes and bf16 bits\)", output
    ), output[-3000:]
    assert_bucket_verifies(bucket)
    # A replica that joins now replays the checkpoint's own names and shapes.
    joiner = Receiver(load_weights=lambda weights: None, expected_shapes={name: t.shape for name, t in saved.items()})
    joiner.update(bucket)
    assert joiner.version == 3
    assert {name: tuple(t.shape) for name, t in joiner.weights.items()} == {
        name: tuple(t.shape) for name, t in saved.items()
    }
