"""The trainer's device path on models spread over devices, its memory per change, PEFT
merges in flight and the caller's CUDA stream.

No GPU here: [`Placed`] is a CPU tensor that reports a device of its own and refuses, as
CUDA does, any operation that meets a tensor placed elsewhere, so that counts stacked
across devices or a synchronisation that misses a device show on CPU. Where CUDA is
present the same checks run on it. Memory is counted with `CountAllocations` (every
storage torch operators create, and their peak), the benchmark's own counter.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import peft
import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import delta_sync.sparse as sparse
import delta_sync.trainer.detector as detector_module
from delta_sync import BF16ChangeDetector
from delta_sync.staging import HostBuffers

from helpers import REPO
from tiny_model import build_tiny_model
from two_tower import TwoTower, train_step

sys.path.insert(0, str(REPO / "benchmarks"))
from allocations import CountAllocations  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


class Placed(torch.Tensor):
    """A CPU tensor placed, for device checks, on `placed`: an operation meeting tensors
    placed on two devices, or a placed tensor and a host tensor of at least one dimension,
    raises as CUDA does; `copy_` crosses, `.to(device)` moves and `.to("cpu")` lands."""

    placed: torch.device

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:  # a new method-wrapper each time: `is` never holds
            return args[0].placed
        flat = tree_flatten((args, kwargs))[0]
        devices = {t.placed for t in flat if isinstance(t, Placed)}
        if func is torch.Tensor.to:
            target = next(
                (torch.device(a) for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))), None
            )
            rest = tuple(a for a in args[1:] if not isinstance(a, (str, torch.device)))
            options = {k: v for k, v in kwargs.items() if k != "device"}
            with torch._C.DisableTorchFunctionSubclass():
                moved = torch.Tensor.to(args[0], *rest, **options)
            if target is not None and target.type == "cpu":
                return moved.as_subclass(torch.Tensor).clone() if moved is args[0] else moved.as_subclass(torch.Tensor)
            return place(moved, target or args[0].placed)
        if func not in (torch.Tensor.copy_, torch.Tensor.tolist, torch.Tensor.numel, torch.Tensor.element_size):
            host = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, Placed) and t.dim() > 0]
            if len(devices) > 1 or (devices and host):
                raise RuntimeError(f"Expected all tensors to be on the same device, found {devices} and host tensors")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func is torch.Tensor.copy_:
            return args[0]
        device = next(iter(devices), None)
        return tree_map(lambda r: place(r, device) if isinstance(r, torch.Tensor) and device else r, result)


def place(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` as a [`Placed`] tensor on `device` (the CPU itself: a plain tensor)."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor.as_subclass(torch.Tensor)
    placed = tensor.as_subclass(Placed)
    placed.placed = device
    return placed


def changed_pairs(count: int, numel: int, fraction: float, seed: int = 0):
    """`(current, snapshot)` bf16 pairs, about `fraction` of each current changed."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        snapshot = torch.randn(numel, generator=generator).to(torch.bfloat16)
        current = snapshot.clone()
        changed = torch.rand(numel, generator=generator) < fraction
        current[changed] = current[changed] * 1.5 + 1
        pairs.append((current, snapshot))
    return pairs


