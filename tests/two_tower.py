"""The tests' tiny model, `TwoTower`, and what is built from it: a seeded training step, its
bf16 state, a short run published to a local bucket ([`PublishedRun`]), the same run resumed
in place, and a `Receiver` feeding a fresh replica. Models are tiny and random: nothing is
downloaded."""

from __future__ import annotations

import torch
from torch import nn


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
