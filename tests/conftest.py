"""Shared fixtures, and only fixtures: what tests import by name lives in helpers.py (waiting,
ports, bit patterns), two_tower.py (the tiny model and runs published from it) and
vllm_server.py (a real vLLM server and a trainer publishing to it). Models are tiny and
random: nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

from two_tower import PublishedRun


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield


@pytest.fixture
def run(tmp_path):
    published = PublishedRun(tmp_path / "bucket")
    yield published
    published.close()


# Bucket backends (local, Hugging Face, S3) and their test servers.
pytest_plugins = ["bucket_fixtures"]

# -- how a parallel run (pytest-xdist) shares the tests out ------------------------------------

#: The modules that share the session's two vLLM servers: one unit of work, so that one
#: worker starts them.
SESSION_SERVER_MODULES = {"test_vllm", "test_peft", "test_vllm_auth"}
#: Modules whose tests share nothing worth keeping them on one worker (each a row with
#: servers of its own): each test is a unit.
SPREAD_MODULES = {"test_vllm_moe", "test_fleet"}
#: The units that take longest on the 2-core CI machine (from the durations `.ci/run`
#: prints), longest first: handed out first, so that no worker is left with a long one
#: while the other has finished. The rest follow in the order collected.
COSTLIEST_FIRST = [
    "test_crash",
    "test_distributed",
    "test_gpu_check",
    "test_deepspeed",
    "test_benchmark",
    "test_fuzz_decoders",
    "test_buckets",
    "vllm-session",
    "tests/test_fleet.py::test_a_fleet_converges_with_a_late_joiner_a_restart_and_a_follower",
    "test_bench_pause",
    "test_readme",
    "test_peft_adapter",
    "test_vllm_versions",
]


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module; the session servers' modules together;
    each test of a `SPREAD_MODULES` module alone."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    if module in SESSION_SERVER_MODULES:
        return "vllm-session"
    return nodeid if module in SPREAD_MODULES else module


def pytest_collection_modifyitems(config, items):
    """The order units are handed out in (each worker collects the same): those that need no
    vLLM environment first (CI builds it meanwhile), each half costliest first."""
    units = {}
    for item in items:
        units.setdefault(unit_of(item.nodeid), []).append(item)
    rank = {unit: position for position, unit in enumerate(COSTLIEST_FIRST)}

    def order(unit: str) -> tuple[bool, int]:
        needs_vllm = any(item.get_closest_marker("vllm") for item in units[unit])
        return needs_vllm, rank.get(unit, len(rank))

    items[:] = [item for unit in sorted(units, key=order) for item in units[unit]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by scope (a unit at a time, in the order collected), with the scopes
    of [`unit_of`]."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


# -- a real vLLM server, shared by every test that needs one --------------------------------


@pytest.fixture(scope="session")
def bucket_root(tmp_path_factory):
    """Every bucket a vLLM test uses lives under here; the server trusts exactly this prefix."""
    return tmp_path_factory.mktemp("buckets")


@pytest.fixture(scope="session")
def served_model(tmp_path_factory):
    from tiny_model import build_tiny_model

    path = tmp_path_factory.mktemp("served-model")
    # A large lm_head makes greedy decoding insensitive to kernel rounding differences.
    build_tiny_model(path, lm_head_scale=8.0)
    return path


@pytest.fixture(scope="session")
def session_servers(served_model, bucket_root, hub_server, tmp_path_factory):
    """The two real servers every vLLM module shares, launched together at the first test
    that needs either (see `vllm_server.launched`)."""
    from bucket_fixtures import HF_TOKEN, XET_RETRY_ENV

    from vllm_server import API_TOKEN, SIGNING_KEY, VLLM_HF_BUCKET, launched, server_in

    logs = tmp_path_factory.mktemp("vllm")
    servers = {
        "open": server_in(
            logs,
            served_model,
            allowed_buckets=f"{bucket_root.as_uri()},hf://buckets/{VLLM_HF_BUCKET}",
            # The replica reaches the Hugging Face bucket through the Hub test double, like a user's would.
            extra_env={
                "HF_ENDPOINT": hub_server.endpoint,
                "HF_TOKEN": HF_TOKEN,
                "HF_XET_CACHE": str(logs / "xet"),
                "DELTA_SYNC_RETRY_SECONDS": "10",
                # Prefetch on hints only, so that a test decides when a version is prepared.
                "DELTA_SYNC_PREFETCH": "3600",
                **XET_RETRY_ENV,
            },
        ),
        "guarded": server_in(
            tmp_path_factory.mktemp("vllm-guarded"),
            served_model,
            allowed_buckets=bucket_root.as_uri(),
            api_token=API_TOKEN,
            # Prefetch on hints only, so that a test decides when a version is prepared.
            extra_env={"DELTA_SYNC_VERIFY_KEY": SIGNING_KEY.verify_key.pem.decode(), "DELTA_SYNC_PREFETCH": "3600"},
        ),
    }
    with launched(servers):
        yield servers


@pytest.fixture(scope="session")
def vllm_server(session_servers):
    """A real server that trusts the test buckets (local, and Hugging Face through the Hub test double)."""
    return session_servers["open"].wait_healthy()


@pytest.fixture(scope="session")
def guarded_server(session_servers):
    """A second real server, shared by the modules that need it: its weight routes need
    `vllm_server.API_TOKEN` (`vllm_ext.auth`), and it applies only versions signed with
    `vllm_server.SIGNING_KEY`. The unguarded one above stays for clients that send no token."""
    return session_servers["guarded"].wait_healthy()


@pytest.fixture
def trainer(served_model, bucket_root, request):
    """A `vllm_server.TinyTrainer` of the served model, publishing to a bucket of its own
    (named after the test) under `bucket_root`."""
    from vllm_server import TinyTrainer

    trainer = TinyTrainer(served_model, bucket_root / request.node.name.replace("[", "-").replace("]", ""))
    yield trainer
    trainer.close()


@pytest.fixture
def stepwise(tmp_path):
    """A run with only version 1 published; tests publish the next ones with `step()`."""
    published = PublishedRun(tmp_path / "bucket", versions=1)
    yield published
    published.close()


@pytest.fixture
def server():
    """A fake vLLM server (tests/fake_vllm.py) with a real Receiver behind it."""
    from fake_vllm import FakeVLLM

    with FakeVLLM() as fake:
        yield fake