def expected(pairs) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Positions, new and old bits of each pair, brute force on plain tensors."""
    found = []
    for current, snapshot in pairs:
        new, old = current.reshape(-1).view(torch.int16), snapshot.reshape(-1).view(torch.int16)
        positions = (new != old).nonzero().squeeze(1)
        found.append((positions, new[positions], old[positions]))
    return found


def assert_found(results, wanted, snapshots, currents) -> None:
    for result, (positions, new, old), snapshot, current in zip(results, wanted, snapshots, currents):
        assert torch.equal(result[0].long(), positions)
        assert torch.equal(result[1].view(torch.int16), new)
        assert torch.equal(result[2].view(torch.int16), old)
        # The snapshot advanced to the current bits exactly.
        assert torch.equal(snapshot.view(torch.int16), current.reshape(-1).view(torch.int16))


# -- 1. a model spread over several devices -------------------------------------------


def _placement_cases():
    fake = [("cuda:0", "cuda:1"), ("cpu", "cuda:0")]
    real = [
        pytest.param(("cpu", "cuda:0"), "real", marks=CUDA, id="real-cpu-cuda"),
        pytest.param(("cuda:0", "cuda:1"), "real", marks=TWO_GPUS, id="real-cuda0-cuda1"),
    ]
    return [pytest.param(case, "placed", id="placed-" + "-".join(case)) for case in fake] + real


@pytest.mark.parametrize(("devices", "kind"), _placement_cases())
def test_a_model_over_several_devices_is_counted_and_synchronised_per_device(devices, kind, monkeypatch):
    """Counts of tensors on different devices are never stacked together, every device is
    synchronised before the host reads what it sent, and the changes are bit-exact."""
    plain = changed_pairs(6, 1000, 0.2)
    wanted = expected(plain)
    on = [devices[i % len(devices)] for i in range(len(plain))]
    synchronised: list[torch.device] = []
    if kind == "placed":
        move = place
        monkeypatch.setattr(sparse, "_synchronize", lambda device: synchronised.append(device), raising=False)
    else:
        move = lambda tensor, device: tensor.to(device)  # noqa: E731
        real_sync = sparse._synchronize

        def record(device: torch.device) -> None:
            synchronised.append(device)
            real_sync(device)

        monkeypatch.setattr(sparse, "_synchronize", record, raising=False)
    pairs = [(move(c.clone(), d), move(s.clone(), d)) for (c, s), d in zip(plain, on)]
    results = sparse.extract_changes_batched_([(c, s, torch.int32) for c, s in pairs])
    assert {str(d) for d in synchronised} == set(devices)
    snapshots = [s.to("cpu") if s.device.type != "cpu" else s for _, s in pairs]
    assert_found(results, wanted, snapshots, [c for c, _ in plain])


# -- 2. memory per change -------------------------------------------------------------


def test_peak_memory_per_change_is_the_host_buffer_and_one_tensor_at_a_time():
    """32 tensors, 30 % changed, through the batched path: what is alive at the peak is the
    one host buffer (4 bytes of int32 positions + 2 new + 2 old per change) plus one tensor's
    temporaries (mask, a bf16 copy of a non-contiguous tensor, 16 bytes per change of that
    tensor); the changes of the whole step are never held on the device."""
    plain = changed_pairs(32, 4096, 0.3)
    wanted = expected(plain)
    # Non-contiguous weights (the batched path's CPU case): each is copied once, flat.
    currents = [c.view(64, 64).t().contiguous().t() for c, _ in plain]
    snapshots = [s.clone() for _, s in plain]
    total = sum(len(p) for p, _, _ in wanted)
    largest = max(len(p) for p, _, _ in wanted)
    with CountAllocations() as counted:
        results = sparse.extract_changes_batched_([(c, s, torch.int32) for c, s in zip(currents, snapshots)])
    assert_found(results, wanted, snapshots, [c for c, _ in plain])
    host = 8 * total
    per_tensor = 4096 * (1 + 2) + 16 * largest
    assert counted.live == host, "what the call leaves is the one host buffer"
    assert counted.peak <= host + per_tensor + 4096, (counted.peak / total, "bytes per change")
    # Before, each tensor's positions and values were kept to the end and concatenated: ~24 B.
    assert counted.peak / total < 9


def test_host_buffers_are_reused_within_their_limit_and_never_rounded_up():
    buffers = HostBuffers(limit=2)
    first = buffers.take(1000)
    assert first.numel() == 1000 and buffers.nbytes < 2 * 1000
    address = first.data_ptr()
    view = first[10:20]
    del first
    second = buffers.take(900)
    assert second.data_ptr() != address, "a view keeps its buffer lent"
    del view, second
    third = buffers.take(1000)
    assert third.data_ptr() in (address, third.data_ptr()) and len(buffers._buffers) <= 2
    held = [third, buffers.take(5000), buffers.take(5000)]  # the third is beyond the limit
    assert len(buffers._buffers) == 2
    assert all(t.numel() in (1000, 5000) for t in held)
    del held
    again = buffers.take(4000)
    assert len(buffers._buffers) <= 2 and buffers.nbytes <= int(1.125 * 5000) + int(1.125 * 1000)
    del again


def test_a_freed_buffer_is_lent_again():
    buffers = HostBuffers(limit=1)
    address = buffers.take(4096).data_ptr()  # dropped at once
    assert buffers.take(4000).data_ptr() == address


@CUDA
def test_changes_from_a_gpu_land_in_pinned_buffers_the_pool_reuses():
    """Each call's changes land in one pinned buffer of the pool (no power-of-two rounding);
    a change set still alive keeps its buffer, one dropped gives it back."""
    buffers = HostBuffers(limit=2, pinned=True)

    def extract():
        pairs = [(c.cuda(), s.cuda(), torch.int32) for c, s in changed_pairs(4, 10_000, 0.1)]
        return sparse.extract_changes_batched_(pairs, host_buffers=buffers)

    first = extract()
    assert all(part.is_pinned() for part in first[0][:2])
    kept = buffers.nbytes
    del first
    second = extract()
    assert buffers.nbytes == kept, "the dropped set's buffer is lent again"
    third = extract()
    assert len(buffers._buffers) == 2 and second and third


# -- 3. PEFT merged weights in flight ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["compiled", "batched"])
def test_merged_weights_alive_at_once_are_bounded(dtype, monkeypatch):
    """LoRA on every linear layer: each merged weight is made when its turn comes and
    dropped after it, never more than `MERGES_IN_FLIGHT` at once (fp16 goes through the
    batched path, which merges one at a time); the changes are peft's merge bit for bit."""
    base, _ = build_tiny_model(dtype=dtype)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    detector = BF16ChangeDetector(model, optimizer)
    alive, most = [0], [0]
    lock = threading.Lock()
    original = detector.merged.value

    def counted_value(name: str) -> torch.Tensor:
        value = original(name)
        if name in detector.merged.adapted:
            with lock:
                alive[0] += 1
                most[0] = max(most[0], alive[0])

            def gone() -> None:
                with lock:
                    alive[0] -= 1

            weakref.finalize(value, gone)
        return value

    monkeypatch.setattr(detector.merged, "value", counted_value)
    try:
        tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        change_set = detector.changes()
        assert len(detector.merged.adapted) >= 14 and most[0] >= 1
        assert most[0] <= getattr(detector_module, "MERGES_IN_FLIGHT", 2), f"{most[0]} merged weights alive at once"
        merged = {n: p.detach().to(torch.bfloat16) for n, p in model.merge_and_unload().named_parameters()}
        for name, change in change_set.changes.items():
            assert torch.equal(
                merged[name].reshape(-1)[change.indices.long()].view(torch.int16), change.values.view(torch.int16)
            ), name
        assert set(detector.merged.adapted) <= set(change_set.changes)
    finally:
        detector.close()


