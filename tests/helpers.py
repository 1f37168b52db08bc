"""What the tests share: waiting with a deadline, loopback ports, servers started and
stopped (a stdlib HTTP server in a thread, a process group), the command line, the tiny
Qwen3 config of the torchrun scripts, and the bit patterns that exact comparisons of
weights use. Plain functions, imported by name; pytest fixtures are in conftest.py.

The house rules these serve (CONTRIBUTING.md): a test waits for a condition with
[`wait_for`], never with a bare sleep; every server it starts listens on 127.0.0.1, on a
port chosen free at run time, and is stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # torch is imported where used: the test servers and scripts that import this need none
    import torch

REPO = Path(__file__).resolve().parents[1]

#: Longest a test waits for a condition unless it says otherwise; a bound, not a synchronisation.
WAIT_SECONDS = 60.0

T = TypeVar("T")
S = TypeVar("S", bound="LoopbackHTTPServer")


def wait_for(
    condition: Callable[[], T],
    what: str | Callable[[], str],
    *,
    timeout: float = WAIT_SECONDS,
    interval: float = 0.01,
) -> T:
    """Poll `condition` every `interval` seconds until it returns a true value; return that value.

    Args:
        condition: Asked until it holds; it may raise to stop waiting early (e.g. on a
            process that died).
        what: What is awaited, for the failure message; a callable is asked only then
            (e.g. to add the tail of a log).

    Raises:
        AssertionError: `timeout` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)
    return value


# -- ports and servers --------------------------------------------------------------------------


def free_ports(count: int, *, highest: int = 65535) -> list[int]:
    """`count` distinct loopback ports that nothing listens on right now, none above `highest`."""
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)  # held until all are chosen, so that none is chosen twice
            port = sock.getsockname()[1]
            if port <= highest and port not in ports:
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    return free_ports(1)[0]


class LoopbackHTTPServer:
    """Base of the HTTP test doubles: a stdlib server on 127.0.0.1, on a free port, serving
    from a daemon thread of this process between [`start`] and [`stop`] (or in a `with`).

    Subclasses give the request handler ([`handler`]) and what to remove once stopped
    ([`cleanup`]).
    """

    #: The serving thread's name.
    thread_name = "test-server"
    #: How often the serving loop looks for [`stop`], in seconds.
    poll_interval = 0.5
    port = 0
    _httpd: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def handler(self) -> type[BaseHTTPRequestHandler]:
        """The request handler class, bound to this server."""
        raise NotImplementedError

    def cleanup(self) -> None:
        """Called by [`stop`] once serving has ended (e.g. to remove temporary directories)."""

    def start(self: S) -> S:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(self.poll_interval,), name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket: the port then refuses connections, like a dead server."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.cleanup()

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process(process: subprocess.Popen, grace: float, *, group: bool = False) -> None:
    """Stop a process a test started: SIGTERM, SIGKILL after `grace` seconds, then reap it.

    Args:
        group: Signal its whole process group (it was started with
            `start_new_session=True`), and SIGKILL what is left of the group even when the
            leader is gone.
    """

    def send(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)

    if process.poll() is None:
        send(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    if group or process.poll() is None:
        send(signal.SIGKILL)
    process.wait()


# -- the command line and the models ------------------------------------------------------------


def cli(*args: str, timeout: float = 300, **options) -> subprocess.CompletedProcess:
    """Run `python -m delta_sync.cli ARGS` to completion, its output captured as text.

    `options` go to `subprocess.run` (e.g. `env`, or `stdout` to send the output elsewhere).
    """
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **options}
    return subprocess.run([sys.executable, "-m", "delta_sync.cli", *args], text=True, timeout=timeout, **options)


#: Modules a fork server imports once for [`run_script`]'s children.
SCRIPT_PRELOAD = ["torch", "delta_sync", "delta_sync.trainer.publisher", "delta_sync.replica.shared"]


def run_script(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` to completion, as a child of a fork server that has imported
    `SCRIPT_PRELOAD` once: a real process of its own (its own memory; a SIGKILL ends it
    alone, `returncode` -9), without the seconds a fresh interpreter spends importing torch.
    For scripts run many times over (the crash tests kill one at each of its operations).

    Returns:
        What `subprocess.run(..., capture_output=True, text=True)` would: the exit code and
        the output as text.
    """
    import multiprocessing
    import tempfile

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(SCRIPT_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="script-output-") as directory:
        out, err = Path(directory, "stdout"), Path(directory, "stderr")
        child = context.Process(target=_script_main, args=(str(script), list(args), str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([str(script), *args], timeout)
        return subprocess.CompletedProcess(
            [str(script), *args], child.exitcode, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def _script_main(script: str, args: list[str], out: str, err: str) -> None:
    """[`run_script`]'s child: the script as `__main__`, its output to the two files
    (multiprocessing prints an exception's traceback, flushes both and sets the exit code)."""
    import runpy

    for path, fd in ((out, 1), (err, 2)):
        with open(path, "wb") as file:
            os.dup2(file.fileno(), fd)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def uneven_qwen3_config():
    """A tiny Qwen3 config whose widths divide evenly by no rank count (vocabulary 301, width
    50, MLP 70); head_dim 2 makes the q/k norms 2 elements, which leaves a third rank an
    empty shard (FSDP2) or partition (ZeRO-3)."""
    from tiny_model import tiny_qwen3_config

    return tiny_qwen3_config(vocab_size=301, hidden_size=50, intermediate_size=70, head_dim=2)


# -- bit patterns, for exact comparisons of weights ----------------------------------------------


def bf16_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns of a tensor, as int16: an fp32 tensor is rounded to bf16 first."""
    import torch

    return tensor.detach().to(torch.bfloat16).view(torch.int16)


def raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's own bit patterns, nothing rounded: a view as int16 (bf16, fp16) or int32
    (fp32); writing to it writes the tensor."""
    import torch

    return tensor.detach().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def held_bf16_bits(receiver) -> dict[str, torch.Tensor]:
    """A copy of the bf16 bit patterns (`bf16_bits`) of every weight a `Receiver` holds, by name."""
    return {name: bf16_bits(t).clone() for name, t in receiver.weights.items()}


def assert_bit_exact(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """The same names, and each tensor the same in bf16 (`bf16_bits`), bit for bit."""
    import torch

    assert sorted(expected) == sorted(actual)
    for name in expected:
        assert torch.equal(bf16_bits(expected[name]), bf16_bits(actual[name])), f"{name} differs"
