"""Defects that only a GPU run would hit, each shown on CPU by its mechanism.

Where the defect is a tensor on the wrong device, the tests run on `fake_device.OnDevice`
tensors (CPU tensors that refuse to meet a host tensor, as CUDA's do) and, where CUDA is
present, on CUDA itself. Weights are compared as bf16 bit patterns, never approximately.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from fake_device import fake_device, move_module

from delta_sync import BF16ChangeDetector, Publisher
from delta_sync.replica.receiver import WeightPatch, module_weight_loader

from two_tower import TwoTower, train_step

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")

#: The devices a replica's parameters are tested on: the host, the stand-in, a real GPU.
DEVICES = ["cpu", "fake", pytest.param("cuda", marks=CUDA)]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().view(torch.int16)


def _replica_on(device: str) -> torch.nn.Module:
    replica = TwoTower()
    if device == "fake":
        return move_module(replica)
    return replica.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_module_weight_loader_writes_host_changes_into_device_parameters(device):
    """A delta's positions and values come from the bucket on the host; a replica on a GPU
    must get them moved to each parameter's device before the indexed write."""
    replica = _replica_on(device)
    loader = module_weight_loader(replica)
    name = "body.0.weight"
    before = _bits(replica.get_parameter(name)).clone()
    new = torch.randn(replica.get_parameter(name).shape).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 17, 300], dtype=torch.int64)
    with fake_device():
        loader.load_patches([WeightPatch(name, new, positions)])
    after = _bits(replica.get_parameter(name)).reshape(-1)
    expected = before.reshape(-1).clone()
    expected[positions] = new.view(torch.int16).reshape(-1)[positions]
    assert torch.equal(after, expected)
    # A whole tensor (an anchor) crosses with copy_, which takes any device.
    whole = torch.randn(replica.get_parameter(name).shape).to(torch.bfloat16)
    loader([(name, whole)])
    assert torch.equal(_bits(replica.get_parameter(name)), whole.view(torch.int16))


def _published_model(tmp_path) -> weakref.ref:
    """Trains and publishes a model, closes everything, and returns a weak reference to one
    of its weights: all strong references are gone when this returns."""
    model = TwoTower(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detector = BF16ChangeDetector(model, optimizer)
    publisher = Publisher(tmp_path, detector, anchor_every=10)
    publisher.publish(1)
    train_step(model, optimizer, seed=0)
    publisher.publish(2)
    publisher.close()
    detector.close()
    return weakref.ref(model.body[0].weight)


def test_closed_publisher_frees_the_model_without_a_garbage_collection(tmp_path):
    """A reference cycle through the publisher (its writer held a bound method of it) kept
    the model, optimizer and snapshot alive until a full collection: on a GPU, `empty_cache()`
    could not free them, and each model of a benchmark stayed in device memory."""
    # The first training step of a process leaves torch's lazy set-up in a cycle with its
    # model; take it on a throwaway model, so what is left to see is the publisher's.
    warm = TwoTower(torch.float32)
    train_step(warm, torch.optim.AdamW(warm.parameters(), lr=1e-3), seed=0)
    del warm
    gc.collect()
    gc.disable()
    try:
        weight = _published_model(tmp_path)
        assert weight() is None, "the model outlives close() until a garbage collection"
    finally:
        gc.enable()


class _CountingDetector(BF16ChangeDetector):
    """A detector that counts how many are built (each copies the model: snapshot, mirror)."""

    built = 0

    def __init__(self, *args, **kwargs) -> None:
        type(self).built += 1
        super().__init__(*args, **kwargs)


@pytest.mark.parametrize("world_process_zero", [True, False])
def test_only_a_rank_that_publishes_builds_a_detector(monkeypatch, tmp_path, world_process_zero):
    """With whole parameters (DDP, ZeRO-1/2) rank 0 publishes alone: the other ranks must
    still agree on the layout with it, but copy no snapshot and no host mirror."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from delta_sync import DeltaSyncCallback
    from delta_sync.trainer import callback as callback_module

    monkeypatch.setattr(_CountingDetector, "built", 0)
    monkeypatch.setattr(callback_module, "BF16ChangeDetector", _CountingDetector)
    verified = []
    real_verify = callback_module.verify_across_ranks
    monkeypatch.setattr(
        callback_module,
        "verify_across_ranks",
        lambda layout, named, *rest: verified.append(sorted(name for name, _ in named)) or real_verify(layout, named),
    )
    model = TwoTower(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = DeltaSyncCallback(bucket=str(tmp_path / "bucket"), background=False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    state = TrainerState(is_world_process_zero=world_process_zero)
    sync.on_train_begin(args, state, TrainerControl(), model=model, optimizer=optimizer)
    try:
        # Every rank takes part in the layout check, under the detector's names.
        assert verified == [sorted(name for name, _ in model.named_parameters())]
        assert _CountingDetector.built == (1 if world_process_zero else 0)
        assert (sync.detector is not None, sync.publisher is not None) == (world_process_zero, world_process_zero)
    finally:
        sync.on_train_end(args, state, TrainerControl())


@pytest.mark.parametrize("device", DEVICES)
def test_the_examples_replica_check_compares_a_device_trainer_with_a_host_replica(device):
    """The main example compares the trainer's weights (on a GPU there) with a replica and
    a bucket on the host: bit patterns on one device, never `torch.equal` across two."""
    from types import SimpleNamespace

    from grpo_delta_sync import ReplicaCheck

    trainer = TwoTower(torch.float32)
    replica = TwoTower()
    replica.load_state_dict({name: p.detach().to(torch.bfloat16) for name, p in trainer.state_dict().items()})
    trainer = move_module(trainer) if device == "fake" else trainer.to(device)
    weights = {name: p.detach().clone() for name, p in replica.named_parameters()}

    check = object.__new__(ReplicaCheck)
    check.sync = SimpleNamespace(
        publisher=SimpleNamespace(last_version=1, flush=lambda: None),
        detector=SimpleNamespace(float32=frozenset()),  # nothing kept in float32
        replicas=None,
        config=None,
    )
    check.bucket, check.replica, check.checkpoint = "unused", replica, None
    check.receiver = SimpleNamespace(update=lambda bucket: None, weights=weights)
    check.checked, check.server_checked, check.server_refused = [], [], []
    check.on_step_end(None, SimpleNamespace(global_step=1), None, model=trainer)
    assert check.checked == [(1, True)]
    # One bit off in the replica is seen, as it is on the host.
    replica.body[0].weight.data.view(torch.int16).reshape(-1)[7] ^= 1
    check.on_step_end(None, SimpleNamespace(global_step=1), None, model=trainer)
    assert check.checked[-1] == (1, False)


@pytest.mark.slow
def test_ddp_ranks_that_do_not_publish_build_no_detector_under_torchrun(tmp_path):
    """Two real DDP ranks (gloo): both take part in the layout check, rank 0 alone builds a
    detector and publishes every step, rank 1 copies nothing."""
    from test_distributed import torchrun

    bucket = str(tmp_path / "bucket")
    results = sorted(torchrun("ddp_no_snapshot.py", 2, "--bucket", bucket, timeout=300), key=lambda r: r["rank"])
    assert [(r["rank"], r["detectors"], r["versions"]) for r in results] == [(0, 1, [1, 2]), (1, 0, [])]