# -- 4. the caller's stream --------------------------------------------------------------


def test_the_pool_threads_are_handed_the_callers_streams(monkeypatch, seeded):
    """`changes()` captures the calling thread's streams once and every pool thread makes
    exactly those current (on CPU: a stand-in mapping, identity checked)."""
    model = TwoTower(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    detector = BF16ChangeDetector(model, optimizer)
    captured = {torch.device("cuda", 0): object()}
    handed: list[tuple[int, object]] = []
    caller = threading.get_ident()

    def capture(devices):
        assert threading.get_ident() == caller
        list(devices)
        return captured

    @contextlib.contextmanager
    def enter(streams):
        handed.append((threading.get_ident(), streams))
        yield

    monkeypatch.setattr(detector_module, "caller_streams", capture, raising=False)
    monkeypatch.setattr(detector_module, "on_streams", enter, raising=False)
    try:
        train_step(model, optimizer, seed=0)
        detector.changes()
        assert handed and all(streams is captured for _, streams in handed)
    finally:
        detector.close()


@CUDA
def test_a_loop_training_on_its_own_stream_is_read_on_that_stream(seeded):
    """Weights on the GPU with a host snapshot are read by the pool threads: under
    `torch.cuda.stream(s)` they queue on `s`, after the step's writes."""
    model = TwoTower(torch.float32).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    detector = BF16ChangeDetector(model, optimizer, snapshot_device="cpu")
    seen: set[int] = set()
    original = detector._extract_read

    def read(names):
        seen.add(torch.cuda.current_stream().cuda_stream)
        return original(names)

    detector._extract_read = read
    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):
            before = {n: p.detach().to(torch.bfloat16).cpu() for n, p in model.named_parameters()}
            generator = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, 50, (4, 8), generator=generator).cuda()
            loss = model(tokens).float().sum()
            loss.backward()
            optimizer.step()
            change_set = detector.changes()
        assert seen == {stream.cuda_stream}
        after = {n: p.detach().to(torch.bfloat16).cpu() for n, p in model.named_parameters()}
        for name in after:
            changed = (after[name].view(torch.int16) != before[name].view(torch.int16)).reshape(-1).nonzero().squeeze(1)
            got = change_set.changes.get(name)
            assert torch.equal(changed, torch.empty(0, dtype=torch.long) if got is None else got.indices.long())
    finally:
        detector.close()
