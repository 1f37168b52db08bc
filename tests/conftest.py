"""Shared fixtures. Models are tiny and random: nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns of a tensor (rounding fp32 first), for exact comparisons."""
    return tensor.detach().to(torch.bfloat16).view(torch.int16)


def assert_bit_exact(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(actual)
    for name in expected:
        assert torch.equal(bits(expected[name]), bits(actual[name])), f"{name} differs"


class TwoTower(nn.Module):
    """A small model with a frozen part, a branch that only some steps use, and a norm."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.side = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 50, bias=False)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.to(dtype)

    def forward(self, tokens: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        hidden = self.body(self.embed(tokens)) + self.frozen(self.embed(tokens))
        if use_side:
            hidden = hidden + self.side(hidden)
        return self.head(self.norm(hidden))


def train_step(model: nn.Module, optimizer, *, seed: int, use_side: bool = True, micro_batches: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(micro_batches):
        tokens = torch.randint(0, 50, (4, 8), generator=generator)
        logits = model(tokens, use_side=use_side)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 50), tokens.reshape(-1))
        (loss / micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bf16_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield


class PublishedRun:
    """A short training run published to a local bucket, with the bf16 state of each version;
    `options` go to its `Publisher` (a `signing_key`)."""

    def __init__(
        self, root, *, versions: int = 5, anchor_every: int = 3, keep_anchors: int = 2, lr: float = 1e-4, **options
    ):
        from delta_sync import BF16ChangeDetector, Publisher

        torch.manual_seed(0)
        self.root = root
        self.model = TwoTower()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.detector = BF16ChangeDetector(self.model, self.optimizer)
        # Anchors by count only, so that tests can predict the schedule.
        self.publisher = Publisher(
            root,
            self.detector,
            anchor_every=anchor_every,
            anchor_bytes_ratio=None,
            keep_anchors=keep_anchors,
            background=False,
            **options,
        )
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.version = 0
        for _ in range(versions):
            self.step()

    def step(self) -> int:
        self.version += 1
        train_step(self.model, self.optimizer, seed=self.version)
        self.publisher.publish(self.version)
        self.states[self.version] = bf16_state(self.model)
        return self.version

    def close(self) -> None:
        self.publisher.close()
        self.detector.close()


@pytest.fixture
def run(tmp_path):
    published = PublishedRun(tmp_path / "bucket")
    yield published
    published.close()


def resume_in_place(root, run_id: str, versions) -> tuple[TwoTower, object]:
    """Resume run `run_id` in place, from another trajectory (a new start of its publisher,
    so a new epoch), and publish `versions`; returns the model and the closed publisher."""
    from delta_sync import BF16ChangeDetector, Publisher

    torch.manual_seed(5)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(root, BF16ChangeDetector(model, optimizer), run_id=run_id, background=False)
    for version in versions:
        train_step(model, optimizer, seed=50 + version)
        publisher.publish(version)
    publisher.close()
    return model, publisher


def replica_receiver(**kwargs):
    """A Receiver feeding a fresh TwoTower replica, plus the replica."""
    from delta_sync import Receiver, expected_shapes_of, module_weight_loader

    replica = TwoTower()
    receiver = Receiver(
        load_weights=module_weight_loader(replica), expected_shapes=expected_shapes_of(replica), **kwargs
    )
    return receiver, replica


# Bucket backends (local, Hugging Face, S3) and their test servers.
pytest_plugins = ["bucket_fixtures"]

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


#: The Hugging Face bucket (on the Hub test double) the shared vLLM server also trusts.
VLLM_HF_BUCKET = "user/vllm-e2e"


@pytest.fixture(scope="session")
def vllm_server(served_model, bucket_root, hub_server, tmp_path_factory):
    from bucket_fixtures import HF_TOKEN, XET_RETRY_ENV

    from vllm_server import serving

    logs = tmp_path_factory.mktemp("vllm")
    with serving(
        served_model,
        logs,
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
    ) as server:
        yield server


@pytest.fixture(scope="session")
def guarded_server(served_model, bucket_root, tmp_path_factory):
    """A second real server, shared by the modules that need it: its weight routes need
    `vllm_server.API_TOKEN` (`vllm_ext.auth`), and it applies only versions signed with
    `vllm_server.SIGNING_KEY`. The unguarded one above stays for clients that send no token."""
    from vllm_server import API_TOKEN, SIGNING_KEY, serving

    with serving(
        served_model,
        tmp_path_factory.mktemp("vllm-guarded"),
        allowed_buckets=bucket_root.as_uri(),
        api_token=API_TOKEN,
        # Prefetch on hints only, so that a test decides when a version is prepared.
        extra_env={"DELTA_SYNC_VERIFY_KEY": SIGNING_KEY.verify_key.pem.decode(), "DELTA_SYNC_PREFETCH": "3600"},
    ) as server:
        yield server


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
