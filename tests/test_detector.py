"""BF16ChangeDetector against a brute-force diff of full bf16 bit patterns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from delta_sync import BF16ChangeDetector
from delta_sync.trainer.detector import canonical_name

from helpers import bf16_bits
from two_tower import TwoTower, bf16_state, train_step


def expected_changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Brute force: every element whose bf16 bit pattern differs, for every parameter."""
    masks = {name: (bf16_bits(after[name]) != bf16_bits(before[name])).reshape(-1) for name in before}
    return {name: mask for name, mask in masks.items() if mask.any()}


def assert_exact(change_set, before, after) -> None:
    expected = expected_changes(before, after)
    assert sorted(change_set.changes) == sorted(expected)
    for name, mask in expected.items():
        change = change_set.changes[name]
        assert torch.equal(change.indices.long(), mask.nonzero().squeeze(1)), name
        assert torch.equal(change.values.view(torch.int16), bf16_bits(after[name]).reshape(-1)[mask]), name
        assert torch.equal(change_set.old_values[name].view(torch.int16), bf16_bits(before[name]).reshape(-1)[mask]), (
            name
        )
    assert change_set.changed_elements == sum(int(m.sum()) for m in expected.values())


def make_optimizer(kind: str, model: nn.Module, lr: float):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-master"])
@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("steps_per_sync", [1, 3])
def test_exact_against_brute_force(dtype, optimizer_kind, steps_per_sync, seeded):
    model = TwoTower(dtype)
    # A small lr so that most bf16 values do not move, as in RL fine-tuning.
    optimizer = make_optimizer(optimizer_kind, model, lr=1e-4 if optimizer_kind == "adamw" else 1e-2)
    detector = BF16ChangeDetector(model, optimizer)
    before = bf16_state(model)
    seed = 0
    for _ in range(4):
        for _ in range(steps_per_sync):
            # Gradient accumulation over two micro-batches; the side branch sits out odd steps.
            train_step(model, optimizer, seed=seed, use_side=seed % 2 == 0, micro_batches=2)
            seed += 1
        assert detector.steps_pending == steps_per_sync
        after = bf16_state(model)
        change_set = detector.changes()
        assert change_set.steps == steps_per_sync
        assert_exact(change_set, before, after)
        assert 0 < change_set.changed_elements < change_set.total_elements
        assert "frozen.weight" not in change_set.changes
        before = after
    detector.close()


def test_masks_do_not_advance_the_snapshot(seeded):
    model = TwoTower()
    optimizer = make_optimizer("adamw", model, lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer)
    before = bf16_state(model)
    train_step(model, optimizer, seed=1)
    masks = detector.masks()
    expected = expected_changes(before, bf16_state(model))
    for name, mask in masks.items():
        assert torch.equal(mask.reshape(-1), expected.get(name, torch.zeros_like(mask.reshape(-1))))
    assert set(expected) <= set(masks)
    # masks() twice gives the same answer; changes() then still sees everything.
    assert all(torch.equal(a, b) for a, b in zip(masks.values(), detector.masks().values()))
    assert_exact(detector.changes(), before, bf16_state(model))


def test_branch_without_gradients_keeps_its_later_changes(seeded):
    model = TwoTower()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    detector = BF16ChangeDetector(model, optimizer)
    train_step(model, optimizer, seed=0, use_side=False)
    assert "side.weight" not in detector.changes().changes
    before = bf16_state(model)
    train_step(model, optimizer, seed=1, use_side=True)
    change_set = detector.changes()
    assert "side.weight" in change_set.changes
    assert_exact(change_set, before, bf16_state(model))


def test_skipped_step_fires_no_hook_and_loses_nothing(seeded):
    """A GradScaler step with an inf gradient is skipped: optimizer.step never runs."""
    model = TwoTower(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    detector = BF16ChangeDetector(model, optimizer)
    before = bf16_state(model)

    def scaled_step(seed: int, overflow: bool) -> None:
        tokens = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(seed))
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 50), tokens.reshape(-1))
        scaler.scale(loss).backward()
        if overflow:
            model.head.weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    scaled_step(0, overflow=True)
    assert detector.steps_pending == 0
    assert torch.equal(bf16_bits(model.head.weight), before["head.weight"].view(torch.int16))
    scaled_step(1, overflow=False)
    assert detector.steps_pending == 1
    assert_exact(detector.changes(), before, bf16_state(model))


def test_fp32_master_changes_below_bf16_resolution_are_not_reported(seeded):
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    detector = BF16ChangeDetector(model, optimizer)
    before = bf16_state(model)
    with torch.no_grad():
        model.weight.grad = torch.zeros_like(model.weight)
        model.bias.grad = torch.zeros_like(model.bias)
        # Tiny fp32 change: invisible after rounding to bf16, except for one element.
        model.weight.grad.fill_(-1e-9)
        model.weight.grad[1, 2] = -0.5
    optimizer.step()
    change_set = detector.changes()
    assert_exact(change_set, before, bf16_state(model))
    assert change_set.changes["weight"].indices.tolist() == [6]
    assert "bias" not in change_set.changes


