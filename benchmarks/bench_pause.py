"""How long a real `vllm serve` stops generating for each kind of weight update.

Starts a real vLLM server (`python -m vllm.entrypoints.openai.api_server` from the vLLM
environment, `.venv-vllm` at the repository root unless `--vllm-python` names another) with
this package's worker extension, on a random-init Qwen3 model of configurable size (default
about 30M parameters) with a small tokenizer trained at run time. A streaming completion
runs throughout (a new one starts as soon as one ends), and when each token arrived is
recorded. A transformers copy of the model takes real AdamW steps (lr 3e-6 by default) on
fp32 master weights, and the real `Publisher` writes each version to a local bucket. The
trainer's real client (`delta_sync.control.client.Replica.update`) drives each update:
hint the server, wait until it reports the version prepared, then start / update / finish
(finish paused with vLLM's `/pause?mode=keep`, as the client does).

Update kinds, in this order:

* `delta`: one delta, posted `--post-after` seconds after it was published (the server's
  prefetch thread polls `latest.json` every 2 s and acts on the client's hint);
  `--repeats` times.
* `catch_up`: `--catch-up` deltas published back to back, then one catch-up to
  `latest.json`, posted at once.
* `anchor`: a version published as an anchor, its anchor file posted `--post-after`
  seconds later (the server has usually prepared it from its delta by then, and loads it
  as one).

For each update: the seconds of each phase (`prepare`: from the publication of its first
version, when the server may start preparing it, to `/start_weight_update`, with
`hint_wait`, the client's hint and its wait until prepared, at its end; `start`, `update`,
`finish`: `/pause`, `/finish_weight_update`, `/reset_prefix_cache` and `/resume`), the
tokens streamed in each, the longest gap between two tokens overlapping each and the whole
update window (a gap counts whole: a pause lasts until the next token, also when the
completion in flight must be recomputed after it), the tokens of that completion, and what
the server logged it wrote (tensors patched in place, changed elements, tensors written
whole into their own runtime tensors, tensors reloaded whole). Before any update, a quiet
window (`quiet_seconds`, longer until it holds `QUIET_TOKENS` tokens: a shared machine can
stall the server for seconds) gives the median inter-token gap, its longest gap (the
machine's own noise) and the cost of a utility call that does nothing and of
`delta_sync_status` while the server generates.

The server's worker extension here is `TimedLoadExtension` (below): vLLM's, plus the
seconds of each load timed inside the server, and a full reload of every tensor whole
through the engine's layerwise reload (what loading an anchor into a model in an unknown
state does), run twice after the updates. The pause's own work is the load;
`load_x_full` is its seconds over the full reload's (median). The targets of the design
(see the JSON's `targets`):

* `prepare_streams`: tokens arrive while a version is prepared, and no gap there is longer
  than 3x the quiet median gap. The gaps are those that open once this benchmark's trainer
  has published the update's last version: a catch-up's earlier versions are published
  (and prepared) while the trainer trains the next ones on the same cores, and a gap open
  at a publication began while the trainer wrote the files, neither of which a trainer on
  another machine would take from the server; the JSON gives both figures.
* `update_is_an_empty_rpc`: `/update_weights` costs no more than `/start_weight_update`
  plus 50 ms.
* `delta_load_x_full`: a single delta's load is at most 0.6x a full reload on a CPU server
  (0.1x on a GPU server).

Prints a table, writes `DIR/results.json` and `DIR/bench_pause.png` (tokens per 100 ms,
phases shaded). Ratios, not absolute seconds, are the figures to compare across machines.

    python benchmarks/bench_pause.py --out benchmarks/results/pause
    python benchmarks/bench_pause.py --quick --out benchmarks/results/pause-quick   # a small smoke run

`--device cuda` measures a GPU server: `--vllm-python` must then name a CUDA build of vLLM
(vLLM takes its device from its build), and the load target becomes 0.1x.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))  # the tiny model builder the tests use

from delta_sync import BF16ChangeDetector, Publisher  # noqa: E402
from delta_sync.control import Route  # noqa: E402
from delta_sync.control.client import Replica  # noqa: E402

from tiny_model import build_tokenizer, tiny_qwen3_config  # noqa: E402

PROMPT = [7, 42, 99, 123, 5, 300, 17, 256, 64, 8, 77, 401]
#: The design's targets (see the module docstring).
GAP_TARGET_X_MEDIAN = 3.0
#: Tokens the quiet window holds at the least, whatever its length: enough for a median gap.
QUIET_TOKENS = 20
#: Seconds the quiet window may run on past `quiet_seconds` to gather them.
QUIET_DEADLINE_SECONDS = 120.0
UPDATE_OVER_START_SECONDS = 0.05
LOAD_TARGET_X_FULL = {"cpu": 0.6, "cuda": 0.1}
#: Routes of the finish phase, as the client sends them.
FINISH_ROUTES = (Route.PAUSE, Route.FINISH, Route.RESET_PREFIX_CACHE, Route.RESUME)
LOAD_LINE = re.compile(
    r"wrote (?P<in_place>\d+) tensor\(s\) in place \((?P<elements>\d+) changed elements\), "
    r"(?P<rewritten>\d+) rewritten whole, reloaded (?P<whole>\d+) whole"
)


# -- analysis of a token timeline (pure) ----------------------------------------------------


def tokens_between(arrivals: Sequence[float], start: float, end: float) -> int:
    """Tokens that arrived in `[start, end)`; `arrivals` ascending."""
    return bisect.bisect_left(arrivals, end) - bisect.bisect_left(arrivals, start)


def longest_gap(arrivals: Sequence[float], start: float, end: float, *, opened_inside: bool = False) -> float | None:
    """The longest time between two consecutive tokens whose gap overlaps `[start, end]`.

    A gap counts whole, not clipped to the window: a pause caused inside the window lasts
    until the next token, even if that comes after it. A window with no token before it, or
    none after it, has no closed gap on that side: None when no gap overlaps.

    Args:
        arrivals: When each token arrived, ascending.
        start: Start of the window.
        end: End of the window.
        opened_inside: Count only gaps whose first token came inside the window (for a
            window whose cause cannot begin before it opens).
    """
    first = max(bisect.bisect_left(arrivals, start), 1)  # the first token after the window opens
    if opened_inside:
        first += 1  # the gap before that token opened before the window
    longest: float | None = None
    for i in range(first, len(arrivals)):
        if arrivals[i - 1] > end:
            break
        gap = arrivals[i] - arrivals[i - 1]
        longest = gap if longest is None else max(longest, gap)
    return longest


def median_gap(arrivals: Sequence[float], start: float, end: float) -> float | None:
    """Median time between consecutive token arrivals both inside `[start, end]`; None
    with fewer than two.

    Tokens that arrive together (the server sent several events at once, read in one go)
    count as one arrival: the median is then the cadence a reader sees, not zero.
    """
    inside = [t for t in arrivals if start <= t <= end]
    gaps = [b - a for a, b in zip(inside, inside[1:], strict=False) if b > a]
    return statistics.median(gaps) if gaps else None


def phase_windows(
    calls: Sequence[tuple[str, float, float]], published: float, posted: float, last_published: float | None = None
) -> dict[str, tuple[float, float]]:
    """Each phase's window of one `Replica.update`, from the routes it posted.

    Args:
        calls: `(route, sent, answered)` of every request of the update, in order.
        published: When the first version the update brings was published (`latest.json`
            moved: the server may start preparing it from then on).
        posted: When `Replica.update` was called.
        last_published: When its last version was published (default: `published`).

    Returns:
        `prepare`: from `published` to the first `/start_weight_update` (the server prepared
        the version meanwhile, on its prefetch thread); `prepare_trainer_idle`, its part
        after `last_published`, once this benchmark's trainer (which stands in for one on
        another machine, but shares this one's cores) has stopped training; `hint_wait`, its end: from `posted`
        (the client's hint, then its wait until prepared); `start` and `update`: their
        (last) requests; `finish`: from the first request of the finish routes (`/pause`,
        `/finish_weight_update`, `/reset_prefix_cache`, `/resume`) to the answer of the last.

    Raises:
        ValueError: A phase's request is missing from `calls`.
    """
    starts = [call for call in calls if call[0] == Route.START]
    updates = [call for call in calls if call[0] == Route.UPDATE]
    finish = [call for call in calls if call[0] in FINISH_ROUTES]
    if not (starts and updates and finish):
        raise ValueError(f"an update without start, update and finish requests: {[c[0] for c in calls]}")
    idle_from = published if last_published is None else last_published
    return {
        "prepare": (min(published, posted), starts[0][1]),
        "prepare_trainer_idle": (min(idle_from, posted), starts[0][1]),
        "hint_wait": (posted, starts[0][1]),
        "start": (starts[-1][1], starts[-1][2]),
        "update": (updates[-1][1], updates[-1][2]),
        "finish": (finish[0][1], finish[-1][2]),
    }


def attribute(arrivals: Sequence[float], windows: dict[str, tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """Per phase: seconds, tokens streamed, longest gap (see [`longest_gap`]); and the
    whole `update_window` from `start` to the end of `finish`."""
    report = {
        name: {
            "seconds": end - start,
            "tokens": tokens_between(arrivals, start, end),
            # Nothing of a version is prepared before its publication opens that window: a
            # gap open then is the trainer's, which wrote the version on these cores.
            "longest_gap_seconds": longest_gap(arrivals, start, end, opened_inside=name == "prepare_trainer_idle"),
        }
        for name, (start, end) in windows.items()
    }
    start, end = windows["start"][0], windows["finish"][1]
    report["update_window"] = {
        "seconds": end - start,
        "tokens": tokens_between(arrivals, start, end),
        "longest_gap_seconds": longest_gap(arrivals, start, end),
    }
    return report


def tokens_per_bin(arrivals: Sequence[float], origin: float, end: float, width: float = 0.1) -> list[int]:
    """Tokens per `width`-second bin from `origin` to `end`."""
    bins = [0] * max(1, int((end - origin) / width) + 1)
    for t in arrivals:
        if origin <= t <= end:
            bins[min(int((t - origin) / width), len(bins) - 1)] += 1
    return bins


def targets(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The design's targets, each with the measured ratio and `passed`."""
    median = results["quiet"]["median_gap_seconds"]
    updates = results["updates"]
    # Gaps while this benchmark's own trainer trains are the trainer's (it shares the cores
    # here, not in a deployment): the gap target reads the prepare window once it is idle.
    worst_prepare_gap = max((u["phases"]["prepare_trainer_idle"]["longest_gap_seconds"] or 0.0) for u in updates)
    worst_with_trainer = max((u["phases"]["prepare"]["longest_gap_seconds"] or 0.0) for u in updates)
    prepare_tokens = min(u["phases"]["prepare"]["tokens"] for u in updates)
    worst_update = max(u["phases"]["update"]["seconds"] - u["phases"]["start"]["seconds"] for u in updates)
    ratio = statistics.median(u["load_x_full"] for u in updates if u["kind"] == "delta")
    limit = LOAD_TARGET_X_FULL.get(results["device"], LOAD_TARGET_X_FULL["cpu"])
    return {
        "prepare_streams": {
            "what": f"tokens stream while each version is prepared; no gap there over {GAP_TARGET_X_MEDIAN:g}x the quiet median",
            "fewest_tokens_while_preparing": prepare_tokens,
            "longest_prepare_gap_x_median": worst_prepare_gap / median,
            "longest_prepare_gap_x_median_while_the_trainer_trained": worst_with_trainer / median,
            "limit_x_median": GAP_TARGET_X_MEDIAN,
            "passed": prepare_tokens > 0 and worst_prepare_gap <= GAP_TARGET_X_MEDIAN * median,
        },
        "update_is_an_empty_rpc": {
            "what": f"update_weights - start_weight_update <= {UPDATE_OVER_START_SECONDS * 1000:g} ms, every update",
            "worst_update_minus_start_seconds": worst_update,
            "limit_seconds": UPDATE_OVER_START_SECONDS,
            "passed": worst_update <= UPDATE_OVER_START_SECONDS,
        },
        "delta_load_x_full": {
            "what": f"a single delta's load over the full reload after it (median), at most {limit:g}x on {results['device']}",
            "ratio": ratio,
            "limit": limit,
            "passed": ratio <= limit,
        },
    }


# -- the token stream -------------------------------------------------------------------------


class TokenStream:
    """Streaming completions read on a thread of their own, one after the other, until
    closed: when each token arrived (`time.monotonic()`)."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.arrivals: list[float] = []
        #: How many tokens had arrived when each completion was sent.
        self.request_starts: list[int] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        self._url = url
        self._thread = threading.Thread(target=self._read, name="token-stream", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                self.request_starts.append(len(self.arrivals))
                with httpx.stream("POST", f"{self._url}/v1/completions", json=self._body, timeout=600) as reply:
                    reply.raise_for_status()
                    for line in reply.iter_lines():
                        if self._stop.is_set():
                            return  # closing the response ends the request
                        if line.startswith("data: {"):
                            self.arrivals.append(time.monotonic())
        except BaseException as exc:  # reported by `check`
            self.error = exc

    def check(self) -> None:
        """Raise what ended the stream early."""
        if self.error is not None:
            raise RuntimeError(f"the streaming completion failed: {self.error!r}")

    def close(self) -> list[float]:
        self._stop.set()
        self._thread.join(60)
        return list(self.arrivals)


# -- the trainer ------------------------------------------------------------------------------


class Trainer:
    """A transformers Qwen3 with fp32 master weights: real AdamW steps, published as bf16.

    Args:
        model_dir: The checkpoint the server serves (saved in bf16).
        bucket: Local bucket directory.
        lr: AdamW learning rate.
        anchor_every: The publisher's anchor period.
    """

    def __init__(self, model_dir: Path, bucket: Path, *, lr: float, anchor_every: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.vocab = self.model.config.vocab_size
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.detector = BF16ChangeDetector(self.model, self.optimizer)
        self.publisher = Publisher(
            bucket, self.detector, anchor_every=anchor_every, anchor_bytes_ratio=None, background=False
        )
        self.bucket = self.publisher.bucket.url
        self.version = 0

    def step(self) -> dict[str, Any]:
        """One optimizer step and its publication; what was published."""
        generator = torch.Generator().manual_seed(self.version)
        tokens = torch.randint(0, self.vocab, (2, 32), generator=generator)
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.publish()

    def publish(self) -> dict[str, Any]:
        self.version += 1
        self.publisher.publish(self.version)
        report = self.publisher.reports[-1]
        return {
            "version": report.version,
            "delta": report.delta,
            "anchor": report.anchor,
            "changed_fraction": report.changed_elements / report.total_elements,
            "published_at": time.monotonic(),
        }

    def close(self) -> None:
        self.publisher.close()
        self.detector.close()


def build_model(path: Path, *, hidden: int, layers: int, vocab: int, heads: int, max_len: int) -> int:
    """Save a random-init Qwen3 (bf16) and a BPE tokenizer trained now; its parameter count."""
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tokenizer(vocab)
    config = tiny_qwen3_config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_layers=layers,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    config.num_attention_heads = heads
    config.num_key_value_heads = max(1, heads // 4)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def layers_for(params: float, *, hidden: int, vocab: int, heads: int) -> int:
    """Decoder layers that bring a model of this width to about `params` parameters."""
    head_dim = 64
    kv = max(1, heads // 4)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    per_layer = attention + 3 * hidden * 3 * hidden + 2 * hidden + 2 * head_dim
    return max(1, round((params - 2 * vocab * hidden) / per_layer))


# -- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A real `vllm serve` with the delta engine on 127.0.0.1, its output in `log_path`.

    Args:
        python: The vLLM environment's interpreter.
        model_dir: The checkpoint to serve.
        bucket: The one bucket the server trusts.
        workdir: Its download cache and node snapshot go here.
        device: `cpu` or `cuda`.
        dtype: The served dtype.
        max_len: `--max-model-len`.
    """

    def __init__(
        self, python: Path, model_dir: Path, bucket: str, workdir: Path, *, device: str, dtype: str, max_len: int
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.model = str(model_dir)
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            DELTA_SYNC_ALLOWED_BUCKETS=bucket,
            DELTA_SYNC_CACHE=str(workdir / "cache"),
            TOKENIZERS_PARALLELISM="false",
            # The worker extension below lives in this file.
            PYTHONPATH=str(Path(__file__).resolve().parent),
        )
        self.args = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_len),
            "--enforce-eager",
            "--seed",
            "0",
            "--worker-extension-cls",
            f"{Path(__file__).stem}.TimedLoadExtension",
            "--weight-transfer-config",
            '{"backend": "delta"}',
        ]
        if device != "cpu":
            # vLLM takes its device from its build, not from an argument: only the CPU
            # backend's settings go, and the GPU gets a share of its memory.
            del self.env["VLLM_CPU_KVCACHE_SPACE"]
            self.args += ["--gpu-memory-utilization", "0.5"]
        self.process: subprocess.Popen | None = None

    @contextlib.contextmanager
    def running(self, timeout: float) -> Iterator[Server]:
        """Started and healthy inside, stopped (its whole process group) on exit."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            deadline = time.monotonic() + timeout
            while not self._healthy():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM server was not healthy after {timeout:.0f} s:\n{self.log_tail()}")
                time.sleep(0.5)  # polling a process that is starting; nothing to wait on instead
            yield self
        finally:
            self.stop()

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log()[-chars:]
        except OSError:
            return ""

    def rpc(self, method: str) -> tuple[Any, float, float]:
        """The first worker's answer to a `/collective_rpc` of `method`, when it was sent
        and when it was answered."""
        sent = time.monotonic()
        reply = httpx.post(f"{self.url}{Route.COLLECTIVE_RPC}", json={"method": method}, timeout=600)
        answered = time.monotonic()
        reply.raise_for_status()
        return reply.json()["results"][0], sent, answered


class TimedReplica(Replica):
    """The trainer's client, recording when each of its requests was sent and answered
    (every request of `Replica` goes through its `_post`)."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.calls: list[tuple[str, float, float]] = []

    def _post(self, route: str, **kwargs: Any) -> dict:
        sent = time.monotonic()
        try:
            return super()._post(route, **kwargs)
        finally:
            self.calls.append((str(route), sent, time.monotonic()))


