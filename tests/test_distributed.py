"""Sharded trainers for real: `torchrun` processes with the gloo backend on CPU.

Each test launches a script from tests/distributed/ and reads what its ranks print.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "distributed"


def torchrun(script: str, ranks: int, *args: str, timeout: float = 600) -> list[dict]:
    """Run a script on `ranks` processes; returns the JSON each rank printed after `RESULT `.

    Each rank's output goes to its own file (torchrun's `--redirects`), so that lines of
    several ranks never interleave.
    """
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            f"--log-dir={logs}",
            "--redirects=3",
        ]
        result = subprocess.run(
            [*command, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=timeout
        )
        outputs = {path: path.read_text() for path in Path(logs).rglob("std*.log")}
    printed = "".join(text for path, text in sorted(outputs.items()) if path.name == "stdout.log")
    everything = "\n".join(
        f"--- {path.parent.name}/{path.name}\n{text[-3000:]}" for path, text in sorted(outputs.items())
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:] + everything
    return [json.loads(line.split("RESULT ", 1)[1]) for line in printed.splitlines() if "RESULT " in line]


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


@pytest.fixture(scope="module")
def fsdp2_bucket(tmp_path_factory) -> Path:
    """A bucket written by a 2-rank FSDP2 run: anchors at v1 and v3, deltas v2-v4, in parts."""
    bucket = tmp_path_factory.mktemp("fsdp2") / "bucket"
    results = torchrun("fsdp2_publish.py", 2, "--bucket", str(bucket), "--steps", "4", "--anchor-every", "2")
    assert [v["version"] for v in results[0]["versions"]] == [1, 2, 3, 4]
    return bucket


@pytest.mark.slow
def test_fsdp2_on_2_ranks_publishes_parts_a_receiver_replays_bit_exactly(fsdp2_bucket):
    # The script itself asserts, after every version, that a Receiver following the bucket
    # equals full_tensor() bit for bit, that no weight was gathered while the callback ran,
    # and that each rank's snapshot is at most its shard plus one row per parameter.
    from delta_sync import verify_bucket

    parts = sorted(p.relative_to(fsdp2_bucket).as_posix() for p in fsdp2_bucket.rglob("part_*.safetensors"))
    assert "deltas/step_00000002/part_00000.safetensors" in parts
    assert "deltas/step_00000002/part_00001.safetensors" in parts
    assert not list(fsdp2_bucket.glob("deltas/*.safetensors")), "a sharded run must not write whole files"
    report = verify_bucket(str(fsdp2_bucket))
    assert report.ok, [step for step in report.steps if not step.ok]


@pytest.mark.slow
def test_fsdp2_on_3_ranks_with_fp32_masters_and_an_empty_shard(tmp_path):
    bucket = tmp_path / "bucket"
    results = torchrun(
        "fsdp2_publish.py", 3, "--bucket", str(bucket), "--steps", "3", "--anchor-every", "2", "--fp32-masters"
    )
    assert [v["version"] for v in results[0]["versions"]] == [1, 2, 3]
    from delta_sync import verify_bucket

    assert verify_bucket(str(bucket)).ok


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, flags",
    [(2, ()), (3, ("--fp32-masters", "--encoding", "compact", "--host-mirror"))],
    ids=["2-raw", "3-compact"],
)
def test_fsdp2_moe_publishes_each_experts_checkpoint_tensor_from_the_rank_holding_it(tmp_path, ranks, flags):
    # The fused experts [5, ...] are sharded by expert: each rank publishes the checkpoint's
    # per-expert tensors its block holds. The script checks a Receiver against the
    # checkpoint's tensors of the full weights after every version.
    bucket = tmp_path / "bucket"
    results = torchrun(
        "fsdp2_publish.py", ranks, "--bucket", str(bucket), "--steps", "3", "--anchor-every", "2", "--moe", *flags
    )
    assert [v["version"] for v in results[0]["versions"]] == [1, 2, 3]
    from delta_sync import read_file, verify_bucket

    assert verify_bucket(str(bucket)).ok
    # Each expert's tensors come whole from the one rank whose block holds that expert.
    for path in bucket.glob("anchors/*/part_*.safetensors"):
        header = read_file(path, part_of="test").header
        assert "model.layers.0.mlp.experts.gate_up_proj" not in header.shapes
        experts = [name for name in header.shapes if ".mlp.experts." in name]
        assert experts and all(
            header.block_shapes.get(name, header.shapes[name]) == header.shapes[name] for name in experts
        )


@pytest.mark.slow
def test_fsdp2_compact_parts_are_coded_in_each_ranks_blocks_and_replay_bit_exactly(tmp_path):
    # 3 ranks, fp32 masters, and q/k norms of 2 elements that leave one rank an empty shard.
    # The script checks a Receiver against the full weights after every version. Each rank
    # codes from a host mirror of its blocks (what a GPU trainer does by default).
    bucket = tmp_path / "bucket"
    results = torchrun(
        "fsdp2_publish.py", 3, "--bucket", str(bucket), "--steps", "4", "--anchor-every", "3",
        "--fp32-masters", "--encoding", "compact", "--host-mirror",
    )  # fmt: skip
    applied = [path for version in results[0]["versions"] for path in version["applied"]]
    assert any("/deltas/" in path for path in applied), "no delta was exercised"
    import torch

    from delta_sync import Receiver, read_file, verify_bucket

    # Every delta part is compact and coded in its rank's own row blocks.
    for path in bucket.glob("deltas/*/part_*.safetensors"):
        header = read_file(path, part_of="test").header
        assert header.encoding == "compact"
        assert all(
            header.block_shapes[name][0] < header.shapes[name][0]
            for name in header.shapes
            if name.endswith("proj.weight")
        )
    # Decoded, a version of parts names exactly the elements that changed, as a raw delta would.
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "delta_sync.cli",
            "inspect",
            "--decode",
            str(bucket / "deltas/step_00000003.manifest.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    decoded = {row["name"]: row["indices"] for row in map(json.loads, shown.stdout.splitlines())}
    before, after = Receiver(), Receiver()
    for receiver, version in ((before, 2), (after, 3)):
        receiver.update(str(bucket), "anchors/step_00000001.manifest.json")
        for step in range(2, version + 1):
            receiver.update(str(bucket), f"deltas/step_{step:08d}.manifest.json")
    changed = {
        name: (before.weights[name].view(torch.int16) != after.weights[name].view(torch.int16)).reshape(-1)
        for name in after.weights
    }
    assert decoded == {name: mask.nonzero().squeeze(1).tolist() for name, mask in changed.items() if mask.any()}
    assert verify_bucket(str(bucket)).ok


def _replica_at(bucket: Path, version: int):
    from delta_sync import Receiver

    receiver = Receiver()
    receiver.update(str(bucket), f"anchors/step_{version:08d}.manifest.json")
    return receiver


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing", "damaged", "from another version"])
def test_a_version_with_a_bad_part_is_refused_as_a_whole(fsdp2_bucket, tmp_path, fault):
    import shutil

    import torch

    from delta_sync import verify_bucket
    from delta_sync.errors import DeltaSyncError

    bucket = tmp_path / "bucket"
    shutil.copytree(fsdp2_bucket, bucket)
    part = bucket / "deltas/step_00000004/part_00001.safetensors"
    if fault == "missing":
        part.unlink()
    elif fault == "damaged":
        data = bytearray(part.read_bytes())
        data[-3] ^= 0x40  # a value byte of the last tensor
        part.write_bytes(bytes(data))
    else:
        shutil.copy(bucket / "deltas/step_00000003/part_00001.safetensors", part)
    receiver = _replica_at(bucket, 3)
    before = {name: t.clone() for name, t in receiver.weights.items()}
    checksum = receiver.model_checksum
    named = "deltas/step_00000004/part_00001.safetensors"  # every refusal names the part at fault
    problems = {"missing": f"no file '{named}'", "damaged": f"{named}: payload digest"}
    problem = problems.get(fault, f"{named}: its version")  # from another version
    with pytest.raises(DeltaSyncError, match=re.escape(problem)):
        receiver.update(str(bucket), "deltas/step_00000004.manifest.json")
    with pytest.raises(DeltaSyncError, match=re.escape(problem)):
        receiver.update(str(bucket))  # catch-up meets the same bad version
    assert receiver.version == 3 and receiver.model_checksum == checksum
    for name, tensor in before.items():
        assert torch.equal(tensor.view(torch.int16), receiver.weights[name].view(torch.int16)), name
    assert not verify_bucket(str(bucket)).ok


@pytest.mark.slow
def test_a_part_on_its_own_is_refused(fsdp2_bucket):
    from delta_sync.errors import FormatError

    receiver = _replica_at(fsdp2_bucket, 3)
    with pytest.raises(FormatError, match="apply the version's manifest"):
        receiver.update(str(fsdp2_bucket), "deltas/step_00000004/part_00000.safetensors")
    assert receiver.version == 3


@pytest.mark.slow
def test_fsdp2_example_runs_as_documented(tmp_path):
    from helpers import REPO

    example = REPO / "examples" / "fsdp2_delta_sync.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(example)]
    bucket = tmp_path / "deltas"
    result = subprocess.run(
        [*command, "--bucket", str(bucket), "--steps", "3", "--anchor-every", "2", "--encoding", "compact"],
        capture_output=True,
        text=True,
        timeout=600,
        # A rank that dies of a signal prints its threads' Python stacks first.
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert result.returncode == 0, failure_report(result.stdout + result.stderr)
    assert "replica bit-exact                  yes" in result.stdout
    from delta_sync import read_file, verify_bucket

    (part, *_) = sorted(bucket.glob("deltas/*/part_*.safetensors"))
    assert read_file(part, part_of="test").header.encoding == "compact"
    assert verify_bucket(str(bucket)).ok


def failure_report(output: str, size: int = 4000) -> str:
    """The end of a failed run's output and, where a rank died of a signal, its stacks: the
    other ranks' tracebacks that follow would push them out of the end."""
    fatal = output.find("Fatal Python error")
    if fatal < 0 or fatal >= len(output) - size:
        return output[-size:]
    return f"{output[fatal : fatal + size]}\n...\n{output[-size:]}"


@pytest.mark.slow
def test_cli_inspects_and_verifies_a_bucket_in_parts(fsdp2_bucket):
    from helpers import cli

    shown = cli("inspect", str(fsdp2_bucket / "deltas/step_00000002.manifest.json"), "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["kind"] == "delta" and summary["version"] == 2 and summary["base_version"] == 1
    assert summary["changed_elements"] == sum(t["changed"] for t in summary["tensors"].values()) > 0
    verified = cli("verify", str(fsdp2_bucket))
    assert verified.returncode == 0 and "verification passed" in verified.stdout
