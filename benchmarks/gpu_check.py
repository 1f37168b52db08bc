"""The GPU trainer check: device detection exact, compact streams identical, and what a sync costs the training loop.

Needs only torch, transformers and delta-sync's trainer side (no vLLM, no TRL). Three parts:

1. **Detection.** A Qwen3-shaped model on the device takes real AdamW steps (lr 3e-6),
   with bf16 parameters and with fp32 masters. At every step the device path
   (`BF16ChangeDetector.changes()` on device tensors) must report exactly what the
   compiled CPU pass reports for the same tensors copied to the host: positions, new and
   old bf16 bit patterns. The host mirror must equal the device snapshot bit for bit.
2. **Compact streams.** Each step's compact entries coded against the host mirror equal,
   byte for byte, those coded against a host copy of the device snapshot.
3. **Cost per sync** (a `Publisher` in the background, raw and compact): the seconds the
   training loop is blocked in `publish()`, the worker thread's seconds, the bytes that
   crossed device-to-host (counted from the CUDA profiler's memcpy records, against the
   changes' int32 positions and new bf16 values) and the host memory the mirror adds, against one device `clone()` of the bf16 weights measured in the same run.

Prints a table and writes JSON. On a machine without CUDA, `--device cpu` runs the same
code on CPU tensors (the checks then compare the compiled pass with itself, and the
figures are not a GPU's); the test suite runs it so (tests/test_gpu_check.py).

Models up to 4e9 parameters train with AdamW. Above that, AdamW's two moments (4 bytes a
bf16 parameter) with the weights, gradients, snapshot and the clone measured against do not
fit one 80 GB GPU, so those sizes step by the sign of the gradient: AdamW's own first step
(its update is the learning rate times `g / (|g| + eps)`), with no state.

    python benchmarks/gpu_check.py --sizes 1e9 8e9 --out gpu-check
    python benchmarks/gpu_check.py --device cpu --sizes 1e6 --steps 2 --out /tmp/smoke

On a GPU machine without a package index, `benchmarks/gpu_check_env.sh` installs what the
check needs beyond torch, transformers, numba and safetensors from a wheelhouse built
elsewhere, and runs it (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Run as a script, Python puts benchmarks/ on the path, not the repository: the check runs
# this checkout's delta_sync, whether or not a copy of it is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from delta_sync import BF16ChangeDetector, Publisher  # noqa: E402
from delta_sync.compact import encode_changes  # noqa: E402
from delta_sync.sparse import extract_changes_  # noqa: E402

#: Bytes that must cross to the host per changed element: an int32 position and the new bf16
#: value (the old one is on the host already, in the mirror).
CROSSING_BYTES = 4 + 2


def build_model(params: float, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised Qwen3 of about `params` parameters (hidden 4096 from 1B up;
    below 2e6, the few narrow layers of a CPU dry run)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden = 4096 if params >= 1e9 else 512 if params >= 2e6 else 128
    vocab = 151_936 if params >= 1e9 else 8192 if params >= 2e6 else 1024
    per_layer = 12 * hidden * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype)


#: The largest model trained with AdamW; larger ones step by the gradient's sign (see above).
ADAMW_UP_TO = 4e9


class SignDescent(torch.optim.Optimizer):
    """AdamW's first step, `lr * sign(g)`, at every step and without state: how a model too
    large for AdamW's moments beside everything else moves like one AdamW trains."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-group["lr"])


def make_optimizer(model: torch.nn.Module, params: float) -> torch.optim.Optimizer:
    if params > ADAMW_UP_TO:
        return SignDescent(model.parameters(), lr=3e-6)
    return torch.optim.AdamW(model.parameters(), lr=3e-6)