try:
    from vllm_ext import DeltaWorkerExtension as _ServerExtension
except ImportError:  # the benchmark's own process has no vLLM; only the server uses the class below
    _ServerExtension = object


class LoadTimer:
    """Wraps the engine's loader (a `PatchingWeightLoader`): how long each load took.

    Args:
        loader: The engine's `ModelLoader`.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.loads: list[dict[str, Any]] = []

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> object:
        started = time.perf_counter()
        try:
            return self.loader(weights)
        finally:
            self.loads.append({"how": "whole", "tensors": len(weights), "seconds": time.perf_counter() - started})

    def __getattr__(self, name: str) -> Any:  # `writable()` and the rest: the loader's own
        return getattr(self.loader, name)

    def load_patches(self, patches: list[Any]) -> object:
        started = time.perf_counter()
        try:
            return self.loader.load_patches(patches)
        finally:
            self.loads.append({"how": "patches", "tensors": len(patches), "seconds": time.perf_counter() - started})


class TimedLoadExtension(_ServerExtension):
    """The server's worker extension in this benchmark: `vllm_ext.DeltaWorkerExtension`
    with the seconds of each load, and a full reload to compare them with."""

    def bench_pause_noop(self) -> None:
        """Nothing: the cost of a utility call itself."""

    def bench_pause_loads(self) -> list[dict[str, Any]]:
        """The loads since the last call (timing them from the first call on)."""
        engine = self._delta_engine()
        if not isinstance(engine.loader, LoadTimer):
            engine.loader = LoadTimer(engine.loader)
        loads, engine.loader.loads = engine.loader.loads, []
        return loads

    def bench_pause_full_reload(self) -> dict[str, Any]:
        """Reload every tensor of the served version whole, through the engine's layerwise
        reload (what the load of an anchor into a model in an unknown state does); the
        model ends up holding the same weights."""
        engine = self._delta_engine()
        receiver = engine.receiver
        if receiver.pending is not None:
            raise RuntimeError("a full reload needs no update in progress")
        loader = engine.loader.loader if isinstance(engine.loader, LoadTimer) else engine.loader
        with receiver.store.tensors(receiver.serving, list(receiver.weights)) as tensors:
            started = time.perf_counter()
            loader(sorted(tensors.items()))
            seconds = time.perf_counter() - started
        return {"tensors": len(tensors), "seconds": seconds}


# -- the run ----------------------------------------------------------------------------------


@dataclass
class Settings:
    """What one run measures.

    Args:
        params: Model size, in parameters (the layer count follows).
        hidden: Model width.
        vocab: Vocabulary size.
        heads: Attention heads (a quarter of them key/value heads).
        lr: AdamW learning rate.
        repeats: Single-delta updates.
        catch_up: Deltas in the catch-up update.
        post_after: Seconds between publishing a version and posting its update.
        quiet_seconds: The window with no update that gives the median gap (longer, until
            it holds `QUIET_TOKENS` tokens).
        device: What the server runs on (`cpu`, or `cuda` with a CUDA build of vLLM).
        dtype: The served dtype.
        max_len: `--max-model-len`, and the model's context.
        server_timeout: Seconds the server may take to become healthy.
    """

    params: float = 30e6
    hidden: int = 512
    vocab: int = 8192
    heads: int = 8
    lr: float = 3e-6
    repeats: int = 3
    catch_up: int = 4
    post_after: float = 5.0
    quiet_seconds: float = 6.0
    device: str = "cpu"
    dtype: str = "float32"
    max_len: int = 4096
    server_timeout: float = 900.0


def settle(stream: TokenStream, seconds: float) -> None:
    """Let the server generate for `seconds` with nothing else happening (the measurement
    needs wall time to pass; no condition ends it earlier)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stream.check()
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def run_update(
    replica: TimedReplica,
    server: Server,
    kind: str,
    bucket: str,
    filename: str | None,
    version: int,
    published: list[dict[str, Any]],
) -> dict[str, Any]:
    """One `Replica.update`, timed by phase, with what the server logged it loaded."""
    logged = len(server.log())
    replica.calls.clear()
    began = time.monotonic()
    status = replica.update(bucket, filename, version=version)
    if status.version != version:
        raise RuntimeError(f"the server serves v{status.version} after an update to v{version}")
    log = server.log()[logged:]
    wrote = [{k: int(v) for k, v in m.groupdict().items()} for m in LOAD_LINE.finditer(log)]
    finish = [c for c in replica.calls if c[0] == Route.FINISH][-1]
    loads = server.rpc("bench_pause_loads")[0]
    return {
        "kind": kind,
        "version": version,
        "filename": filename,
        "versions": [p["version"] for p in published],
        "changed_fraction": [p["changed_fraction"] for p in published],
        "posted_after_publish_seconds": began - published[-1]["published_at"],
        "began": began,
        "windows": phase_windows(replica.calls, published[0]["published_at"], began, published[-1]["published_at"]),
        "finish_rpc_seconds": finish[2] - finish[1],
        # The load itself, timed inside the server: the pause's own work.
        "load_seconds": sum(load["seconds"] for load in loads),
        "prepared_inline": "inline" in log,
        "prepared_ahead": f"version {version} is prepared in the node snapshot" in log,
        "loaded": wrote[-1] if wrote else None,
        "rpcs": [{"route": route, "seconds": answered - sent} for route, sent, answered in replica.calls],
    }


