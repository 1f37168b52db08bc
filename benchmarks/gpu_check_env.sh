#!/usr/bin/env bash
# The GPU check's environment, for a GPU machine that has torch, transformers, numba,
# safetensors (and peft) but cannot reach a package index.
#
# Here, with an index: build a wheelhouse of what delta-sync needs beyond those packages
# (delta-weight-sync itself and its pure-Python dependencies, plus xxhash and cryptography
# as binary wheels for the GPU machine's Python and platform):
#
#     benchmarks/gpu_check_env.sh wheelhouse wheelhouse
#     # another Python or platform there: GPU_PYTHON=312 GPU_PLATFORM=manylinux2014_aarch64 ...
#
# There, offline (copy the repository with the wheelhouse in it): the wheelhouse installed,
# with no index, into the environment of the Python that has torch (PYTHON, default python3:
# pip adds only what it lacks and leaves torch and the rest as they are), then the check (any
# further arguments go to benchmarks/gpu_check.py):
#
#     benchmarks/gpu_check_env.sh run wheelhouse --out gpu-check
#     PYTHON=/path/to/venv/bin/python benchmarks/gpu_check_env.sh run wheelhouse --out gpu-check
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
command="${1:?usage: $0 wheelhouse DIR | run DIR [gpu_check.py arguments]}"
dir="${2:?usage: $0 wheelhouse DIR | run DIR [gpu_check.py arguments]}"
shift 2
python="${PYTHON:-python3}"

case "$command" in
wheelhouse)
    mkdir -p "$dir"
    gpu_python="${GPU_PYTHON:-$("$python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')}"
    gpu_platform="${GPU_PLATFORM:-manylinux2014_x86_64}"
    # The package itself, without its dependencies: torch, numpy, numba and safetensors are
    # the GPU machine's own (a wheel of torch from here would be the wrong build for it).
    "$python" -m pip wheel --quiet --no-deps --wheel-dir "$dir" "$repo"
    # What `import delta_sync` needs that such a machine lacks, with their own dependencies,
    # as wheels for its Python and platform (the bounds are pyproject.toml's).
    "$python" -m pip download --quiet --dest "$dir" --only-binary=:all: \
        --platform "$gpu_platform" --python-version "$gpu_python" --implementation cp \
        "httpx>=0.27" "tenacity>=8.3" "xxhash>=3.4" "filelock>=3.12" "tqdm>=4.66" "cryptography>=42"
    ls "$dir"
    ;;
run)
    # No index: every requirement is either the environment's already or in the wheelhouse,
    # and pip says which one is missing if not.
    "$python" -m pip install --quiet --no-index --find-links "$dir" delta-weight-sync
    "$python" "$repo/benchmarks/gpu_check.py" "$@"
    ;;
*)
    echo "usage: $0 wheelhouse DIR | run DIR [gpu_check.py arguments]" >&2
    exit 2
    ;;
esac
