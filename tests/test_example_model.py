"""The main example trains a checkpoint given with `--model` (here a local directory) instead of its built-in model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

EXAMPLE = REPO / "examples" / "grpo_delta_sync.py"


def test_model_and_base_model_dir_exclude_each_other(capsys):
    from grpo_delta_sync import parse_args

    assert parse_args(["--model", "./checkpoint"]).model == "./checkpoint"
    with pytest.raises(SystemExit, match="^2$"):  # argparse's exit status for a usage error
        parse_args(["--model", "./checkpoint", "--base-model-dir", "./base-model"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_the_example_trains_a_checkpoint_directory_bit_exactly(tmp_path):
    from tiny_model import build_tiny_model

    # Not the example's built-in shape, so the table shows which model was trained.
    checkpoint = tmp_path / "checkpoint"
    model, _ = build_tiny_model(checkpoint, seed=3, hidden_size=64, num_layers=1)
    parameters = sum(p.numel() for p in model.parameters())
    bucket = tmp_path / "deltas"
    args = ["--model", str(checkpoint), "--bucket", str(bucket), "--steps", "3", "--anchor-every", "2"]
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert re.search(rf"full bf16 model\s+{2 * parameters:,} bytes", output), output[-3000:]
    assert re.search(r"replica checks\s+3\n", output), output[-3000:]
    assert re.search(r"replica bit-exact\s+yes", output), output[-3000:]
    verify = subprocess.run(
        [str(Path(sys.executable).parent / "delta-sync"), "verify", str(bucket)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "verification passed (latest v3, replayed v3)" in verify.stdout