def test_names_strip_wrappers_and_hooks_go_on_the_inner_optimizer(seeded):
    class Wrapper(nn.Module):  # what DDP / Accelerate look like from named_parameters
        def __init__(self, module):
            super().__init__()
            self.module = module

    class OptimizerWrapper:  # like accelerate.optimizer.AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            self.optimizer.step()

        def zero_grad(self, set_to_none=True):
            self.optimizer.zero_grad(set_to_none=set_to_none)

    inner = TwoTower()
    model = Wrapper(inner)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detector = BF16ChangeDetector(model, OptimizerWrapper(optimizer))
    assert detector.optimizer is optimizer
    assert set(detector.snapshot) == {name for name, _ in inner.named_parameters()}
    assert canonical_name("module._orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    train_step(inner, OptimizerWrapper(optimizer), seed=0)
    assert detector.steps_pending == 1


def test_close_removes_hooks_and_snapshot(seeded):
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooks_before = (len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks))
    detector = BF16ChangeDetector(model, optimizer)
    assert len(optimizer._optimizer_step_pre_hooks) == hooks_before[0] + 1
    detector.close()
    assert (len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks)) == hooks_before
    train_step(model, optimizer, seed=0)
    assert detector.steps_pending == 0
    assert detector.snapshot == {}


def test_snapshot_is_one_bf16_copy(seeded):
    model = TwoTower(torch.float32)
    detector = BF16ChangeDetector(model, torch.optim.SGD(model.parameters(), lr=0.1))
    numel = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() * t.element_size() for t in detector.snapshot.values()) == 2 * numel
    assert all(t.dtype == torch.bfloat16 for t in detector.snapshot.values())
    for name, param in model.named_parameters():
        assert detector.snapshot[name].data_ptr() != param.data_ptr()


def test_optimizer_of_another_model_is_refused():
    model, other = TwoTower(), TwoTower()
    with pytest.raises(ValueError, match="not parameters of the model"):
        BF16ChangeDetector(model, torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_snapshot_on_the_cpu_needs_no_host_mirror(seeded):
    model = TwoTower(torch.float32)
    detector = BF16ChangeDetector(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert detector.mirror is None
    # Read where it lives: the host snapshot of a CPU snapshot is the snapshot itself.
    assert all(detector.host_snapshot()[name] is tensor for name, tensor in detector.snapshot.items())
    detector.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-master"])
def test_a_host_mirror_follows_the_snapshot_bit_for_bit(dtype, seeded):
    """The mirror is advanced only from the changes the detector brings back; after real
    AdamW steps, hand edits to NaN, infinities and -0.0, and steps that skip a branch, it
    holds exactly the snapshot's bits, and is what the host snapshot hands out."""
    model = TwoTower(dtype)
    optimizer = make_optimizer("adamw", model, lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer, host_mirror=True)
    assert detector.mirror is not None and detector.mirror.nbytes == 2 * sum(p.numel() for p in model.parameters())
    for seed in range(5):
        train_step(model, optimizer, seed=seed, use_side=seed % 2 == 0)
        if seed == 2:
            with torch.no_grad():
                model.body[0].weight[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
            detector.mark_changed(["body.0.weight"])
        change_set = detector.changes()
        assert change_set.changed_elements > 0
        for name, tensor in detector.snapshot.items():
            assert torch.equal(detector.mirror.tensors[name].view(torch.int16), tensor.view(torch.int16)), name
    assert all(detector.host_snapshot()[name] is detector.mirror.tensors[name] for name in detector.snapshot)
    assert detector.mirror.tensors["body.0.weight"].data_ptr() != detector.snapshot["body.0.weight"].data_ptr()
    detector.close()
    assert detector.mirror is None


class Transposed(nn.Module):
    """A parameter stored transposed (non-contiguous): the compiled pass declines it, so it
    takes the batched torch path, as every parameter on a GPU does."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(24, 40, dtype=dtype).t())
        self.bias = nn.Parameter(torch.randn(24, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


@pytest.mark.parametrize("mirrored", [False, True], ids=["no-mirror", "host-mirror"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-master"])
def test_the_batched_path_reports_old_values_with_or_without_a_host_mirror(dtype, mirrored, seeded):
    """With a host mirror the batched path leaves the old values on the device and the
    detector reads them from the mirror: the change set is exactly the brute force's."""
    model = Transposed(dtype)
    assert not model.weight.is_contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer, host_mirror=mirrored)
    before = bf16_state(model)
    for seed in range(3):
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        after = bf16_state(model)
        assert_exact(detector.changes(), before, after)
        before = after
    detector.close()


@pytest.mark.parametrize("held", [False, True], ids=["not-held", "held"])
def test_a_parameter_the_optimizer_does_not_hold_is_compared_whole(seeded, held):
    """A frozen parameter moved outside the optimizer (ERNIE-4.5-MoE's router
    `moe_statics.e_score_correction_bias` is an `nn.Parameter` with `requires_grad=False`,
    which auxiliary-loss-free balancing updates by hand) is published like a buffer: whether
    the optimizer leaves it out (as transformers' Trainer does) or holds it without ever
    stepping it (no gradient: no step hook sees it)."""
    model = TwoTower(torch.float32)
    frozen = model.get_parameter("frozen.weight")  # requires_grad=False
    if held:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        assert any(param is frozen for param in optimizer.param_groups[0]["params"])
    else:
        optimizer = make_optimizer("adamw", model, lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    before = bf16_state(model)
    train_step(model, optimizer, seed=0, use_side=False)
    with torch.no_grad():
        frozen[0, :3] += 1.0
    assert_exact(detector.changes(), before, bf16_state(model))
    assert "frozen.weight" in expected_changes(before, bf16_state(model))
    before = bf16_state(model)
    with torch.no_grad():  # no step at all: the next changes() still sees it
        frozen[1, :2] -= 1.0
    change_set = detector.changes()
    assert sorted(change_set.changes) == ["frozen.weight"]
    assert_exact(change_set, before, bf16_state(model))
