"""The README's first command, run as a user would: in a fresh checkout, from nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return [block.strip() for block in blocks]


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
