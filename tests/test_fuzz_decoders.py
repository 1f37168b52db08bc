"""The decoder fuzzer (`tests/fuzz_decoders.py`) in child processes: compiled code that
corrupts memory kills its process rather than raising, so each group of targets runs in
its own, and this test fails naming the signal (SIGABRT or SIGSEGV: memory corruption)
as well as on any failed case. The regression cases under `tests/fuzz_cases/` run with
their target's group.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).with_name("fuzz_decoders.py")

# -k expressions of the fuzzer's tests: each group runs in one child process.
GROUPS = {
    "compact streams": "compact_stream",
    "anchor and delta files": "version_file",
    "manifests, pointers, signatures, adapters": "not compact_stream and not version_file",
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", GROUPS)
def test_decoders_refuse_hostile_input_without_crashing(group):
    # A test that hangs (corrupted memory can deadlock) ends its process with the stacks dumped;
    # in that one process (no workers of its own), whose output names the test it ran last.
    options = ["-v", "-p", "no:cacheprovider", "-n", "0", "--timeout=240", "--timeout-method=thread"]
    options += ["-k", GROUPS[group]]
    command = [sys.executable, "-m", "pytest", *options, str(FUZZER)]
    result = subprocess.run(command, cwd=FUZZER.parent.parent, capture_output=True, text=True, timeout=540)
    if "+ Timeout +" in result.stdout + result.stderr:
        stacks = crash_site(result.stdout + result.stderr)
        pytest.fail(f"the fuzzer of {group} hung (memory corruption?) in {running(result.stdout)}:\n{stacks}")
    if result.returncode < 0:
        pytest.fail(
            f"the fuzzer of {group} was killed by {signal.Signals(-result.returncode).name} (memory corruption in "
            f"compiled code?) in {running(result.stdout)}:\n{crash_site(result.stderr)}"
        )
    assert result.returncode == 0, f"the fuzzer of {group} failed:\n{result.stdout[-8000:]}{result.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 1, result.stdout[-2000:]


def running(stdout: str) -> str:
    """The test the child process was running when it died (pytest -v names it before its result)."""
    started = re.findall(r"^(tests/fuzz_decoders\.py::\S+)", stdout, re.MULTILINE)
    return started[-1] if started else "an unknown test"


def crash_site(stderr: str) -> str:
    """The fatal error and the frames of this project's code from the fault handler's report."""
    lines = stderr.splitlines()
    marks = ("Fatal Python error", "Timeout", "delta_sync/", "tests/")
    kept = [line for line in lines if any(mark in line for mark in marks)]
    return "\n".join(kept[:40]) or stderr[-4000:]