def measure(settings: Settings, python: Path, workdir: Path) -> dict[str, Any]:
    """Build the model, start the server, stream, publish and update; the raw results."""
    model_dir, bucket_dir = workdir / "model", workdir / "bucket"
    layers = layers_for(settings.params, hidden=settings.hidden, vocab=settings.vocab, heads=settings.heads)
    params = build_model(
        model_dir,
        hidden=settings.hidden,
        layers=layers,
        vocab=settings.vocab,
        heads=settings.heads,
        max_len=settings.max_len,
    )
    torch.manual_seed(0)
    # The trainer stands in for one on another machine: one core, so that it takes as
    # little as it can from the server sharing this one.
    torch.set_num_threads(1)
    # The anchor comes right after the repeated deltas and the catch-up.
    anchor_every = 1 + settings.repeats + settings.catch_up
    trainer = Trainer(model_dir, bucket_dir, lr=settings.lr, anchor_every=anchor_every)
    server = Server(
        python,
        model_dir,
        trainer.bucket,
        workdir,
        device=settings.device,
        dtype=settings.dtype,
        max_len=settings.max_len,
    )
    results: dict[str, Any] = {
        "device": settings.device,
        "model": {"parameters": params, "hidden": settings.hidden, "layers": layers, "vocab": settings.vocab},
        "versions_from": f"real AdamW steps, lr {settings.lr:g}, on fp32 master weights (bf16 published)",
        "settings": asdict(settings),
        "cpus": os.cpu_count(),
    }
    replica = TimedReplica(server.url, timeout=600, prepare_timeout=120)
    try:
        with server.running(settings.server_timeout):
            first = trainer.publish()  # v1: the anchor every update builds on
            replica.update(trainer.bucket, first["anchor"], version=first["version"])
            server.rpc("bench_pause_loads")  # loads are timed from here on
            stream = TokenStream(server.url, server.model, settings.max_len - len(PROMPT) - 8)
            try:
                deadline = time.monotonic() + 300
                while len(stream.arrivals) < 5:
                    stream.check()
                    if time.monotonic() > deadline:
                        raise RuntimeError("no token streamed within 300 s")
                    time.sleep(0.1)
                quiet_start = time.monotonic()
                settle(stream, settings.quiet_seconds)
                deadline = time.monotonic() + QUIET_DEADLINE_SECONDS
                while tokens_between(stream.arrivals, quiet_start, time.monotonic()) < QUIET_TOKENS:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"fewer than {QUIET_TOKENS} tokens streamed in the quiet window "
                            f"({settings.quiet_seconds + QUIET_DEADLINE_SECONDS:.0f} s)"
                        )
                    settle(stream, 0.5)
                quiet_end = time.monotonic()
                # Utility calls while it generates: one that does nothing, and the status.
                noop = [(lambda r: r[2] - r[1])(server.rpc("bench_pause_noop")) for _ in range(5)]
                status = [(lambda r: r[2] - r[1])(server.rpc("delta_sync_status")) for _ in range(5)]
                results["quiet"] = {
                    "start": quiet_start,
                    "end": quiet_end,
                    "noop_rpc_seconds": noop,
                    "status_rpc_seconds": status,
                }
                updates: list[dict[str, Any]] = []
                full_reloads: list[dict[str, Any]] = []

                def updated(update: dict[str, Any]) -> None:
                    # Each load is paired with a full reload right after it, on the same
                    # server in the same state of the machine: their ratio is the figure.
                    settle(stream, 1.0)
                    answer, sent, answered = server.rpc("bench_pause_full_reload")
                    update["full_reload"] = {**answer, "window": (sent, answered)}
                    full_reloads.append(update["full_reload"])
                    updates.append(update)
                    settle(stream, 1.0)

                for _ in range(settings.repeats):
                    published = trainer.step()
                    settle(stream, settings.post_after)
                    updated(
                        run_update(
                            replica,
                            server,
                            "delta",
                            trainer.bucket,
                            published["delta"],
                            published["version"],
                            [published],
                        )
                    )
                batch = [trainer.step() for _ in range(settings.catch_up)]
                updated(run_update(replica, server, "catch_up", trainer.bucket, None, batch[-1]["version"], batch))
                published = trainer.step()
                if published["anchor"] is None:
                    raise RuntimeError(f"v{published['version']} was to be an anchor; the publisher wrote a delta only")
                settle(stream, settings.post_after)
                updated(
                    run_update(
                        replica,
                        server,
                        "anchor",
                        trainer.bucket,
                        published["anchor"],
                        published["version"],
                        [published],
                    )
                )
                results["full_reloads"] = full_reloads
                stream.check()
            finally:
                arrivals = stream.close()
            results["request_starts"] = stream.request_starts
    finally:
        replica.close()
        trainer.close()
    results["arrivals"] = arrivals
    results["updates"] = updates
    return results


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Attribute tokens and gaps to phases; relative figures and the targets."""
    arrivals = raw["arrivals"]
    quiet = raw["quiet"]
    quiet["median_gap_seconds"] = median_gap(arrivals, quiet["start"], quiet["end"])
    quiet["tokens_per_second"] = tokens_between(arrivals, quiet["start"], quiet["end"]) / (
        quiet["end"] - quiet["start"]
    )
    quiet["noop_rpc_median_seconds"] = statistics.median(quiet["noop_rpc_seconds"])
    quiet["status_rpc_median_seconds"] = statistics.median(quiet["status_rpc_seconds"])
    if quiet["median_gap_seconds"] is None:
        raise RuntimeError("fewer than two tokens streamed in the quiet window")
    for full in raw["full_reloads"]:
        full["longest_gap_seconds"] = longest_gap(arrivals, *full["window"])
    raw["full_reload_seconds"] = statistics.median(full["seconds"] for full in raw["full_reloads"])
    quiet_gap = longest_gap(arrivals, quiet["start"], quiet["end"])
    quiet["longest_gap_x_median"] = None if quiet_gap is None else quiet_gap / quiet["median_gap_seconds"]
    for update in raw["updates"]:
        # Tokens of the completion in flight when the update was posted: what vLLM recomputes
        # if the pause preempts it.
        begun = bisect.bisect_right(arrivals, update["began"])
        starts = [i for i in raw["request_starts"] if i <= begun]
        update["in_flight_tokens"] = len(PROMPT) + begun - (starts[-1] if starts else 0)
        update["phases"] = attribute(arrivals, update["windows"])
        update["load_x_full"] = update["load_seconds"] / update["full_reload"]["seconds"]
        # From the answer to `/resume` to the next token: vLLM recomputing what the pause
        # preempted (a `/pause` clears the KV cache of the requests it holds).
        finished = update["windows"]["finish"][1]
        following = bisect.bisect_right(arrivals, finished)
        update["resume_wait_seconds"] = arrivals[following] - finished if following < len(arrivals) else None
        gap = update["phases"]["update_window"]["longest_gap_seconds"]
        update["longest_gap_x_median"] = None if gap is None else gap / quiet["median_gap_seconds"]
    raw["targets"] = targets(raw)
    return raw


def print_table(results: dict[str, Any]) -> None:
    model = results["model"]
    quiet = results["quiet"]
    print(
        f"model: Qwen3, {model['parameters'] / 1e6:.1f}M parameters (hidden {model['hidden']}, "
        f"{model['layers']} layers, vocabulary {model['vocab']}); device {results['device']}; "
        f"{results['cpus']} CPU(s); versions from {results['versions_from']}"
    )
    print(
        f"quiet: {quiet['tokens_per_second']:.1f} tokens/s, median gap {quiet['median_gap_seconds'] * 1000:.0f} ms, "
        f"RPC that does nothing {quiet['noop_rpc_median_seconds'] * 1000:.0f} ms, "
        f"delta_sync_status {quiet['status_rpc_median_seconds'] * 1000:.0f} ms (medians of 5, while streaming); "
        f"longest gap {quiet['longest_gap_x_median'] or 0:.1f}x the median"
    )
    print(
        f"full reload (every tensor whole, layerwise, in the server, after each update): median "
        f"{results['full_reload_seconds']:.3f} s; longest token gaps "
        + ", ".join(f"{full['longest_gap_seconds'] or 0:.3f} s" for full in results["full_reloads"])
    )
    header = "| update | changed | in flight | prepare s (tokens) | hint wait s | start s | update s | finish s (tokens) | load s | load x full | resume wait s | longest gap s (x median) | patched (elements) / rewritten / reloaded |"
    print(header)
    print("| --- " * (header.count("|") - 1) + "|")
    for u in results["updates"]:
        p = u["phases"]
        loaded = u["loaded"]
        wrote = (
            "-"
            if loaded is None
            else f"{loaded['in_place']} ({loaded['elements']} el.) / {loaded['rewritten']} / {loaded['whole']}"
        )
        gap = p["update_window"]["longest_gap_seconds"]
        resume = u["resume_wait_seconds"]
        resume_text = "-" if resume is None else f"{resume:.3f}"
        gap_text = "-" if gap is None else f"{gap:.3f} ({u['longest_gap_x_median']:.1f}x)"
        print(
            f"| {u['kind']} v{u['version']} | {100 * statistics.mean(u['changed_fraction']):.2f}% "
            f"| {u['in_flight_tokens']} "
            f"| {p['prepare']['seconds']:.2f} ({p['prepare']['tokens']}) | {p['hint_wait']['seconds']:.3f} "
            f"| {p['start']['seconds']:.3f} "
            f"| {p['update']['seconds']:.3f} | {p['finish']['seconds']:.3f} ({p['finish']['tokens']}) "
            f"| {u['load_seconds']:.3f} | {u['load_x_full']:.2f} "
            f"| {resume_text} "
            f"| {gap_text} | {wrote} |"
        )
    for name, target in results["targets"].items():
        shown = {
            k: (round(v, 3) if isinstance(v, float) else v) for k, v in target.items() if k not in ("what", "passed")
        }
        print(f"target {name}: {'PASS' if target['passed'] else 'FAIL'}: {target['what']}: {shown}")


def plot(results: dict[str, Any], path: Path) -> None:
    """Tokens per 100 ms over the run, each update's phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arrivals = results["arrivals"]
    origin = results["quiet"]["start"]
    end = arrivals[-1]
    bins = tokens_per_bin(arrivals, origin, end)
    colours = {"prepare": "tab:green", "start": "tab:orange", "update": "tab:purple", "finish": "tab:red"}
    figure, axes = plt.subplots(figsize=(14, 4))
    axes.step([0.1 * i for i in range(len(bins))], bins, where="post", color="black", linewidth=0.8)
    for update in results["updates"]:
        for name, (start, stop) in update["windows"].items():
            if name not in colours:
                continue  # `hint_wait` is the end of `prepare`
            axes.axvspan(start - origin, stop - origin, color=colours[name], alpha=0.35, linewidth=0)
        axes.text(
            update["windows"]["start"][0] - origin,
            max(bins) * 1.02,
            f"{update['kind']} v{update['version']}",
            fontsize=7,
        )
    handles = [matplotlib.patches.Patch(color=c, alpha=0.35, label=n) for n, c in colours.items()]
    for full in results["full_reloads"]:
        axes.axvspan(full["window"][0] - origin, full["window"][1] - origin, color="tab:gray", alpha=0.35, linewidth=0)
    handles.append(matplotlib.patches.Patch(color="tab:gray", alpha=0.35, label="full reload"))
    axes.legend(handles=handles, loc="upper right", fontsize=8)
    axes.set_xlabel("seconds")
    axes.set_ylabel("tokens per 100 ms")
    axes.set_title(
        f"streamed tokens during weight updates ({results['model']['parameters'] / 1e6:.0f}M Qwen3, "
        f"vLLM on {results['device']})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=30e6, help="model size in parameters (default 30e6)")
    parser.add_argument("--hidden", type=int, default=512, help="model width")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate")
    parser.add_argument("--repeats", type=int, default=3, help="single-delta updates")
    parser.add_argument("--catch-up", type=int, default=4, help="deltas in the catch-up update")
    parser.add_argument("--post-after", type=float, default=5.0, help="seconds between publishing and posting")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="the server's device; cuda needs --vllm-python of a CUDA build of vLLM",
    )
    parser.add_argument("--dtype", default="float32", help="the served dtype (float32 on the CPU backend)")
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"), help="vLLM's interpreter")
    parser.add_argument("--quick", action="store_true", help="a small, short smoke run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pause"), help="output directory")
    args = parser.parse_args(argv)
    settings = Settings(
        params=args.params,
        hidden=args.hidden,
        vocab=args.vocab,
        lr=args.lr,
        repeats=args.repeats,
        catch_up=args.catch_up,
        post_after=args.post_after,
        device=args.device,
        dtype=args.dtype,
    )
    if args.quick:
        settings = Settings(
            params=1e6, hidden=128, vocab=1024, heads=2, lr=args.lr, repeats=1, catch_up=2, post_after=3.0,
            quiet_seconds=3.0, device=args.device, dtype=args.dtype, max_len=2048,
        )  # fmt: skip
    python = Path(args.vllm_python)
    if not python.is_file():
        raise SystemExit(f"no vLLM interpreter at {python}: build the vLLM environment (see tests/vllm_server.py)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-pause-") as scratch:
        workdir = Path(scratch)
        try:
            results = analyse(measure(settings, python, workdir))
        finally:
            # The server's log stays with the results: what it loaded, and any failure.
            if (workdir / "server.log").is_file():
                shutil.copy(workdir / "server.log", out / "server.log")
    print_table(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    plot(results, out / "bench_pause.png")
    print(f"wrote {out / 'bench_pause.png'}")
    return results


if __name__ == "__main__":
    main()
