"""DeltaSyncCallback under `accelerate launch`: TRL's GRPOTrainer with DDP on 2 CPU processes.

On a host without accelerators, Accelerate 1.15 starts several processes only through
torchrun, i.e. with a `MULTI_GPU` (or `FSDP`) configuration; the trainer's `use_cpu=True`
then makes it a `MULTI_CPU` run over gloo. A `MULTI_CPU` or `NO` configuration starts a
single process (without an MPI hostfile), whatever `num_processes` says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from delta_sync import BF16ChangeDetector, DeltaSyncCallback, verify_bucket
from delta_sync.errors import UnsupportedLayoutError

from helpers import free_port
from two_tower import TwoTower

SCRIPTS = Path(__file__).parent / "distributed"


def accelerate_config(path: Path, processes: int) -> Path:
    """An Accelerate config for DDP on this host's CPUs (see the module docstring)."""
    path.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: MULTI_GPU\n"
        f"num_processes: {processes}\n"
        "num_machines: 1\n"
        "machine_rank: 0\n"
        "main_process_ip: 127.0.0.1\n"
        f"main_process_port: {free_port()}\n"
        "use_cpu: true\n"
        "mixed_precision: 'no'\n"
    )
    return path


def accelerate_launch(
    tmp_path: Path, script: str, *args: str, processes: int = 2, timeout: float = 600
) -> subprocess.CompletedProcess:
    config = accelerate_config(tmp_path / "accelerate.yaml", processes)
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config)]
    command += ["--num_processes", str(processes), str(SCRIPTS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def results_of(run: subprocess.CompletedProcess) -> list[dict]:
    """The JSON each rank printed after `RESULT `, by rank."""
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line]
    return sorted(results, key=lambda result: result["rank"])


@pytest.mark.slow
def test_grpo_with_ddp_on_2_processes_publishes_once_and_replays_bit_exactly(tmp_path):
    bucket = tmp_path / "bucket"
    steps = 4
    run = accelerate_launch(tmp_path, "ddp_grpo.py", "--bucket", str(bucket), "--steps", str(steps))
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    ranks = results_of(run)
    assert [r["rank"] for r in ranks] == [0, 1]

    # Really one DDP run: one process group of 2, wrapped by DDP, each rank its own prompts,
    # and (gradients averaged) bit-identical parameters on both ranks at the end.
    for r in ranks:
        assert r["world_size"] == 2 and r["accelerate_processes"] == 2, r
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["ddp"], r
    first, second = ranks[0]["prompts_per_rank"]
    assert first and second and not set(first) & set(second)
    assert len(set(ranks[0]["digests"])) == 1

    # Exactly one publisher, and a replica following it is the trained model after every step.
    assert [r["publisher"] for r in ranks] == [True, False]
    assert ranks[0]["publishers"] == 1
    assert [v["version"] for v in ranks[0]["versions"]] == list(range(1, steps + 1))
    assert all(v["exact"] for v in ranks[0]["versions"]), ranks[0]["versions"]
    assert ranks[0]["kinds"] == ["anchor", "delta", "delta+anchor", "delta"]
    assert sum(ranks[0]["changed_elements"]) > 0  # the ranks agree on weights that did move
    assert ranks[1]["versions"] == [] and ranks[1]["kinds"] == []
    report = verify_bucket(str(bucket))
    assert report.ok, [step for step in report.steps if not step.ok]


@pytest.mark.slow
def test_ranks_that_train_independently_do_not_both_publish(tmp_path):
    # Under torchrun on a host without accelerators, a trainer without `use_cpu=True` gets
    # a torch.distributed group of 2 from Accelerate but runs as a single process on every
    # rank (no DDP, `is_world_process_zero` on both): two trainers on one prefix.
    bucket = tmp_path / "bucket"
    run = accelerate_launch(tmp_path, "ddp_grpo.py", "--bucket", str(bucket), "--steps", "2", "--forget-use-cpu")
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-6000:]
    assert len(results_of(run)) < 2
    assert "delta_sync.errors." in output, output[-6000:]
    # Whatever the first rank stored before the other was stopped is one run's, and consistent.
    if bucket.exists() and any(bucket.rglob("*.safetensors")):
        assert verify_bucket(str(bucket)).ok


def test_a_process_launched_as_one_of_several_without_a_process_group_is_refused(tmp_path, monkeypatch):
    # What a launcher leaves when N processes start but nothing joins them: N independent
    # trainers that would each publish to the same prefix.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UnsupportedLayoutError, match=r"WORLD_SIZE=2.*torch\.distributed is not initialized"):
        BF16ChangeDetector(model, optimizer)

    bucket = tmp_path / "bucket"
    callback = DeltaSyncCallback(bucket=str(bucket), background=False)
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
    with pytest.raises(UnsupportedLayoutError, match="WORLD_SIZE=2"):
        callback.on_train_begin(SimpleNamespace(use_vllm=False), state, None, model=model, optimizer=optimizer)
    assert callback.publisher is None
    assert not bucket.exists() or not any(bucket.rglob("*"))
