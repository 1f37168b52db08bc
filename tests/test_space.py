"""The Docker Space for the rollout server, without building it (tests/test_space_image.py
builds and serves it with podman): the files reference things that exist, the card's port
matches the server's, start.sh passes its arguments whole, and the server command line
parses with vLLM's own argument parser."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from vllm_server import vllm_python

SPACE = REPO / "spaces" / "vllm-rollout"


def front_matter() -> dict[str, str]:
    text = (SPACE / "README.md").read_text()
    block = re.match(r"---\n(.*?)\n---\n", text, flags=re.S).group(1)
    return dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)


def run_start_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """start.sh run by bash with the Space's variables, and a `python3` on PATH that runs
    `-c` scripts (start.sh splits VLLM_EXTRA_ARGS with one) and, asked to start the server,
    prints the arguments it was given as JSON instead."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
        f"exec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n"
    )
    fake.chmod(0o755)
    variables = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(SPACE / "start.sh")], env=variables, capture_output=True, text=True, timeout=60)


def server_command(tmp_path: Path, **env: str) -> list[str]:
    """The argument list start.sh execs, with its variables set."""
    env = {"DELTA_SYNC_ALLOWED_BUCKETS": "hf://buckets/me/run1", "DELTA_SYNC_API_TOKEN": "secret", **env}
    result = run_start_script(tmp_path, **env)
    assert result.returncode == 0, result.stderr
    return ["python3", *json.loads(result.stdout.strip().splitlines()[-1])]


def test_start_script_passes_extra_arguments_whole(tmp_path):
    extra = "--max-model-len 4096 --chat-template '/models/a template.jinja'"
    args = server_command(tmp_path, MODEL_ID="Qwen/Qwen3-0.6B", VLLM_EXTRA_ARGS=extra)
    assert args[-4:] == ["--max-model-len", "4096", "--chat-template", "/models/a template.jinja"]
    assert args[args.index("--port") + 1] == "7860" and args[args.index("--model") + 1] == "Qwen/Qwen3-0.6B"
    assert server_command(tmp_path, MODEL_ID="m")[-2:] == ["--logprobs-mode", "processed_logprobs"]


def test_start_script_refuses_bad_settings(tmp_path):
    missing = run_start_script(tmp_path, MODEL_ID="m", DELTA_SYNC_ALLOWED_BUCKETS="hf://buckets/me/run1")
    assert missing.returncode != 0 and "DELTA_SYNC_API_TOKEN" in missing.stderr
    unbalanced = run_start_script(
        tmp_path,
        MODEL_ID="m",
        DELTA_SYNC_ALLOWED_BUCKETS="hf://buckets/me/run1",
        DELTA_SYNC_API_TOKEN="secret",
        VLLM_EXTRA_ARGS="--chat-template 'unclosed",
    )
    assert unbalanced.returncode == 2 and "VLLM_EXTRA_ARGS" in unbalanced.stderr


def test_card_declares_a_docker_space_on_the_server_port():
    card = front_matter()
    assert card["sdk"] == "docker"
    assert card["app_port"] == "7860"
    assert "PORT:-7860" in (SPACE / "start.sh").read_text()
    assert "EXPOSE 7860" in (SPACE / "Dockerfile").read_text()


def test_dockerfile_uses_the_vllm_image_and_existing_files():
    dockerfile = (SPACE / "Dockerfile").read_text()
    # The base image is a build argument whose default is vLLM's CUDA image.
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, flags=re.M)
    image = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, flags=re.M).group(1)
    assert image.startswith("vllm/vllm-openai:v")
    assert "|| true" not in dockerfile  # a failing step stops the build
    copied = re.findall(r"^COPY (\S+) ", dockerfile, flags=re.M)
    assert copied == ["src", "start.sh"]
    assert (SPACE / "start.sh").is_file()
    # src/ is the package source the deploy guide uploads next to the Dockerfile.
    guide = (REPO / "docs" / "spaces.md").read_text()
    assert "src" in guide and "hf upload" in guide
    extra = re.search(r'pip install [^\n]*"/opt/delta-sync\[(\w+)\]"', dockerfile).group(1)
    assert re.search(rf"^{extra} = \[", (REPO / "pyproject.toml").read_text(), flags=re.M)


@pytest.mark.slow
@pytest.mark.vllm
def test_server_command_parses_with_vllms_argument_parser(tmp_path):
    args = server_command(tmp_path, MODEL_ID="Qwen/Qwen3-0.6B", PORT="7860", VLLM_EXTRA_ARGS="--max-model-len 4096")
    assert args[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert args[args.index("--middleware") + 1] == "vllm_ext.auth.WeightRouteAuthMiddleware"
    script = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
        "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "validate_parsed_serve_args(args)\n"
        "config = args.weight_transfer_config\n"
        "print(json.dumps({'model': args.model, 'port': args.port, 'host': args.host,\n"
        "  'extension': args.worker_extension_cls, 'backend': getattr(config, 'backend', None) or config['backend'],\n"
        "  'max_model_len': args.max_model_len}))\n"
    )
    result = subprocess.run([str(vllm_python()), "-c", script, *args[3:]], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert parsed == {
        "model": "Qwen/Qwen3-0.6B",
        "port": 7860,
        "host": "0.0.0.0",
        "extension": "vllm_ext.DeltaWorkerExtension",
        "backend": "delta",
        "max_model_len": 4096,
    }
    # The extension class named there exists and registers the backend.
    check = subprocess.run(
        [
            str(vllm_python()),
            "-c",
            "import vllm_ext; from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F; "
            "print(F._registry['delta']().__name__, vllm_ext.DeltaWorkerExtension.__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.stdout.split()[-2:] == ["DeltaWeightTransferEngine", "DeltaWorkerExtension"], check.stderr[-2000:]