def release(device: str) -> None:
    """Give a finished configuration's memory back before the next is built: nothing of it
    is left in a reference cycle (a closed publisher frees its model), so one collection
    and the allocator's cache are all there is."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, device: str) -> None:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(step)).to(device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def check_detection(params: float, device: str, master: bool, steps: int) -> dict:
    """Parts 1 and 2 on one model: every step exact, every compact stream identical."""
    model = build_model(params, device, torch.float32 if master else torch.bfloat16)
    optimizer = make_optimizer(model, params)
    detector = BF16ChangeDetector(model, optimizer, host_mirror=True)
    changed, streams = [], 0
    try:
        for step in range(steps):
            train_step(model, optimizer, step, device)
            # What the compiled CPU pass finds in the same tensors, on host copies.
            expected = {}
            for name, param in detector.named_parameters():
                # Copies, also on a CPU run: the compiled pass advances the snapshot it is given.
                host_snapshot = detector.snapshot[name].to("cpu", copy=True)
                found = extract_changes_(param.detach().to("cpu", copy=True), host_snapshot, torch.int32)
                if found is not None and found[0].numel():
                    expected[name] = found
            change_set = detector.changes()
            if sorted(change_set.changes) != sorted(expected):
                raise AssertionError(f"step {step}: the device path changed other tensors than the compiled pass")
            for name, (positions, new, old) in expected.items():
                change = change_set.changes[name]
                if not (
                    torch.equal(change.indices.long(), positions.long())
                    and torch.equal(change.values.view(torch.int16), new.view(torch.int16))
                    and torch.equal(change_set.old_values[name].view(torch.int16), old.view(torch.int16))
                ):
                    raise AssertionError(f"step {step}: {name} differs between the device path and the compiled pass")
            for name, tensor in detector.snapshot.items():
                if not torch.equal(detector.mirror.tensors[name].view(torch.int16), tensor.cpu().view(torch.int16)):
                    raise AssertionError(f"step {step}: the host mirror of {name} is not the snapshot")
            names = list(change_set.changes)
            mirrored = encode_changes(
                change_set.changes, detector.host_snapshot(names), old_values=change_set.old_values
            )
            copied = encode_changes(
                change_set.changes,
                {name: detector.snapshot[name].cpu() for name in names},
                old_values=change_set.old_values,
            )
            if sorted(mirrored) != sorted(copied) or any(
                not torch.equal(mirrored[key], copied[key]) for key in mirrored
            ):
                raise AssertionError(f"step {step}: compact streams differ between the mirror and a snapshot copy")
            streams += len(mirrored)
            changed.append(change_set.changed_elements / change_set.total_elements)
    finally:
        detector.close()
    return {
        "params": params,
        "numel": sum(p.numel() for p in model.parameters()),
        "master": master,
        "optimizer": type(optimizer).__name__,
        "steps": steps,
        "changed_fraction": changed,
        "streams": streams,
    }


def device_to_host_bytes(run) -> int:
    """Bytes copied device-to-host while `run()` runs, from the CUDA profiler's memcpy
    records (0 on a CPU run: nothing crosses)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        run()
        return 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof, tempfile.NamedTemporaryFile(suffix=".json") as trace:
        run()
    prof.export_chrome_trace(trace.name)
    events = json.loads(Path(trace.name).read_text()).get("traceEvents", [])
    return sum(
        int(event.get("args", {}).get("bytes", 0))
        for event in events
        if event.get("cat") == "gpu_memcpy" and "DtoH" in event.get("name", "")
    )


