"""Sharded trainers for real: `torchrun` processes with the gloo backend on CPU.

Each test launches a script from tests/distributed/ and reads what its ranks print.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "distributed"


def torchrun(script: str, ranks: int, *args: str, timeout: float = 600) -> list[dict]:
    """Run a script on `ranks` processes; returns the JSON each rank printed after `RESULT `."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    result = subprocess.run(
        [*command, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines() if "RESULT " in line]


@pytest.mark.slow
def test_index_mapping_covers_every_element_once_on_4_ranks():
    # Shard(0), Shard(1), HSDP (Replicate, Shard(0)), (Shard(0), Shard(1)), nested and empty
    # shards; Partial, strided shards and plain tensors that differ across ranks refused.
    torchrun("index_mapping.py", 4)


@pytest.mark.slow
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_is_refused_at_train_begin_and_nothing_is_written(tmp_path, use_orig_params):
    bucket = tmp_path / "bucket"
    flags = ["--use-orig-params"] if use_orig_params else []
    results = torchrun("fsdp1_refused.py", 2, "--bucket", str(bucket), *flags)
    assert len(results) == 2 and all(r["refused"] for r in results)
    assert "FSDP1" in results[0]["message"] and "FSDP2" in results[0]["message"]
    assert not bucket.exists() or not any(bucket.rglob("*"))
