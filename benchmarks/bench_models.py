"""Publishing a mixture-of-experts model: its checkpoint layout against its run-time layout.

On transformers 5 a Qwen3-MoE model holds each layer's experts fused at run time
(`mlp.experts.gate_up_proj` of shape `[E, 2I, H]`, `mlp.experts.down_proj`), while its
checkpoint, and so every anchor and delta delta-sync publishes, has one tensor per expert
and projection (`mlp.experts.{e}.gate_proj.weight`, ...). The detector tracks the run-time
tensors; the publisher maps each step's changes to checkpoint names and positions through
the detector's `CheckpointLayout`. This benchmark measures what that conversion costs, in
bytes and in the trainer's time, against the same model published in its run-time layout.

Model: a random-init `Qwen3MoeForCausalLM` built from a `Qwen3MoeConfig` (nothing is
downloaded; default 4 layers of 32 experts, 4 per token, hidden 256: 15.5M parameters),
fp32 master weights, real AdamW steps at an RL learning rate (default 3e-6) on a causal-LM
loss of random tokens. Few tokens per step (default 2 x 16), so that the router sends
tokens to only some experts (an expert it skips keeps its weights at first, but AdamW's
moments move it on for steps after its last token).

Four publishers follow the model, each with its own `BF16ChangeDetector` (same model, same
optimizer, so every one sees the same changes), `background=False`, deltas only after the
first version (an anchor):

* checkpoint layout, raw and compact: `Publisher` as a trainer uses it;
* run-time layout, raw and compact: the reference. delta-sync has no option to publish in
  the run-time layout, so the reference is the same `Publisher` over a detector whose
  `checkpoint` layout is replaced by the identity layout (`CheckpointLayout.identity_of`):
  its deltas hold the detector's run-time changes (fused tensors, run-time names and
  positions) through the same writer and encoders. Its payload is checked each step
  against the encoders (`delta_sync.encodings.CODECS`: raw tensors, `compact.encode_changes`)
  applied directly to the detector's run-time `ChangeSet`, and the checkpoint publisher's
  against the same applied to the `ChangeSet` mapped by `CheckpointLayout.map_changes`.

Measured per step (the order of the two layouts alternating from step to step, after a
detector of its own has read the weights first: the first reader after a training step is
slower; the objects made before the first step frozen out of the garbage collector's full
passes); bytes are means over the steps, seconds the best of the steps (on a shared
machine one call can take 2-3x another; medians are in the JSON too):

* bytes of the delta file (what is uploaded and downloaded), its tensor payload and the
  rest (the safetensors header: entry names and delta-sync's metadata, which names every
  changed tensor);
* the training thread's time per publish: with `background=True` (the default) only
  detection and the hand-off block the training loop (the publisher's `detect_seconds`:
  the conversion runs on the worker thread); with `background=False` the whole publish
  (detect, convert, encode, write) does;
* the conversion alone (`CheckpointLayout.map_changes` of the step's changes), and the
  one-time `CheckpointLayout.of` when the detector is made;
* per expert, the fraction of its elements (gate, up and down projections) whose bf16
  value changed in the step: min / median / max over all experts of all layers, how many
  did not change at all, and how many the router sent no token in that step.

Targets (ratios against the reference measured in the same run, not seconds): the
checkpoint-layout delta file at most 1.01x the run-time one in bytes, per encoding; the
training thread's time per publish with the conversion at most 1.10x the run-time
layout's, with `background=True` (the best of both encodings' calls: the same work) and,
where the whole publish blocks, with `background=False` (per encoding).

Prints tables and writes JSON (default `benchmarks/results/models/results.json`). Every
figure is measured on the CPU.

    python benchmarks/bench_models.py                      # defaults: 4 layers x 32 experts, top-4, 8 steps
    python benchmarks/bench_models.py --real-experts       # experts of Qwen3-30B-A3B's shape, 2 layers x 16
    python benchmarks/bench_models.py --quick --out DIR    # a tiny model, 2 steps (a smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from delta_sync import BF16ChangeDetector, Publisher
from delta_sync.changes import Encoding
from delta_sync.checkpoint import CheckpointLayout
from delta_sync.encodings import CODECS
from delta_sync.trainer.detector import ChangeSet

ENCODINGS = ("raw", "compact")
LAYOUTS = ("checkpoint", "runtime")
#: A checkpoint tensor of one expert: layer, expert, projection.
EXPERT_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
#: Target ratios, checkpoint layout / run-time layout.
BYTES_LIMIT = 1.01
TIME_LIMIT = 1.10
#: Per step and layout: bytes (means over the steps) and seconds (best of the steps).
BYTE_KEYS = ("file", "payload", "header", "tensors")
TIME_KEYS = ("blocking_seconds", "synchronous_seconds", "worker_seconds")
#: Command-line options: name -> (type, default, default with --quick, meaning).
OPTIONS: dict[str, tuple[type, Any, Any, str]] = {
    "layers": (int, 4, 2, "decoder layers"),
    "experts": (int, 32, 16, "experts per layer"),
    "top_k": (int, 4, 2, "experts per token"),
    "hidden": (int, 256, 64, "hidden size"),
    "moe_intermediate": (int, 128, 32, "each expert's intermediate size"),
    "heads": (int, 4, 2, "attention heads (key/value heads: half as many)"),
    "vocab": (int, 4096, 512, "vocabulary"),
    "steps": (int, 8, 2, "AdamW steps, one delta each"),
}
#: The training options every MoE benchmark takes.
TRAINING_OPTIONS: dict[str, tuple[type, Any, Any, str]] = {
    "lr": (float, 3e-6, 3e-6, "AdamW learning rate"),
    "batch": (int, 2, 2, "sequences per step"),
    "seq": (int, 16, 16, "tokens per sequence"),
    "seed": (int, 0, 0, "seed of the weights and tokens"),
}
OPTIONS |= TRAINING_OPTIONS
#: `--real-experts`: experts of Qwen3-30B-A3B's shape (hidden 2048, each expert's
#: intermediate 768), 16 of them per layer in 2 layers: headers and per-stream costs take the
#: share of a delta they take at real sizes, on a model a CPU trains in seconds per step.
REAL_EXPERTS = {"layers": 2, "experts": 16, "top_k": 4, "hidden": 2048, "moe_intermediate": 768, "heads": 32}


def build_model(args: argparse.Namespace) -> transformers.Qwen3MoeForCausalLM:
    config = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        vocab_size=args.vocab,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(64, args.seq),
    )
    torch.manual_seed(args.seed)
    return transformers.Qwen3MoeForCausalLM(config)  # fp32: the optimizer's master weights


class RouterCounts:
    """Tokens the router sends to each expert of each layer, per training step."""

    def __init__(self, model: transformers.Qwen3MoeForCausalLM) -> None:
        self.counts: dict[int, torch.Tensor] = {}
        self.hooks = [
            layer.mlp.gate.register_forward_hook(self._hook(number, layer.mlp.gate.num_experts))
            for number, layer in enumerate(model.model.layers)
        ]

    def _hook(self, layer: int, experts: int):
        def record(module, inputs, output) -> None:
            indices = output[2]  # (tokens, top_k) expert indices
            self.counts[layer] = self.counts.get(layer, 0) + torch.bincount(indices.reshape(-1), minlength=experts)

        return record

    def take(self) -> dict[int, torch.Tensor]:
        counts, self.counts = self.counts, {}
        return counts

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def train_step(model, optimizer, args: argparse.Namespace, seed: int) -> None:
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def runtime_layout(detector: BF16ChangeDetector) -> BF16ChangeDetector:
    """The reference: a detector whose publisher writes the run-time tensors as they are."""
    detector.checkpoint = CheckpointLayout.identity_of(
        detector.layout.shapes, model_type=detector.checkpoint.model_type
    )
    return detector


def file_bytes(path: Path) -> dict[str, int]:
    """A delta file's size, its tensor payload, the rest (length prefix and header), and the
    tensors it names as changed."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        (header,) = struct.unpack("<Q", handle.read(8))
        metadata = json.loads(handle.read(header))["__metadata__"]
    return {
        "file": size,
        "payload": size - 8 - header,
        "header": 8 + header,
        "tensors": len(json.loads(metadata["changed_params"])),
    }


