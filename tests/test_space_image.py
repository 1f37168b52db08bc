"""The Docker Space, built and served for real with podman: a Debian base made from packages
(no registry is needed), a CPU stand-in for vLLM's CUDA image on it (tests/space/Dockerfile.cpu),
and the Space's own Dockerfile on top of that, started as a Space starts it, with a bucket
mounted read-only and the token set.

The base and the stand-in are cached in podman's image store under tags derived from what
they are built from, so a second run on one machine builds only the Space's layers. Skipped,
with the reason, where podman, runc or mmdebstrap cannot run; in CI (`CI` set, as `.ci/run`
sets it after installing them) that is a failure instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from filelock import FileLock

from helpers import REPO, free_port, wait_for

pytestmark = [pytest.mark.space, pytest.mark.slow, pytest.mark.vllm]

SPACE = REPO / "spaces" / "vllm-rollout"
STANDIN = REPO / "tests" / "space" / "Dockerfile.cpu"
#: What the Debian base holds: what the stand-in's pip and the Space's start script need.
BASE_PACKAGES = "python3,python3-venv,python3-pip,bash,ca-certificates,libnuma1"
#: podman here: crun fails on this cgroup layout, and default rlimits are refused.
PODMAN_RUN = ["--runtime", "runc", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]
TOKEN = "space-test-token"
#: The package files the Space repository holds under src/ (docs/spaces.md, "Deploy").
SOURCE = ["pyproject.toml", "README.md", "delta_sync", "vllm_ext"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def digest(*parts: str | bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part.encode() if isinstance(part, str) else part)
    return hasher.hexdigest()[:12]


def pip_settings() -> tuple[list[str], list[str]]:
    """This machine's pip settings (a CA bundle, local wheels) as build arguments, and the
    read-only mounts they need during the build; nothing of them lands in an image."""
    build_args, mounts = [], []
    for name in ("PIP_CERT", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        value = os.environ.get(name)
        if not value:
            continue
        build_args += ["--build-arg", f"{name}={value}"]
        for item in value.split():
            path = item.removeprefix("file://")
            if path.startswith("/") and os.path.exists(path):
                mounts += ["-v", f"{path}:{path}:ro"]
    return build_args, mounts


def build(tag: str, context: Path, dockerfile: Path, *build_args: str, timeout: float = 1800) -> None:
    extra_args, mounts = pip_settings()
    podman(
        "build",
        *PODMAN_RUN,
        "--network",
        "host",
        *mounts,
        *extra_args,
        *build_args,
        "-f",
        str(dockerfile),
        "-t",
        tag,
        str(context),
        timeout=timeout,
    )


def cannot_run(reason: str) -> None:
    """Skip on a developer's machine; fail in CI, where the container tools are installed."""
    if os.environ.get("CI"):
        pytest.fail(f"the Space test cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def build_space_image(work: Path) -> str:
    """The Space's image, over the CPU stand-in for vLLM's image and the Debian base under it,
    built where podman's cache does not hold them already; its tag.

    `.ci/run` calls this (`python tests/test_space_image.py`) while its lanes run, so that the
    test's own build finds every layer in podman's cache; one build at a time (the test
    waits for that one)."""
    with FileLock(str(REPO / ".space-image.lock")):
        return _build_space_image(work)


def _build_space_image(work: Path) -> str:
    base = f"localhost/delta-sync-space-debian:{digest('bookworm', BASE_PACKAGES)}"
    if not image_exists(base):
        rootfs = work / "rootfs.tar"
        subprocess.run(
            ["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs)],
            check=True,
            capture_output=True,
            timeout=1200,
        )
        podman("import", str(rootfs), base, timeout=600)
        rootfs.unlink()
    try:
        podman("run", "--rm", *PODMAN_RUN, "--network", "none", base, "true", timeout=120)
    except RuntimeError as exc:
        cannot_run(f"podman cannot run containers here: {exc}")
    standin = f"localhost/delta-sync-space-cpu:{digest(base, STANDIN.read_bytes())}"
    if not image_exists(standin):
        build(standin, STANDIN.parent, STANDIN, "--build-arg", f"BASE_IMAGE={base}")
    # The Space repository's layout: the folder's files at the root, the package under src/.
    context = work / "space"
    shutil.copytree(SPACE, context)
    for name in SOURCE:
        source = REPO / name
        target = context / "src" / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    tag = "localhost/delta-sync-space-rollout:test"
    build(tag, context, context / "Dockerfile", "--build-arg", f"BASE_IMAGE={standin}")
    return tag


@pytest.fixture(scope="module")
def space_image(tmp_path_factory) -> str:
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            cannot_run(f"{tool} is not installed (apt-get install podman buildah mmdebstrap runc)")
    started = time.monotonic()
    tag = build_space_image(tmp_path_factory.mktemp("space-build"))
    print(f"Space image built in {time.monotonic() - started:.0f} s")
    return tag


class Trainer:
    """A tiny model trained a step at a time and published to a local bucket."""

    def __init__(self, model_dir: Path, bucket: Path) -> None:
        from transformers import AutoModelForCausalLM

        from delta_sync import BF16ChangeDetector, Publisher

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.detector = BF16ChangeDetector(self.model, self.optimizer)
        self.publisher = Publisher(bucket, self.detector, anchor_every=3, anchor_bytes_ratio=None, background=False)
        self.version = 0

    def step(self):
        tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(self.version))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.publisher.publish(self.version)
        self.publisher.flush()
        return self.publisher.reports[-1]

    def close(self) -> None:
        self.publisher.close()
        self.detector.close()


def readable_by_the_space_user(path: Path) -> Path:
    """The Space runs as user 1000: what it mounts must be readable by others."""
    for entry in [path, *path.rglob("*")]:
        entry.chmod(entry.stat().st_mode | (0o755 if entry.is_dir() else 0o644))
    return path


def test_the_space_image_serves_follows_and_stops(space_image, tmp_path):
    from delta_sync.control.client import Replica

    from tiny_model import build_tiny_model

    model_dir = tmp_path / "model"
    build_tiny_model(model_dir, lm_head_scale=8.0)
    bucket = tmp_path / "bucket"
    trainer = Trainer(model_dir, bucket)
    trainer.step()
    readable_by_the_space_user(model_dir)
    readable_by_the_space_user(bucket)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = f"delta-sync-space-{port}"
    podman(
        "run",
        "-d",
        *PODMAN_RUN,
        "--name",
        name,
        "--network",
        "host",
        "--shm-size=2g",
        "-v",
        f"{model_dir}:/model:ro",
        "-v",
        f"{bucket}:/bucket:ro",
        "-e",
        "MODEL_ID=/model",
        "-e",
        "DELTA_SYNC_ALLOWED_BUCKETS=file:///bucket",
        "-e",
        f"DELTA_SYNC_API_TOKEN={TOKEN}",
        "-e",
        "DELTA_SYNC_FOLLOW=file:///bucket",
        "-e",
        "DELTA_SYNC_FOLLOW_INTERVAL=2",
        "-e",
        f"PORT={port}",
        "-e",
        "VLLM_CPU_KVCACHE_SPACE=1",
        # On the host's network: listen on loopback only (the later --host wins).
        "-e",
        "VLLM_EXTRA_ARGS=--host 127.0.0.1 --enforce-eager --gpu-memory-utilization 0.5 --dtype float32 "
        "--max-model-len 512",
        space_image,
    )
    started = time.monotonic()

    def logs() -> str:
        result = podman("logs", name, check=False)
        return (result.stdout + result.stderr)[-4000:]

    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, lambda: f"the Space to answer /health:\n{logs()}", timeout=600, interval=2)
        print(f"the Space served after {time.monotonic() - started:.0f} s")
        status_body = {"method": "delta_sync_status"}
        refused = httpx.post(f"{url}/collective_rpc", json=status_body, timeout=30)
        assert refused.status_code == 401, refused.text
        replica = Replica(url, token=TOKEN)

        def serves(version: int):
            status = replica.status()
            return status if status.version == version else None

        # Follow: the Space reaches the bucket's newest version by itself.
        latest = json.loads((bucket / "latest.json").read_text())
        status = wait_for(lambda: serves(1), lambda: f"the Space to follow to v1:\n{logs()}", timeout=300, interval=2)
        assert status.model_checksum == latest["model_checksum"]
        # Push: the trainer names the next version's file; follow and push agree on it.
        report = trainer.step()
        readable_by_the_space_user(bucket)
        replica.update("file:///bucket", report.delta)
        status = wait_for(lambda: serves(2), lambda: f"the Space to serve v2:\n{logs()}", timeout=300, interval=2)
        assert status.model_checksum == json.loads((bucket / "latest.json").read_text())["model_checksum"]
        completion = httpx.post(
            f"{url}/v1/completions",
            json={"model": "/model", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] is not None
    finally:
        stopping = time.monotonic()
        podman("stop", "-t", "60", name, timeout=120, check=False)
        stop_seconds = time.monotonic() - stopping
        exit_code = podman("inspect", "--format", "{{.State.ExitCode}}", name, check=False).stdout.strip()
        output = logs()
        podman("rm", "-f", name, check=False)
        trainer.close()
    # A clean stop: start.sh ends the server and the follower on SIGTERM, well before podman's SIGKILL.
    assert exit_code == "0" and stop_seconds < 60, f"exit code {exit_code} after {stop_seconds:.0f} s:\n{output}"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="space-base-") as directory:
        print(build_space_image(Path(directory)))