def measure_cost(
    params: float, device: str, master: bool, steps: int, encoding: str, snapshot_device: str | None = None
) -> dict:
    """Part 3: what `publish()` blocks, against a device clone of the bf16 weights."""
    model = build_model(params, device, torch.float32 if master else torch.bfloat16)
    optimizer = make_optimizer(model, params)
    detector = BF16ChangeDetector(model, optimizer, snapshot_device=snapshot_device)
    numel = sum(p.numel() for p in model.parameters())
    blocked, background, clones, crossed, changed = [], [], [], [], []
    with tempfile.TemporaryDirectory() as bucket:
        # Anchors only at the start: the steps measured are deltas.
        publisher = Publisher(bucket, detector, anchor_every=10**6, anchor_bytes_ratio=None, encoding=encoding)
        try:
            publisher.publish(1)
            publisher.flush()
            for step in range(steps):
                train_step(model, optimizer, step, device)
                synchronize(device)
                started = time.perf_counter()
                copies = [p.detach().to(torch.bfloat16).clone() for p in model.parameters()]
                synchronize(device)
                clones.append(time.perf_counter() - started)
                del copies

                def publish(version: int = step + 2) -> None:
                    started = time.perf_counter()
                    publisher.publish(version)
                    synchronize(device)
                    blocked.append(time.perf_counter() - started)
                    publisher.flush()  # the rest runs on the worker thread, off the training loop

                crossed.append(device_to_host_bytes(publish))
                report = publisher.reports[-1]
                background.append(report.publish_seconds)
                changed.append(report.changed_elements)
        finally:
            publisher.close()
            mirror = detector.mirror.nbytes if detector.mirror is not None else 0
            detector.close()
    clone = statistics.median(clones)
    return {
        "params": params,
        "numel": numel,
        "master": master,
        "optimizer": type(optimizer).__name__,
        "encoding": encoding,
        "snapshot_device": snapshot_device or device,
        "blocked_seconds": blocked,
        "background_seconds": background,
        "clone_seconds": clones,
        "blocked_x_clone": statistics.median(blocked) / clone,
        "changed_elements": changed,
        "device_to_host_bytes": crossed,
        "device_to_host_x_changes": statistics.median(
            bytes_ / (CROSSING_BYTES * count) for bytes_, count in zip(crossed, changed) if count
        )
        if any(changed)
        else 0.0,
        "full_model_bytes": 2 * numel,
        "host_mirror_bytes": mirror,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e9, 8e9], help="model sizes in parameters")
    parser.add_argument("--steps", type=int, default=4, help="steps per model")
    parser.add_argument(
        "--check-size",
        type=float,
        default=None,
        help="model size of the exactness checks (default: 1e9 on a GPU, the smallest of --sizes on CPU)",
    )
    parser.add_argument("--out", default="gpu-check", help="output directory")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu for a smoke run (its figures are not a GPU's)")
    if args.check_size is None:
        args.check_size = 1e9 if args.device.startswith("cuda") else min(args.sizes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {"device": args.device, "torch": torch.__version__, "checks": [], "costs": []}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name(args.device)
    for master in (False, True):
        results["checks"].append(check_detection(args.check_size, args.device, master, args.steps))
        release(args.device)
        print(f"detection exact and compact streams identical: {json.dumps(results['checks'][-1])}", flush=True)
    for params in args.sizes:
        for master in (False, True):
            if master and params > ADAMW_UP_TO:
                continue  # fp32 masters and their gradients of an 8B model do not fit one GPU with the rest
            # The snapshot with the weights (the default), and on the host (`snapshot_device="cpu"`,
            # which moves 2 bytes per touched element to the host every step by design).
            for encoding, snapshot_device in (("raw", None), ("compact", None), ("raw", "cpu")):
                results["costs"].append(
                    measure_cost(params, args.device, master, args.steps, encoding, snapshot_device)
                )
                release(args.device)
                print(f"measured: {json.dumps(results['costs'][-1])}", flush=True)
    results["seconds"] = time.perf_counter() - started
    print("| params | masters | optimizer | steps | device detection = compiled pass | compact streams identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in results["checks"]:
        # check_detection raises on the first difference: a row here is a step-by-step pass.
        print(
            f"| {row['numel'] / 1e9:.2f}B | {'fp32' if row['master'] else 'bf16'} | {row['optimizer']} "
            f"| {row['steps']} | yes, bit for bit | yes ({row['streams']} streams) |"
        )
    print()
    print(
        "| params | masters | encoding | snapshot on | blocked s | blocked x clone | background s "
        "| device-to-host per step | x (changes x 6 B) | host mirror |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in results["costs"]:
        print(
            f"| {row['numel'] / 1e9:.2f}B | {'fp32' if row['master'] else 'bf16'} | {row['encoding']} "
            f"| {row['snapshot_device']} | {statistics.median(row['blocked_seconds']):.4f} "
            f"| {row['blocked_x_clone']:.2f}x | {statistics.median(row['background_seconds']):.3f} "
            f"| {statistics.median(row['device_to_host_bytes']) / 1e6:.1f} MB "
            f"| {row['device_to_host_x_changes']:.2f} | {row['host_mirror_bytes'] / 1e9:.2f} GB |"
        )
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'results.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
