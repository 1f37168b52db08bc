"""The README's and the docs' commands, as a user would copy them: the first one run in a
fresh checkout, from nothing; every `delta-sync` line parsed by our argument parser, every
vLLM server line by vLLM's own, and the Python snippet that reads a delta by hand run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from delta_sync.cli import build_parser

from helpers import REPO

#: The documents whose shell blocks a user copies from.
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: Shell syntax that separates commands on one line.
SEPARATORS = {"&&", "||", "|", ";", "&"}
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return [block.strip() for block in blocks]


def shell_blocks() -> list[tuple[str, str]]:
    """(document name, block text) of every ```bash block of the README and docs/."""
    found = []
    for document in DOCUMENTS:
        for block in re.findall(r"^ *```bash\n(.*?)^ *```", document.read_text(), flags=re.S | re.M):
            found.append((document.relative_to(REPO).as_posix(), block))
    return found


def commands(block: str) -> list[list[str]]:
    """The commands of a shell block, each as its argument list: continuation lines joined,
    comments dropped, `&&`-style sequences split, leading `NAME=value` assignments dropped."""
    result = []
    for line in block.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                while command and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", command[0]):
                    command.pop(0)
                if command:
                    result.append(command)
                command = []
            else:
                command.append(token)
    return result


def documented_commands() -> list[tuple[str, list[str], str]]:
    """(document, argument list, the block it came from) of every documented command."""
    return [(name, command, block) for name, block in shell_blocks() for command in commands(block)]


def delta_sync_commands() -> list[tuple[str, list[str]]]:
    return [(name, command[1:]) for name, command, _ in documented_commands() if Path(command[0]).name == "delta-sync"]


def vllm_commands() -> list[tuple[str, list[str], str]]:
    """(document, the server's arguments after the program, block) of every vLLM server line;
    `vllm serve MODEL ...` is given as `--model MODEL ...`, as the module form takes it."""
    found = []
    for name, command, block in documented_commands():
        if Path(command[0]).name == "vllm" and command[1:2] == ["serve"]:
            found.append((name, ["--model", *command[2:]], block))
        elif len(command) > 2 and command[1:3] == ["-m", VLLM_MODULE]:
            found.append((name, command[3:], block))
    return found


def test_every_documented_delta_sync_command_parses():
    found = delta_sync_commands()
    documents = {name for name, _ in found}
    assert len(found) >= 10 and {"README.md", "docs/security.md", "docs/vllm.md"} <= documents, found
    parser = build_parser()
    for name, args in found:
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{name}: `delta-sync {shlex.join(args)}` does not parse")
    subcommands = {args[0] for _, args in found}
    assert {"inspect", "verify", "keygen", "follow", "plot"} <= subcommands


def test_every_vllm_server_line_is_a_cpu_form_or_marked_gpu():
    found = vllm_commands()
    assert len(found) >= 6, found
    for name, args, block in found:
        where = f"{name}: {shlex.join(args)}"
        assert "--host" in args, f"{where}: no --host (vLLM listens on every interface by default)"
        if args[args.index("--host") + 1] != "127.0.0.1":
            assert "vllm_ext.auth.WeightRouteAuthMiddleware" in args, f"{where}: weight routes open to the network"
        assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs", where
        assert args[args.index("--worker-extension-cls") + 1] == "vllm_ext.DeltaWorkerExtension", where
        if "VLLM_CPU" in block:  # the CPU form: the module, a memory share the CPU backend accepts
            assert "--gpu-memory-utilization" in args, f"{where}: the CPU server refuses the default memory share"
        else:
            assert "GPU" in block, f"{where}: neither the CPU form nor marked as the GPU one"
    blocks = [block for _, _, block in found]
    assert any("VLLM_CPU" in block for block in blocks) and any("GPU" in block for block in blocks)


def parse_hf_command(args: list[str]) -> None:
    """Parse `hf ARGS` with the `hf` CLI's own (click) parser, down to the subcommand, running nothing."""
    import click
    from huggingface_hub.cli.hf import app

    command, context, name = app, None, "hf"
    while True:
        try:
            context = command.make_context(name, list(args), parent=context)
        except click.exceptions.Exit:  # missing arguments: the CLI prints its help instead
            raise click.UsageError(f"`hf {shlex.join(args)}` is incomplete") from None
        if not isinstance(command, click.Group):
            return
        # Unparsed words after a group's options: `_protected_args` in click 8.2+, `protected_args` before.
        protected = vars(context).get("_protected_args", vars(context).get("protected_args", []))
        name, command, args = command.resolve_command(context, [*protected, *context.args])


def test_every_documented_hf_command_parses():
    import click

    found = [(name, command[1:]) for name, command, _ in documented_commands() if command[0] == "hf"]
    assert {"docs/spaces.md", "docs/buckets-huggingface.md"} <= {name for name, _ in found}
    for name, args in found:
        try:
            parse_hf_command(args)
        except click.ClickException as exc:
            pytest.fail(f"{name}: `hf {shlex.join(args)}`: {exc.format_message()}")
    with pytest.raises(click.ClickException, match="--no-such-option"):
        parse_hf_command(["spaces", "secrets", "add", "me/vllm-rollout", "--no-such-option"])


def test_install_lines_name_the_distribution():
    for document in [*DOCUMENTS, REPO / "spaces" / "vllm-rollout" / "README.md"]:
        text = document.read_text()
        assert not re.search(r"pip install ['\"]?delta-sync\b", text), f"{document.name} installs `delta-sync`"
    readme = (REPO / "README.md").read_text()
    assert "pip install 'delta-weight-sync[hf]'" in readme and "pip install 'delta-weight-sync[plot]'" in readme
    assert 'name = "delta-weight-sync"' in (REPO / "pyproject.toml").read_text()


def test_reading_a_delta_by_hand_runs(run):
    """The README's snippet, on a bucket laid out as the Quickstart leaves it (an anchor and
    the delta after it), gives the trainer's weights of that version bit for bit."""
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"Reading a delta by hand.*?```python\n(.*?)```", readme, flags=re.S).group(1)
    names = re.findall(r'"deltas/((?:anchors|deltas)/step_(\d{8})\.safetensors)"', snippet)
    (anchor, anchor_version), (delta, delta_version) = names
    assert anchor.startswith("anchors/") and int(delta_version) == int(anchor_version) + 1
    run.publisher.flush()
    kept = sorted(int(p.name[5:13]) for p in (run.root / "anchors").glob("step_*.safetensors"))
    start = next(v for v in reversed(kept) if (run.root / "deltas" / f"step_{v + 1:08d}.safetensors").exists())
    bucket_dir = run.root.parent / "deltas"
    run.root.rename(bucket_dir)
    for old, new in [(anchor_version, start), (delta_version, start + 1)]:
        snippet = snippet.replace(f"step_{old}", f"step_{new:08d}")
    snippet = snippet.replace(f'== "{int(anchor_version)}"', f'== "{start}"')
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(bucket_dir.parent)
    try:
        exec(compile(snippet, "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    expected = run.states[start + 1]
    assert set(namespace["weights"]) == set(expected)
    for name, tensor in expected.items():
        assert namespace["weights"][name].view(-1).view(torch.int16).equal(tensor.view(-1).view(torch.int16)), name


@pytest.mark.vllm
@pytest.mark.slow
def test_every_vllm_server_line_parses_with_vllms_argument_parser():
    from vllm_server import vllm_python

    found = vllm_commands()
    script = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
        "failures = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        validate_parsed_serve_args(make_arg_parser(FlexibleArgumentParser()).parse_args(args))\n"
        "    except BaseException as exc:\n"
        "        failures.append([args, repr(exc)])\n"
        "print(json.dumps(failures))\n"
    )
    arguments = json.dumps([args for _, args, _ in found])
    result = subprocess.run([str(vllm_python()), "-c", script, arguments], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [], result.stdout[-3000:]


def fresh_checkout(dest: Path) -> Path:
    """The working tree as git would check it out (tracked and new, unignored files)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


@pytest.mark.slow
def test_first_command_sets_up_and_runs_the_main_job(tmp_path):
    first, second = readme_commands()[:2]
    assert "examples/grpo_delta_sync.py" in first and "pytest" in second
    checkout = fresh_checkout(tmp_path / "checkout")
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    result = subprocess.run(["bash", "-c", first], cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"replica bit-exact\s+yes", result.stdout), result.stdout[-3000:]
    verify = subprocess.run(
        [str(checkout / ".venv/bin/delta-sync"), "verify", "./deltas"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "verification passed (latest v20, replayed v20)" in verify.stdout
    # The README's later commands name files the Quickstart leaves behind.
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"Reading a delta by hand.*?```python\n(.*?)```", readme, flags=re.S).group(1)
    by_hand = subprocess.run(
        [str(checkout / ".venv/bin/python"), "-c", snippet], cwd=checkout, capture_output=True, text=True, timeout=600
    )
    assert by_hand.returncode == 0, by_hand.stdout + by_hand.stderr
    local_inspects = [args for _, args in delta_sync_commands() if args[0] == "inspect" and "://" not in args[1]]
    assert local_inspects
    for args in local_inspects:
        result = subprocess.run(
            [str(checkout / ".venv/bin/delta-sync"), *args], cwd=checkout, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, f"delta-sync {shlex.join(args)}: {result.stderr}"
