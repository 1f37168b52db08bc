"""The Docker Space for the rollout server. No Docker engine runs here, so this checks what
can be checked: the files reference things that exist, the card's port matches the
server's, and the server command line parses with vLLM's own argument parser."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest

from vllm_server import REPO, vllm_python

SPACE = REPO / "spaces" / "vllm-rollout"


def front_matter() -> dict[str, str]:
    text = (SPACE / "README.md").read_text()
    block = re.match(r"---\n(.*?)\n---\n", text, flags=re.S).group(1)
    return dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)


def server_command(**env: str) -> list[str]:
    """The argument list start.sh execs, with its variables substituted."""
    script = (SPACE / "start.sh").read_text()
    command = script[script.index("exec ") + len("exec ") : script.index("\n}")].replace("\\\n", " ")
    for name, value in env.items():
        command = command.replace(f'"${{{name}:-7860}}"', value).replace(f'"${name}"', value)
        command = command.replace(f"${{{name}:-}}", value)
    return shlex.split(command)


def test_card_declares_a_docker_space_on_the_server_port():
    card = front_matter()
    assert card["sdk"] == "docker"
    assert card["app_port"] == "7860"
    assert "PORT:-7860" in (SPACE / "start.sh").read_text()
    assert "EXPOSE 7860" in (SPACE / "Dockerfile").read_text()


def test_dockerfile_uses_the_vllm_image_and_existing_files():
    dockerfile = (SPACE / "Dockerfile").read_text()
    image = re.search(r"^FROM (\S+)", dockerfile, flags=re.M).group(1)
    assert image.startswith("vllm/vllm-openai:v")
    copied = re.findall(r"^COPY (\S+) ", dockerfile, flags=re.M)
    assert copied == ["src", "start.sh"]
    assert (SPACE / "start.sh").is_file()
    # src/ is the package source the deploy guide uploads next to the Dockerfile.
    guide = (REPO / "docs" / "spaces.md").read_text()
    assert "src" in guide and "hf upload" in guide
    extra = re.search(r'pip install [^\n]*"/opt/delta-sync\[(\w+)\]"', dockerfile).group(1)
    assert re.search(rf"^{extra} = \[", (REPO / "pyproject.toml").read_text(), flags=re.M)


@pytest.mark.slow
def test_server_command_parses_with_vllms_argument_parser():
    args = server_command(MODEL_ID="Qwen/Qwen3-0.6B", PORT="7860", VLLM_EXTRA_ARGS="--max-model-len 4096")
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
