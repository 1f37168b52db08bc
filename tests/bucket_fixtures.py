"""Fixtures for the bucket backends: one Hub test double and one SeaweedFS server per session.

`bucket_target` is parametrized over `local`, `hf` and `s3`; every test gets a fresh
bucket (HF) or prefix (S3), the environment a user would set (`HF_ENDPOINT` + `HF_TOKEN`,
`AWS_ENDPOINT_URL` + credentials), a short retry budget, and its own download cache.
Servers start only when a test asks for their backend.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HF_TOKEN = "hf_test_token"
S3_BUCKET = "delta-sync-tests"

#: Retry budget of every bucket operation in the tests (seconds); the default is minutes.
RETRY_SECONDS = "4"

#: hf_xet retries its own transfers with long delays unless told otherwise.
XET_RETRY_ENV = {
    "HF_XET_CLIENT_RETRY_MAX_ATTEMPTS": "2",
    "HF_XET_CLIENT_RETRY_BASE_DELAY": "100ms",
    "HF_XET_CLIENT_RETRY_MAX_DURATION": "2s",
}


@dataclass
class BucketTarget:
    """A fresh place to publish to on one backend, and the environment that reaches it."""

    kind: str
    url: str
    env: dict[str, str] = field(default_factory=dict)
    hub: object | None = None
    s3: object | None = None

    def subprocess_env(self) -> dict[str, str]:
        """This process's environment plus the target's, for running the CLI."""
        return {**os.environ, **self.env}


@pytest.fixture(scope="session")
def _xet_session_env(tmp_path_factory) -> Iterator[None]:
    # Read by hf_xet when its session starts, so set for the whole test session.
    values = {
        **XET_RETRY_ENV,
        "HF_XET_CACHE": str(tmp_path_factory.mktemp("xet-cache")),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def hub_server(_xet_session_env):
    """The Hub test double, with a token, on a free loopback port."""
    from hub_server import HubServer

    with HubServer(token=HF_TOKEN) as server:
        yield server


@pytest.fixture(scope="session")
def s3_server():
    """SeaweedFS with one bucket for all tests (each test gets its own prefix)."""
    from s3_server import seaweedfs_s3

    with seaweedfs_s3() as server:
        server.client().create_bucket(Bucket=S3_BUCKET)
        yield server


def _hub_env(server) -> dict[str, str]:
    return {"HF_ENDPOINT": server.endpoint, "HF_TOKEN": HF_TOKEN}


def _new_target(kind: str, request, tmp_path: Path, monkeypatch) -> BucketTarget:
    name = f"t-{uuid.uuid4().hex[:10]}"
    env = {"DELTA_SYNC_RETRY_SECONDS": RETRY_SECONDS, "DELTA_SYNC_CACHE": str(tmp_path / "download-cache")}
    target = BucketTarget(kind, "")
    if kind == "local":
        target.url = (tmp_path / name).as_uri()
    elif kind == "hf":
        target.hub = request.getfixturevalue("hub_server")
        request.addfinalizer(target.hub.clear_faults)
        env |= _hub_env(target.hub)
        target.url = f"hf://buckets/user/{name}/run"
    elif kind == "s3":
        target.s3 = request.getfixturevalue("s3_server")
        env |= target.s3.env()
        target.url = f"s3://{S3_BUCKET}/{name}"
    else:
        raise ValueError(kind)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    target.env = env
    if kind == "hf":
        from delta_sync.storage.hf import HFBucket

        HFBucket(target.url, create=True)
    return target


@pytest.fixture(params=["local", "hf", "s3"])
def bucket_target(request, tmp_path, monkeypatch) -> BucketTarget:
    """A fresh, empty bucket location on each backend in turn."""
    return _new_target(request.param, request, tmp_path, monkeypatch)


@pytest.fixture
def hf_target(request, tmp_path, monkeypatch) -> BucketTarget:
    """A fresh, empty Hugging Face bucket on the Hub test double."""
    return _new_target("hf", request, tmp_path, monkeypatch)


@pytest.fixture
def s3_target(request, tmp_path, monkeypatch) -> BucketTarget:
    """A fresh, empty prefix in the SeaweedFS bucket."""
    return _new_target("s3", request, tmp_path, monkeypatch)
