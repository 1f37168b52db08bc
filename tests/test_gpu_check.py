"""The GPU check runs the first time a GPU is lent: its CPU dry run, and its import in an
environment holding only what a GPU machine has plus the wheelhouse it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "benchmarks" / "gpu_check.py"
ENV_SCRIPT = REPO / "benchmarks" / "gpu_check_env.sh"

#: What a GPU machine is taken to have (besides torch): the packages the wheelhouse is not for.
GPU_MACHINE_PACKAGES = ["numba", "safetensors", "peft", "transformers"]


def test_the_gpu_checks_cpu_dry_run_passes_and_reports_every_figure(tmp_path):
    """`--device cpu` at small shapes runs every part of the check, as a script from another
    directory (so benchmarks/, not the repository, is what Python puts on the path)."""
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(CHECK), "--device", "cpu", "--sizes", "1e6", "--steps", "2", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["device"] == "cpu"
    # Detection equal to the compiled pass at every step (it raises otherwise), bf16 and fp32 masters.
    assert [row["master"] for row in results["checks"]] == [False, True]
    assert all(row["streams"] > 0 and len(row["changed_fraction"]) == 2 for row in results["checks"])
    # Every cost configuration, with its per-step figures.
    configs = [(row["master"], row["encoding"], row["snapshot_device"]) for row in results["costs"]]
    assert configs == [(master, encoding, "cpu") for master in (False, True) for encoding in ("raw", "compact", "raw")]
    for row in results["costs"]:
        assert len(row["blocked_seconds"]) == len(row["device_to_host_bytes"]) == 2
        assert row["device_to_host_bytes"] == [0, 0]  # nothing crosses on a CPU run
        assert all(count > 0 for count in row["changed_elements"])
    assert "| device detection = compiled pass |" in run.stdout and "| blocked s |" in run.stdout


def test_sizes_beyond_adamw_step_by_sign_without_state():
    """Above 4e9 parameters AdamW's moments do not fit beside the rest; the stand-in takes
    AdamW's first step (lr times the gradient's sign) and keeps no state."""
    import torch

    sys.path.insert(0, str(CHECK.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(CHECK.parent))
    model = torch.nn.Linear(4, 3)
    assert isinstance(gpu_check.make_optimizer(model, 1e9), torch.optim.AdamW)
    sign = gpu_check.make_optimizer(model, 8e9)
    before = model.weight.detach().clone()
    model.weight.grad = torch.randn(3, 4)
    sign.step()
    assert not sign.state
    assert torch.equal(model.weight.detach(), before - 3e-6 * model.weight.grad.sign())


def _index_reachable(scratch: Path) -> bool:
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(scratch), "tenacity"],
        capture_output=True,
        timeout=120,
    )
    return probe.returncode == 0


@pytest.mark.slow
def test_the_gpu_check_imports_with_only_the_machines_packages_and_the_wheelhouse(tmp_path):
    """A fresh environment with torch and the GPU machine's packages cannot import delta_sync
    (no httpx, tenacity, xxhash); the wheelhouse, installed with no index, is all it lacks."""
    if not _index_reachable(tmp_path / "probe"):
        pytest.skip("no package index reachable: the wheelhouse and the GPU machine's packages cannot be fetched")
    wheelhouse = tmp_path / "wheelhouse"
    build = subprocess.run(
        ["bash", str(ENV_SCRIPT), "wheelhouse", str(wheelhouse)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = sorted(path.name for path in wheelhouse.glob("*.whl"))
    assert any(name.startswith("delta_weight_sync-") for name in wheels), wheels
    assert not any(name.startswith(("torch-", "numpy-", "numba-")) for name in wheels), wheels

    machine = tmp_path / "machine"
    venv.create(machine, with_pip=True)
    python = str(machine / "bin" / "python")

    def pip(*args: str) -> None:
        done = subprocess.run([python, "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]

    pip("torch==2.13.0")  # first, so that nothing after it pulls a CUDA build
    pip(*GPU_MACHINE_PACKAGES)
    bare = subprocess.run([python, str(CHECK), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bare.returncode != 0 and "ModuleNotFoundError" in bare.stderr, bare.stderr[-2000:]

    # The documented command there: --no-index, and no pip configuration of this machine's
    # (which names local wheel folders) to find anything outside the wheelhouse.
    run = subprocess.run(
        ["bash", str(ENV_SCRIPT), "run", str(wheelhouse), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": python, "PIP_CONFIG_FILE": os.devnull},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "--sizes" in run.stdout