def payload_bytes(entries: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in entries.values())


def direct_payloads(detector: BF16ChangeDetector, change_set: ChangeSet) -> tuple[dict[str, dict[str, int]], float]:
    """The encoders applied directly to the detector's `ChangeSet` (run-time layout) and to
    its checkpoint mapping: payload bytes per encoding and layout, and the seconds of
    `map_changes`."""
    started = time.perf_counter()
    mapped, mapped_old = detector.checkpoint.map_changes(change_set.changes, change_set.old_values)
    map_seconds = time.perf_counter() - started
    shapes = {"runtime": change_set.shapes, "checkpoint": detector.checkpoint.shapes}
    inputs = {
        "runtime": (change_set.changes, detector.snapshot, change_set.old_values),
        "checkpoint": (mapped, detector.checkpoint.values(detector.snapshot, mapped), mapped_old),
    }
    payloads: dict[str, dict[str, int]] = {}
    for encoding in ENCODINGS:
        codec = CODECS[Encoding(encoding)]
        payloads[encoding] = {
            layout: payload_bytes(codec.encode(changes, shapes[layout], previous, old))
            for layout, (changes, previous, old) in inputs.items()
        }
    return payloads, map_seconds


def expert_fractions(delta: Path, sizes: dict[tuple[int, int], int], routed: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Per expert, the fraction of its elements changed in a checkpoint-layout raw delta."""
    from safetensors import safe_open

    changed = dict.fromkeys(sizes, 0)
    with safe_open(str(delta), framework="pt") as handle:
        for key in handle.keys():
            if key.endswith(".indices") and (match := EXPERT_TENSOR.search(key.removesuffix(".indices"))):
                changed[(int(match[1]), int(match[2]))] += handle.get_slice(key).get_shape()[0]
    fractions = {expert: changed[expert] / sizes[expert] for expert in sizes}
    unrouted = {expert for expert in sizes if int(routed[expert[0]][expert[1]]) == 0}
    unchanged = {expert for expert, fraction in fractions.items() if fraction == 0}
    values = sorted(fractions.values())
    return {
        "experts": len(values),
        "min": values[0],
        "median": statistics.median(values),
        "max": values[-1],
        "unchanged": len(unchanged),
        "unrouted": len(unrouted),
        "unrouted_but_changed": len(unrouted - unchanged),
        "unchanged_ids": sorted(f"{layer}.{expert}" for layer, expert in unchanged),
        "fractions": values,
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = build_model(args)
    # No weight decay, as transformers' `TrainingArguments` (and so TRL) default to.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    started = time.perf_counter()
    layout = CheckpointLayout.of(model)
    layout_seconds = time.perf_counter() - started
    expert_sizes: dict[tuple[int, int], int] = {}
    for name, shape in layout.shapes.items():
        if match := EXPERT_TENSOR.search(name):
            key = (int(match[1]), int(match[2]))
            expert_sizes[key] = expert_sizes.get(key, 0) + int(torch.Size(shape).numel())
    quiet = {"anchor_every": 10**9, "anchor_bytes_ratio": None, "background": False, "pointer_refresh": None}
    detectors, publishers = {}, {}
    for encoding in ENCODINGS:
        for kind in LAYOUTS:
            detector = BF16ChangeDetector(model, optimizer)
            detectors[encoding, kind] = runtime_layout(detector) if kind == "runtime" else detector
            publishers[encoding, kind] = Publisher(
                workdir / f"{encoding}-{kind}", detectors[encoding, kind], encoding=encoding, **quiet
            )
    analysis = BF16ChangeDetector(model, optimizer)
    router = RouterCounts(model)
    rows: list[dict[str, Any]] = []
    try:
        for publisher in publishers.values():
            publisher.publish(1)  # the anchor of the initial weights
        analysis.changes()
        # The objects made so far (torch's, transformers', the model's) leave the collector's
        # reach: its full passes over them took up to 30 ms here, landing in whichever call
        # tripped them, where the training thread's part of a publish takes about 5 ms.
        gc.collect()
        gc.freeze()
        for step in range(1, args.steps + 1):
            train_step(model, optimizer, args, seed=args.seed * 1000 + step)
            routed = router.take()
            # The first detector to read the weights after a training step is slower than
            # the next ones (about 2x here): this one goes first, so no publisher pays it.
            change_set = analysis.changes()
            version = step + 1
            row: dict[str, Any] = {"version": version}
            order = LAYOUTS if step % 2 else LAYOUTS[::-1]
            for encoding in ENCODINGS:
                row[encoding] = {}
                for kind in order:
                    publisher = publishers[encoding, kind]
                    started = time.perf_counter()
                    publisher.publish(version)
                    call = time.perf_counter() - started
                    report = publisher.reports[-1]
                    if report.delta is None or report.anchor is not None:
                        raise RuntimeError(f"version {version} was published as {report.kind}, not a delta alone")
                    row[encoding][kind] = {
                        **file_bytes(publisher.bucket.root / report.delta),
                        "changed_elements": report.changed_elements,
                        "blocking_seconds": report.detect_seconds,
                        "synchronous_seconds": call,
                        "worker_seconds": report.publish_seconds,
                    }
            changed = {row[e][k]["changed_elements"] for e in ENCODINGS for k in LAYOUTS}
            direct, map_seconds = direct_payloads(analysis, change_set)
            direct_changed = change_set.changed_elements
            if changed != {direct_changed}:
                raise AssertionError(
                    f"step {step}: the publishers counted {changed} changes, the detector {direct_changed}"
                )
            for encoding in ENCODINGS:
                for kind in LAYOUTS:
                    row[encoding][kind]["direct_payload"] = direct[encoding][kind]
            row["changed_elements"] = direct_changed
            row["changed_fraction"] = direct_changed / analysis.total_elements
            row["map_changes_seconds"] = map_seconds
            checkpoint_raw = publishers["raw", "checkpoint"]
            row["experts"] = expert_fractions(
                checkpoint_raw.bucket.root / checkpoint_raw.reports[-1].delta, expert_sizes, routed
            )
            rows.append(row)
            print(
                f"  step {step}: {100 * row['changed_fraction']:.2f}% changed; delta bytes "
                + ", ".join(f"{e} {row[e]['checkpoint']['file']:,} / {row[e]['runtime']['file']:,}" for e in ENCODINGS)
                + f" (checkpoint / run-time); experts unchanged {row['experts']['unchanged']} "
                f"of {row['experts']['experts']}, routed no token {row['experts']['unrouted']}",
                flush=True,
            )
    finally:
        gc.unfreeze()
        router.close()
        for publisher in publishers.values():
            publisher.close()
        for detector in (*detectors.values(), analysis):
            detector.close()
    return {
        "model": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "expert_parameters": sum(expert_sizes.values()),
            "layers": args.layers,
            "experts": args.experts,
            "top_k": args.top_k,
            "hidden": args.hidden,
            "moe_intermediate": args.moe_intermediate,
            "runtime_tensors": len(layout.sources(layout.shapes)),
            "checkpoint_tensors": len(layout.shapes),
        },
        "layout_of_seconds": layout_seconds,
        "steps": rows,
    }


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    rows = results["steps"]
    summary: dict[str, Any] = {}
    for encoding in ENCODINGS:
        per: dict[str, Any] = {}
        for kind in LAYOUTS:
            cells = [row[encoding][kind] for row in rows]
            per[kind] = {key: statistics.mean(cell[key] for cell in cells) for key in BYTE_KEYS}
            for key in TIME_KEYS:
                per[kind][key] = min(cell[key] for cell in cells)
                per[kind][f"{key}_median"] = statistics.median(cell[key] for cell in cells)
            per[kind]["payload_matches_direct_encoding"] = all(
                cell["payload"] == cell["direct_payload"] for cell in cells
            )
        for key in (*BYTE_KEYS, *TIME_KEYS):
            per[f"{key.removesuffix('_seconds')}_ratio"] = per["checkpoint"][key] / per["runtime"][key]
        summary[encoding] = per
    # The training thread does the same work for both encodings (detection and the hand-off):
    # the best of both encodings' calls, twice the samples against the noise of a shared machine.
    thread: dict[str, Any] = {"calls": len(ENCODINGS) * len(rows)}
    for kind in LAYOUTS:
        calls = [row[encoding][kind]["blocking_seconds"] for row in rows for encoding in ENCODINGS]
        thread[kind], thread[f"{kind}_median"] = min(calls), statistics.median(calls)
    thread["ratio"] = thread["checkpoint"] / thread["runtime"]
    summary["training_thread"] = thread
    pooled = [fraction for row in rows for fraction in row["experts"]["fractions"]]
    never = set.intersection(*(set(row["experts"]["unchanged_ids"]) for row in rows))
    summary["experts"] = {
        "experts": rows[0]["experts"]["experts"],
        "min": min(pooled),
        "median": statistics.median(pooled),
        "max": max(pooled),
        "unchanged_per_step": statistics.mean(row["experts"]["unchanged"] for row in rows),
        "unrouted_per_step": statistics.mean(row["experts"]["unrouted"] for row in rows),
        "unrouted_but_changed_per_step": statistics.mean(row["experts"]["unrouted_but_changed"] for row in rows),
        "never_changed": len(never),
    }
    summary["changed_fraction"] = statistics.mean(row["changed_fraction"] for row in rows)
    map_seconds = min(row["map_changes_seconds"] for row in rows)
    summary["map_changes_seconds"] = map_seconds
    summary["map_changes_x_training_thread"] = map_seconds / thread["checkpoint"]
    targets = [
        {
            "name": f"{encoding}: delta file bytes, checkpoint / run-time layout",
            "value": summary[encoding]["file_ratio"],
            "limit": BYTES_LIMIT,
        }
        for encoding in ENCODINGS
    ]
    targets.append(
        {
            "name": "training thread per publish (background=True), checkpoint / run-time layout",
            "value": thread["ratio"],
            "limit": TIME_LIMIT,
        }
    )
    for encoding in ENCODINGS:
        per = summary[encoding]
        targets += [
            {
                "name": f"{encoding}: whole publish (background=False), checkpoint / run-time layout",
                "value": per["synchronous_ratio"],
                "limit": TIME_LIMIT,
            },
        ]
    for target in targets:
        target["met"] = target["value"] <= target["limit"]
    summary["targets"] = targets
    return summary


def print_tables(results: dict[str, Any]) -> None:
    model, summary = results["model"], results["summary"]
    machine = results["machine"]
    print()
    print(
        f"CPU figures ({machine['cpus']} cores, torch {machine['torch']}, transformers {machine['transformers']}): "
        f"Qwen3-MoE {model['parameters'] / 1e6:.1f}M parameters ({model['expert_parameters'] / 1e6:.1f}M in experts), "
        f"{model['layers']} layers x {model['experts']} experts, top-{model['top_k']}; "
        f"{model['runtime_tensors']} run-time tensors, {model['checkpoint_tensors']} checkpoint tensors; "
        f"{len(results['steps'])} steps, {100 * summary['changed_fraction']:.2f}% of elements changed per step"
    )
    print(f"run-time reference: {results['reference']}")
    print()

    def kb(value: float) -> str:
        return f"{value / 1024:,.1f} KB"

    def ms(value: float) -> str:
        return f"{1e3 * value:.2f} ms"

    lines = [
        "| per publish step | raw: checkpoint | raw: run-time | raw: ratio "
        "| compact: checkpoint | compact: run-time | compact: ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [
        ("delta file (mean)", "file", kb, "file_ratio"),
        ("tensor payload (mean)", "payload", kb, "payload_ratio"),
        ("header and metadata (mean)", "header", kb, "header_ratio"),
        ("tensors in the delta (mean)", "tensors", "{:.0f}".format, "tensors_ratio"),
        ("whole publish, background=False (best)", "synchronous_seconds", ms, "synchronous_ratio"),
        ("worker: convert + encode + write (best)", "worker_seconds", ms, "worker_ratio"),
    ]
    for label, key, fmt, ratio in rows:
        cells = []
        for encoding in ENCODINGS:
            per = summary[encoding]
            cells += [fmt(per["checkpoint"][key]), fmt(per["runtime"][key]), f"{per[ratio]:.3f}x"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    thread = summary["training_thread"]
    print()
    print(
        "training thread per publish (background=True: detection and the hand-off, the same work for both "
        f"encodings), best of {thread['calls']} calls: checkpoint layout {ms(thread['checkpoint'])}, run-time "
        f"layout {ms(thread['runtime'])}: {thread['ratio']:.3f}x (medians {ms(thread['checkpoint_median'])} and "
        f"{ms(thread['runtime_median'])})"
    )
    experts = summary["experts"]
    print()
    print(
        "| experts (all layers) | changed fraction per step: min / median / max | unchanged per step "
        "| routed no token per step | of those, changed anyway | unchanged in every step |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| {experts['experts']} | {experts['min']:.4f} / {experts['median']:.4f} / {experts['max']:.4f} "
        f"| {experts['unchanged_per_step']:.1f} | {experts['unrouted_per_step']:.1f} "
        f"| {experts['unrouted_but_changed_per_step']:.1f} | {experts['never_changed']} |"
    )
    print()
    print(
        f"conversion alone (CheckpointLayout.map_changes, on the worker thread): {ms(summary['map_changes_seconds'])} "
        f"per step, {summary['map_changes_x_training_thread']:.3f}x the training thread's part; "
        f"CheckpointLayout.of once, when the detector is made: {ms(results['layout_of_seconds'])}"
    )
    for encoding in ENCODINGS:
        if not all(summary[encoding][kind]["payload_matches_direct_encoding"] for kind in LAYOUTS):
            print(f"WARNING: {encoding}: a published payload differs from the encoders applied to the ChangeSet")
    print()
    for target in summary["targets"]:
        verdict = "met" if target["met"] else "MISSED"
        print(f"target: {target['name']} <= {target['limit']:.2f}: {target['value']:.3f} ({verdict})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (2 layers x 16 experts, top-2), 2 steps")
    parser.add_argument(
        "--real-experts",
        action="store_true",
        help="experts of Qwen3-30B-A3B's shape (hidden 2048, expert intermediate 768): 2 layers x 16 experts, top-4",
    )
    add_options(parser, OPTIONS, "models")
    args = parser.parse_args(argv)
    fill_options(args, OPTIONS, REAL_EXPERTS if args.real_experts else {})
    if args.steps < 1 or not 1 <= args.top_k <= args.experts or args.hidden % args.heads:
        parser.error("need --steps >= 1, 1 <= --top-k <= --experts, and --hidden a multiple of --heads")
    reference = (
        "run-time layout published by the same Publisher over a detector whose checkpoint layout is "
        "replaced by CheckpointLayout.identity_of (delta-sync has no switch for it); its payload is "
        "checked against the encoders applied to the detector's run-time ChangeSet directly"
    )
    return measure(args, "models", reference, run, summarize, print_tables)


def add_options(parser: argparse.ArgumentParser, options: dict[str, tuple[type, Any, Any, str]], name: str) -> None:
    """`--name` for each of `options` (name -> type, default, default with --quick, meaning),
    and `--out` (default `benchmarks/results/{name}`)."""
    for option, (kind, default, quick, text) in options.items():
        also = "" if quick == default else f"; {quick} with --quick"
        parser.add_argument(f"--{option.replace('_', '-')}", type=kind, help=f"{text} (default {default}{also})")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / name), help="directory of results.json"
    )


def fill_options(
    args: argparse.Namespace, options: dict[str, tuple[type, Any, Any, str]], preset: dict[str, Any]
) -> None:
    """The options not given: from `preset`, else their default (with `--quick`, its own)."""
    for name, (_, default, quick, _) in options.items():
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, quick if args.quick else default))


def cpu_machine() -> dict[str, Any]:
    """The machine the figures come from."""
    return {
        "device": "cpu",
        "cpus": len(os.sched_getaffinity(0)),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def measure(
    args: argparse.Namespace,
    name: str,
    reference: str,
    run: Callable[[argparse.Namespace, Path], dict[str, Any]],
    summarize: Callable[[dict[str, Any]], dict[str, Any]],
    print_tables: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """`run` in a scratch directory, then its summary and tables; writes `args.out`/results.json."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        results: dict[str, Any] = {"args": vars(args), "machine": cpu_machine(), "reference": reference}
        results |= run(args, Path(tmp))
    results["summary"] = summarize(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print_tables(results)
    print(f"wrote {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
