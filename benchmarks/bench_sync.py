"""Trainer-side and replica-side cost of a delta sync, against references measured in the same run.

Model: bf16 parameters with Qwen3-like shapes (default ~100M parameters). Each step flips
a random `--changed` fraction of the elements by one or two ULPs, the pattern RL
fine-tuning produces (at RL learning rates 0.4-4% of bf16 elements change per step, most
by exactly one ULP), so the measured cost is that of a realistic
sparse delta.

References (same process, same tensors):

* `clone`: one `clone()` of every bf16 parameter.
* `trl_v1`: a TRL-v1-style pipeline: `.to(bfloat16).cpu().clone()` of every parameter,
  compare with the previous copy, `nonzero`, SHA-256 of the full weights, save the delta.
* `anchor_load`: loading a full anchor (safetensors `load_file`, from the page cache)
  into the replica model: a full reload without download or verification.

On the replica, `verify_apply` (download excluded) runs while vLLM keeps generating;
only `load` (copying the changed tensors into the model) pauses generation.

Beside a training loop: with `background=True` the encode and upload of a version run
on a worker thread while training goes on, and on a GPU trainer the training thread runs
Python all the while (it launches the kernels). Each call of the worker's that drops the
GIL then waits, to take it back, for that thread's switch interval (5 ms). A thread that
runs Python without pause stands in for it: per encoding (raw and compact), the worker's
seconds per version beside it against alone (`background_beside_python / alone`), and that
thread's pace meanwhile against its pace alone (`python_thread_pace`, 1 = not slowed).

Per node (`--workers`, default 2, the workers of a TP=2 server): separate processes, each
a `Receiver` with a `NodeStore` catching up from the bucket, report what the kernel says they hold of
the shared snapshot (`/proc/self/smaps`: resident, proportional and private bytes of the
mapped file), against private `Receiver`s in the same number of processes (one full copy
each). A late joiner's catch-up is timed twice, against `anchor_load`: on a node whose
snapshot already holds the newest version (it loads from it) and on a fresh node (newest
anchor and the deltas after it, from the bucket).

Prints a table and writes JSON (default `benchmarks/results/bench_sync.json`). Ratios,
not absolute seconds, are the figures to compare across machines.

    python benchmarks/bench_sync.py --params 100e6 --changed 0.02 --steps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from delta_sync import BF16ChangeDetector, Publisher, Receiver, module_weight_loader, read_file
from delta_sync.layout import anchor_path, delta_path
from delta_sync.replica.shared import NodeStore
from delta_sync.signing import SIGNATURE_SUFFIX, FileSignature, SigningKey, file_sha256


def qwen_like_shapes(params: float, hidden: int = 1024, vocab: int = 32768) -> dict[str, tuple[int, ...]]:
    """Shapes of a Qwen3-style decoder with about `params` parameters."""
    per_layer = 4 * hidden * hidden + 3 * hidden * 3 * hidden + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}"
        shapes.update(
            {
                f"{prefix}.self_attn.q_proj.weight": (hidden, hidden),
                f"{prefix}.self_attn.k_proj.weight": (hidden, hidden),
                f"{prefix}.self_attn.v_proj.weight": (hidden, hidden),
                f"{prefix}.self_attn.o_proj.weight": (hidden, hidden),
                f"{prefix}.mlp.gate_proj.weight": (3 * hidden, hidden),
                f"{prefix}.mlp.up_proj.weight": (3 * hidden, hidden),
                f"{prefix}.mlp.down_proj.weight": (hidden, 3 * hidden),
                f"{prefix}.input_layernorm.weight": (hidden,),
                f"{prefix}.post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    return shapes


class FlatModel(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.names = list(shapes)
        self.params = nn.ParameterList(
            nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
            for shape in shapes.values()
        )

    def named_parameters(self, *args, **kwargs):  # checkpoint names, as a transformers model has
        return zip(self.names, self.params)


def perturb(model: FlatModel, fraction: float, generator: torch.Generator) -> None:
    """Move a random `fraction` of elements by +-1 or +-2 ULPs, in place."""
    with torch.no_grad():
        for param in model.params:
            flat = param.view(-1).view(torch.int16)
            count = max(1, int(flat.numel() * fraction))
            positions = torch.randint(0, flat.numel(), (count,), generator=generator)
            steps = torch.randint(1, 3, (count,), generator=generator, dtype=torch.int16)
            signs = torch.where(torch.rand(count, generator=generator) < 0.5, -1, 1).to(torch.int16)
            flat[positions] += steps * signs


class NoStep(torch.optim.Optimizer):
    """The benchmark moves weights itself; the detector only needs an optimizer's hooks."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def check_signature(root: Path, path: str, key: SigningKey) -> None:
    """What a replica with a verify key does before reading a file: check the signature, hash the file."""
    signature = FileSignature.from_json((root / (path + SIGNATURE_SUFFIX)).read_bytes(), source=path)
    key.verify_key.verify_file(signature, path=path, bucket=root.as_uri(), sha256=file_sha256(root / path))


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class PythonLoop:
    """A thread that runs Python without pause (the training loop's stand-in), counting its
    iterations."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.count += 1

    def __enter__(self) -> PythonLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def python_pace(seconds: float) -> float:
    """Iterations per second of a [`PythonLoop`] with nothing else running."""
    with PythonLoop() as loop:
        start_count, started = loop.count, time.perf_counter()
        time.sleep(seconds)
        return (loop.count - start_count) / (time.perf_counter() - started)


def background_publish(shapes: dict, fraction: float, steps: int, root: Path, encoding: str) -> dict:
    """Seconds of the worker thread per version (from `publish()`'s return to `flush()`'s),
    alone and beside a [`PythonLoop`], and that loop's pace meanwhile."""
    model = FlatModel(shapes, seed=4)
    optimizer = NoStep(model.params)
    detector = BF16ChangeDetector(model, optimizer)
    publisher = Publisher(root, detector, anchor_every=10**9, background=True, encoding=encoding)
    generator = torch.Generator().manual_seed(5)
    version = 0

    def one(loop: PythonLoop | None) -> tuple[float, float]:
        nonlocal version
        perturb(model, fraction, generator)
        detector.mark_changed()
        optimizer.step()
        version += 1
        publisher.publish(version)
        counted, started = loop.count if loop else 0, time.perf_counter()
        publisher.flush()
        seconds = time.perf_counter() - started
        return seconds, ((loop.count - counted) / seconds if loop else 0.0)

    try:
        one(None)  # the anchor
        one(None)  # a first delta: compiled passes loaded
        alone = [one(None)[0] for _ in range(steps)]
        with PythonLoop() as loop:
            beside = [one(loop) for _ in range(steps)]
        # Its pace alone, in windows as long as those beside the worker (it varies by tens of
        # percent from one window to the next on a shared machine).
        window = max(0.3, statistics.median(seconds for seconds, _ in beside))
        pace = statistics.median(python_pace(window) for _ in range(3))
    finally:
        publisher.close()
        detector.close()
    return {
        "alone_seconds": statistics.median(alone),
        "beside_python_seconds": statistics.median(seconds for seconds, _ in beside),
        "python_thread_pace": statistics.median(rate for _, rate in beside) / pace,
    }


