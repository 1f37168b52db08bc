"""`delta_sync.compile_cache`: a numba disk cache that concurrent compiles and other numba builds
cannot corrupt (the ranks of a `torchrun` job on a fresh cache; a trainer's and a vLLM server's
environment over one checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from delta_sync.compile_cache import BUILD, _DataFilesByKey

from helpers import REPO

MODULE = """
from delta_sync.compile_cache import njit_cached

@njit_cached(nogil=True)
def doubled_sum(values):
    return values.sum() * 2
"""


def _writers_that_read_the_index_before_either_wrote(directory: Path):
    """Two processes' cache files for one function, each having read the index while it was
    still empty. The interleaving is a race no test can bring about on demand, so each
    writer's reading of the index is fixed to what it read then."""
    writers = [_DataFilesByKey(str(directory), "module.function-1.py311", ("stamp", 1)) for _ in range(2)]
    for writer in writers:
        writer._load_index = lambda: {}
    return writers


def test_two_writers_of_different_overloads_never_share_a_data_file(tmp_path):
    first, second = _writers_that_read_the_index_before_either_wrote(tmp_path)
    second.save("key of the int64 overload", b"int64 machine code")
    first.save("key of the float64 overload", b"float64 machine code")
    reader = _DataFilesByKey(str(tmp_path), "module.function-1.py311", ("stamp", 1))
    index = reader._load_index()
    assert index, "the index names no overload"
    for key in index:
        assert reader.load(key) == f"{key.split()[3]} machine code".encode(), key


def _run(code: str, directory: Path, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=directory,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{directory}", "NUMBA_DEBUG_CACHE": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def compiled_module(tmp_path) -> Path:
    (tmp_path / "compiled_module.py").write_text(MODULE)
    return tmp_path


CALL_BOTH = """
import numpy as np
from compiled_module import doubled_sum
print("results", doubled_sum(np.arange(5, dtype=np.int64)), doubled_sum(np.arange(5.0)))
"""


def test_a_second_process_loads_each_overload_from_this_builds_directory(compiled_module):
    first = _run(CALL_BOTH, compiled_module)
    assert "results 20 20.0" in first and "data saved" in first
    again = _run(CALL_BOTH, compiled_module)
    assert "results 20 20.0" in again
    assert again.count("data loaded") == 2 and "data saved" not in again, again
    files = sorted(path.relative_to(compiled_module) for path in compiled_module.rglob("*.nb?"))
    assert files and all(path.parent == Path("__pycache__") / BUILD for path in files), files


def test_another_builds_files_are_never_read(compiled_module):
    """Files where numba's own `cache=True` (or another numba build) keeps them, made unreadable
    as machine code, are not looked at."""
    _run(CALL_BOTH, compiled_module)
    build = compiled_module / "__pycache__" / BUILD
    other = compiled_module / "__pycache__" / "numba-0.0.0-llvmlite-0.0.0"
    build.rename(other)
    for path in other.iterdir():
        if path.suffix == ".nbc":
            path.write_bytes(b"bitcode of another LLVM")
        (compiled_module / "__pycache__" / path.name).write_bytes(path.read_bytes())
    again = _run(CALL_BOTH, compiled_module)
    assert "results 20 20.0" in again and again.count("data saved") == 2, again


def test_numba_cache_dir_is_honoured(compiled_module, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("numba-cache")
    assert "results 20 20.0" in _run(CALL_BOTH, compiled_module, NUMBA_CACHE_DIR=str(elsewhere))
    assert list(elsewhere.rglob(f"{BUILD}/compiled_module.doubled_sum-*.nbc"))
    assert not (compiled_module / "__pycache__" / BUILD).exists()