def node_worker(bucket: str, snapshot_dir: str | None, shapes: dict, barrier, results) -> None:
    """One worker of a node: catch up, then (with every other worker alive) report its memory."""
    # Reads every tensor, as a worker's `load_weights` does on its first catch-up.
    options = {"expected_shapes": shapes, "load_weights": lambda weights: [t.max() for _, t in weights]}
    if snapshot_dir is None:
        receiver = Receiver(**options)
    else:
        receiver = Receiver(store=NodeStore(snapshot_dir), **options)
    receiver.update(bucket)
    barrier.wait()
    results.put(dataclasses.asdict(receiver.memory()))
    barrier.wait()


def measure_node(bucket: Path, shapes: dict, workers: int, snapshot_dir: Path | None) -> list[dict]:
    """What each of `workers` processes holds after catching up (a shared or private snapshot each)."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(workers), context.Queue()
    args = (str(bucket), None if snapshot_dir is None else str(snapshot_dir), shapes, barrier, results)
    processes = [context.Process(target=node_worker, args=args) for _ in range(workers)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=1800) for _ in processes]
    for process in processes:
        process.join(timeout=600)
        if process.exitcode != 0:
            raise RuntimeError(f"a node worker exited with {process.exitcode}")
    return reports


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6, help="approximate parameter count (default 1e8)")
    parser.add_argument("--changed", type=float, default=0.02, help="fraction of elements changed per step")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary (default 32768)")
    parser.add_argument("--workers", type=int, default=2, help="workers sharing a node (default 2: TP=2)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "bench_sync.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    shapes = qwen_like_shapes(args.params, args.hidden, args.vocab)
    model = FlatModel(shapes, seed=0)
    numel = sum(math.prod(s) for s in shapes.values())
    generator = torch.Generator().manual_seed(1)
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    optimizer = NoStep(model.params)
    detector = BF16ChangeDetector(model, optimizer)
    signing_key = SigningKey.generate()
    publisher = Publisher(work / "bucket", detector, anchor_every=10**9, background=False, signing_key=signing_key)
    detector.mark_changed()
    optimizer.step()
    publisher.publish(1)  # the anchor; not measured

    replica = FlatModel(shapes, seed=2)
    load = module_weight_loader(replica)
    receiver = Receiver()  # the model load is timed on its own below
    receiver.update(work / "bucket")
    load([(name, receiver.weights[name]) for name in receiver.weights])

    trl_previous = {name: p.detach().to(torch.bfloat16).cpu().clone() for name, p in model.named_parameters()}
    rows: dict[str, list[float]] = {
        key: []
        for key in (
            "clone",
            "delta_sync",
            "trl_v1",
            "verify_apply",
            "signature",
            "load",
            "anchor_load",
            "anchor_signature",
        )
    }
    bytes_per_step, changed_per_step = [], []
    for step in range(2, args.steps + 2):
        perturb(model, args.changed, generator)
        detector.mark_changed()
        optimizer.step()

        rows["clone"].append(timed(lambda: [p.detach().clone() for p in model.params]))

        def trl_v1() -> None:
            current = {name: p.detach().to(torch.bfloat16).cpu().clone() for name, p in model.named_parameters()}
            delta = {}
            for name, tensor in current.items():
                indices = (tensor.view(torch.int16) != trl_previous[name].view(torch.int16)).reshape(-1).nonzero()
                delta[f"{name}.indices"] = indices.squeeze(1).to(torch.int32)
                delta[f"{name}.values"] = tensor.reshape(-1)[indices.squeeze(1)]
            digest = hashlib.sha256()
            for tensor in current.values():
                digest.update(tensor.view(torch.uint8).numpy())
            save_file(delta, str(work / "trl_v1.safetensors"), metadata={"sha256": digest.hexdigest()})
            trl_previous.clear()
            trl_previous.update(current)

        rows["trl_v1"].append(timed(trl_v1))
        rows["delta_sync"].append(timed(lambda step=step: publisher.publish(step)))
        report = publisher.reports[-1]
        bytes_per_step.append(report.delta_bytes)
        changed_per_step.append(report.changed_elements)

        delta = read_file(work / "bucket" / delta_path(step))
        rows["verify_apply"].append(timed(lambda delta=delta: receiver.apply(delta)))
        rows["signature"].append(
            timed(lambda step=step: check_signature(work / "bucket", delta_path(step), signing_key))
        )
        assert receiver.model_checksum == report.model_checksum
        changed = [(name, receiver.weights[name]) for name in sorted(delta.changes)]
        rows["load"].append(timed(lambda changed=changed: load(changed)))

    anchor_file = work / "bucket" / anchor_path(1)

    def anchor_load() -> None:
        tensors = load_file(str(anchor_file))
        for name, param in replica.named_parameters():
            param.data.copy_(tensors[name])

    for _ in range(min(3, args.steps)):
        rows["anchor_load"].append(timed(anchor_load))
        rows["anchor_signature"].append(timed(lambda: check_signature(work / "bucket", anchor_path(1), signing_key)))

    # -- the worker thread beside a training loop that runs Python --------------------------------
    background = {
        encoding: background_publish(shapes, args.changed, min(3, args.steps), work / f"bucket-{encoding}", encoding)
        for encoding in ("raw", "compact")
    }

    # -- one node: memory per worker, and a late joiner's catch-up ------------------------------
    nodes = work / "snapshots"
    shared = measure_node(work / "bucket", shapes, args.workers, nodes)
    private = measure_node(work / "bucket", shapes, args.workers, None)
    node_memory = {
        "workers": args.workers,
        "shared_file_bytes": shared[0]["shared_bytes"],
        "shared_private_bytes_per_worker": [r["private_bytes"] for r in shared],
        "shared_resident_bytes_per_worker": [r["resident_bytes"] for r in shared],
        "shared_proportional_bytes_total": sum(r["proportional_bytes"] for r in shared),
        "private_bytes_per_worker": [r["private_bytes"] for r in private],
    }

    def late_joiner(snapshot_dir: Path | None) -> float:
        joiner_model = FlatModel(shapes, seed=3)
        options = {"load_weights": module_weight_loader(joiner_model), "expected_shapes": shapes}
        if snapshot_dir is None:
            joiner = Receiver(**options)
        else:
            joiner = Receiver(store=NodeStore(snapshot_dir), **options)
        seconds = timed(lambda: joiner.update(work / "bucket"))
        assert joiner.model_checksum == publisher.reports[-1].model_checksum
        return seconds

    rows["late_joiner_node"] = [late_joiner(nodes)]
    rows["late_joiner_fresh"] = [late_joiner(None)]

    median = {key: statistics.median(values) for key, values in rows.items()}
    result = {
        "params": numel,
        "changed_fraction": args.changed,
        "steps": args.steps,
        "median_seconds": median,
        "ratios": {
            "delta_sync / clone": median["delta_sync"] / median["clone"],
            "trl_v1 / delta_sync": median["trl_v1"] / median["delta_sync"],
            "verify_apply / anchor_load": median["verify_apply"] / median["anchor_load"],
            "load / anchor_load": median["load"] / median["anchor_load"],
            "signature / verify_apply": median["signature"] / median["verify_apply"],
            "anchor_signature / anchor_load": median["anchor_signature"] / median["anchor_load"],
            "late_joiner_node / anchor_load": median["late_joiner_node"] / median["anchor_load"],
            "late_joiner_fresh / anchor_load": median["late_joiner_fresh"] / median["anchor_load"],
        },
        "background": {
            encoding: {**figures, "beside_python / alone": figures["beside_python_seconds"] / figures["alone_seconds"]}
            for encoding, figures in background.items()
        },
        "node_memory": node_memory,
        "delta_bytes_per_step": statistics.median(bytes_per_step),
        "bytes_per_changed_element": statistics.median(b / c for b, c in zip(bytes_per_step, changed_per_step)),
        "full_bf16_bytes": 2 * numel,
        "snapshot_bytes_trainer": sum(t.numel() * t.element_size() for t in detector.snapshot.values()),
        "snapshot_bytes_replica": sum(t.numel() * t.element_size() for t in receiver.weights.values()),
    }
    print(
        f"model: {numel / 1e6:.1f}M bf16 parameters, {args.changed:.1%} of elements changed per step, "
        f"{args.steps} steps (medians)"
    )
    print(f"{'what':<44} {'seconds':>10} {'ratio':>8}  goal")
    print(f"{'trainer: one clone() of the weights':<44} {median['clone']:>10.4f}")
    print(
        f"{'trainer: delta-sync detect+extract+encode+write':<44} {median['delta_sync']:>10.4f} "
        f"{result['ratios']['delta_sync / clone']:>7.2f}x  <= 3x clone"
    )
    print(
        f"{'trainer: TRL-v1-style pipeline':<44} {median['trl_v1']:>10.4f} "
        f"{result['ratios']['trl_v1 / delta_sync']:>7.2f}x  >= 3x slower than delta-sync"
    )
    print(f"{'replica: full anchor load':<44} {median['anchor_load']:>10.4f}")
    print(
        f"{'replica: delta verify + apply to snapshot':<44} {median['verify_apply']:>10.4f} "
        f"{result['ratios']['verify_apply / anchor_load']:>7.2f}x  O(changed), while generating"
    )
    print(
        f"{'replica: delta signature (SHA-256 + Ed25519)':<44} {median['signature']:>10.4f} "
        f"{result['ratios']['signature / verify_apply']:>7.2f}x  of the delta's verify + apply"
    )
    print(
        f"{'replica: anchor signature (SHA-256 + Ed25519)':<44} {median['anchor_signature']:>10.4f} "
        f"{result['ratios']['anchor_signature / anchor_load']:>7.2f}x  of a full anchor load"
    )
    print(
        f"{'replica: load changed tensors (the pause)':<44} {median['load']:>10.4f} "
        f"{result['ratios']['load / anchor_load']:>7.2f}x  well under a full reload"
    )
    print(
        f"delta file: {result['delta_bytes_per_step']:,.0f} bytes per step "
        f"({result['bytes_per_changed_element']:.2f} bytes per changed element; full bf16 {2 * numel:,} bytes)"
    )
    print(
        f"memory: trainer snapshot {result['snapshot_bytes_trainer'] / (2 * numel):.2f}x bf16 model, "
        f"replica snapshot {result['snapshot_bytes_replica'] / (2 * numel):.2f}x"
    )
    for encoding, figures in result["background"].items():
        print(
            f"{'trainer: worker thread per version, ' + encoding:<44} {figures['alone_seconds']:>10.4f}  alone; "
            f"{figures['beside_python_seconds']:.4f} s ({figures['beside_python / alone']:.2f}x) beside a thread "
            f"running Python, whose pace meanwhile is {figures['python_thread_pace']:.2f}x its own"
        )
    full = 2 * numel
    print(
        f"node, {args.workers} workers: shared snapshot file {node_memory['shared_file_bytes'] / full:.2f}x bf16 model; "
        f"per worker private {max(node_memory['shared_private_bytes_per_worker']) / full:.3f}x, "
        f"resident (shared pages) {max(node_memory['shared_resident_bytes_per_worker']) / full:.2f}x; "
        f"proportional total {node_memory['shared_proportional_bytes_total'] / full:.2f}x "
        f"(private snapshots: {sum(node_memory['private_bytes_per_worker']) / full:.2f}x in total)"
    )
    print(
        f"{'replica: late joiner, node already at newest':<44} {median['late_joiner_node']:>10.4f} "
        f"{result['ratios']['late_joiner_node / anchor_load']:>7.2f}x  of a full anchor load"
    )
    print(
        f"{'replica: late joiner, fresh node (anchor+deltas)':<44} {median['late_joiner_fresh']:>10.4f} "
        f"{result['ratios']['late_joiner_fresh / anchor_load']:>7.2f}x  of a full anchor load"
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output}")
    publisher.close()
    return result


if __name__ == "__main__":
    main()
