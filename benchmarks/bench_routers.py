"""What float32 routers add to a delta: DeepSeek-V3's mixture of experts at its real sizes.

transformers keeps a DeepSeek-V3 (Kimi K2, GLM-4.5, ...) router in float32 when it loads the
model in bf16 (`_keep_in_fp32_modules_strict`: `gate.weight` of shape `[experts, hidden]` and
`e_score_correction_bias`), and delta-sync publishes those tensors in float32, unrounded:
int32 indices and float32 values in every delta (raw entries in a compact file too). AdamW
changes nearly every float32 element of a router each step, where it moves only the few
bf16 elements that cross a rounding boundary. This benchmark measures what that costs in
bytes against the same model with its routers published through their bf16 rounding (as
delta-sync did before it carried float32).

Model: a random-init `DeepseekV3ForCausalLM` whose mixture of experts has DeepSeek-V3's real
sizes (hidden 7168, each expert's intermediate 2048, one shared expert, a router of
`[experts, 7168]` float32 with its score correction bias) but few experts (default 4, two per
token) and one layer: the router's share of a delta does not depend on the number of
experts (each expert adds 7168 router elements beside its 3 x 7168 x 2048). Attention and
the vocabulary are tiny, so the figures are those of a delta of MoE layers alone: a whole
model's delta also carries attention and embeddings, which only lowers the router's share.
fp32 master weights, real AdamW steps at an RL learning rate (default 3e-6) on a causal-LM
loss of random tokens.

Two publishers per encoding follow the model, `background=False`, deltas only after a first
anchor: one as a trainer runs it (routers in float32), and the reference, the same
`Publisher` over a detector built as if the model kept nothing in float32 (delta-sync has no
switch for it: the benchmark replaces the detector's lookup of what the model keeps in
float32 by an empty one), so that its routers are compared and published in bf16.

Reported per encoding (means over the steps): the delta file's bytes with float32 and with
bf16 routers and their ratio, the router entries' bytes in the float32 file and their share
of it, and the fraction of router elements changed per step in each dtype.

Target (a ratio measured in the same run): the compact delta with float32 routers at most
1.05x the one with bf16 routers. Every figure is measured on the CPU.

    python benchmarks/bench_routers.py                  # DeepSeek-V3's expert and router sizes, 4 experts, 3 steps
    python benchmarks/bench_routers.py --quick --out D  # a tiny model, 2 steps (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import transformers
from bench_models import TRAINING_OPTIONS, add_options, fill_options, measure

from delta_sync import BF16ChangeDetector, Publisher
from delta_sync.trainer import detector as detector_module

ENCODINGS = ("raw", "compact")
ROUTERS = ("float32", "bf16")
#: Target: the compact delta with float32 routers / with bf16 routers.
BYTES_LIMIT = 1.05
#: Command-line options: name -> (type, default, default with --quick, meaning).
OPTIONS: dict[str, tuple[type, Any, Any, str]] = {
    "experts": (int, 4, 4, "routed experts (the router's share does not depend on it)"),
    "top_k": (int, 2, 2, "experts per token"),
    "hidden": (int, 7168, 256, "hidden size (DeepSeek-V3's: 7168)"),
    "moe_intermediate": (int, 2048, 64, "each expert's intermediate size (DeepSeek-V3's: 2048)"),
    "steps": (int, 3, 2, "AdamW steps, one delta each"),
    **TRAINING_OPTIONS,
}


def build_model(args: argparse.Namespace) -> transformers.DeepseekV3ForCausalLM:
    config = transformers.DeepseekV3Config(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=2 * args.moe_intermediate,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=1,
        first_k_dense_replace=0,  # the one layer is a mixture of experts
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=max(64, args.seq),
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = transformers.DeepseekV3ForCausalLM(config)  # fp32: the optimizer's master weights
    with torch.no_grad():  # a trained score correction bias: non-zero, off the bf16 grid
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 1e-3)
    return model


def train_step(model, optimizer, args: argparse.Namespace, seed: int) -> None:
    tokens = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bf16_router_detector(model, optimizer) -> BF16ChangeDetector:
    """The reference: a detector that finds nothing the model keeps in float32."""
    with mock.patch.object(detector_module, "kept_in_float32", lambda model, names: set()):
        return BF16ChangeDetector(model, optimizer)


def entry_bytes(path: Path) -> dict[str, int]:
    """Bytes of each entry of a safetensors file, by name."""
    with path.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    return {
        name: end - start
        for name, entry in header.items()
        if name != "__metadata__"
        for start, end in [entry["data_offsets"]]
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    quiet = {"anchor_every": 10**9, "anchor_bytes_ratio": None, "background": False, "pointer_refresh": None}
    publishers = {}
    for encoding in ENCODINGS:
        for routers in ROUTERS:
            detector = (
                BF16ChangeDetector(model, optimizer) if routers == "float32" else bf16_router_detector(model, optimizer)
            )
            publishers[encoding, routers] = Publisher(
                workdir / f"{encoding}-{routers}", detector, encoding=encoding, **quiet
            )
    float32 = publishers["raw", "float32"].detector.float32
    if not float32 or publishers["raw", "bf16"].detector.float32:
        raise RuntimeError(f"expected float32 routers on one side only, found {sorted(float32)}")
    router_elements = sum(model.get_parameter(name).numel() for name in float32 if name.endswith("gate.weight"))
    rows = []
    try:
        for publisher in publishers.values():
            publisher.publish(1)  # the anchor of the initial weights
        for step in range(1, args.steps + 1):
            train_step(model, optimizer, args, seed=args.seed * 1000 + step)
            version = step + 1
            row: dict[str, Any] = {"version": version}
            for (encoding, routers), publisher in publishers.items():
                publisher.publish(version)
                report = publisher.reports[-1]
                if report.delta is None or report.anchor is not None:
                    raise RuntimeError(f"version {version} was published as {report.kind}, not a delta alone")
                entries = entry_bytes(publisher.bucket.root / report.delta)
                in_routers = {name: size for name, size in entries.items() if name.rsplit(".", 1)[0] in float32}
                row.setdefault(encoding, {})[routers] = {
                    "file": (publisher.bucket.root / report.delta).stat().st_size,
                    # Coded among the bf16 tensors' streams in a compact file with bf16 routers.
                    "router_entries": sum(in_routers.values()) if in_routers or routers == "float32" else None,
                    "changed_elements": report.changed_elements,
                }
                if encoding == "raw":  # int32 positions: the router elements changed this step
                    weights = {name: size for name, size in in_routers.items() if name.endswith("gate.weight.indices")}
                    row.setdefault("router_changed_fraction", {})[routers] = sum(weights.values()) / 4 / router_elements
            rows.append(row)
    finally:
        for publisher in publishers.values():
            publisher.close()
            publisher.detector.close()
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "model": {
            "parameters": parameters,
            "router_elements": router_elements,
            "float32_tensors": sorted(float32),
            "experts": args.experts,
            "hidden": args.hidden,
            "moe_intermediate": args.moe_intermediate,
        },
        "steps": rows,
    }


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    steps = results["steps"]
    summary: dict[str, Any] = {}
    for encoding in ENCODINGS:
        float32 = statistics.mean(row[encoding]["float32"]["file"] for row in steps)
        bf16 = statistics.mean(row[encoding]["bf16"]["file"] for row in steps)
        routers = statistics.mean(row[encoding]["float32"]["router_entries"] for row in steps)
        summary[encoding] = {
            "file_float32_routers": float32,
            "file_bf16_routers": bf16,
            "ratio": float32 / bf16,
            "router_entries": routers,
            "router_share": routers / float32,
        }
    summary["router_changed_fraction"] = {
        routers: statistics.mean(row["router_changed_fraction"][routers] for row in steps) for routers in ROUTERS
    }
    ratio = summary["compact"]["ratio"]
    summary["targets"] = [
        {
            "name": "compact delta, float32 / bf16 routers",
            "limit": BYTES_LIMIT,
            "value": ratio,
            "met": ratio <= BYTES_LIMIT,
        }
    ]
    return summary


def print_tables(results: dict[str, Any]) -> None:
    model, summary, machine = results["model"], results["summary"], results["machine"]
    print()
    print(
        f"CPU figures ({machine['cpus']} cores, torch {machine['torch']}, transformers {machine['transformers']}): "
        f"DeepSeek-V3 mixture of experts, hidden {model['hidden']}, expert intermediate {model['moe_intermediate']}, "
        f"{model['experts']} routed experts + 1 shared, {model['parameters'] / 1e6:.1f}M parameters; router "
        f"{model['router_elements']:,} float32 elements; {len(results['steps'])} steps"
    )
    fractions = summary["router_changed_fraction"]
    print(
        f"router weight elements changed per step: {100 * fractions['float32']:.1f}% in float32 bits, "
        f"{100 * fractions['bf16']:.1f}% in bf16 bits"
    )
    print()

    def kb(value: float) -> str:
        return f"{value / 1024:,.1f} KB"

    print("| per delta (mean) | float32 routers | bf16 routers | ratio | router entries | router share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for encoding in ENCODINGS:
        row = summary[encoding]
        print(
            f"| {encoding} | {kb(row['file_float32_routers'])} | {kb(row['file_bf16_routers'])} | {row['ratio']:.3f}x "
            f"| {kb(row['router_entries'])} | {100 * row['router_share']:.2f}% |"
        )
    print()
    for target in summary["targets"]:
        verdict = "met" if target["met"] else "MISSED"
        print(f"target: {target['name']} <= {target['limit']:.2f}: {target['value']:.3f} ({verdict})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (hidden 256), 2 steps")
    add_options(parser, OPTIONS, "routers")
    args = parser.parse_args(argv)
    fill_options(args, OPTIONS, {})
    if args.steps < 1 or not 1 <= args.top_k <= args.experts:
        parser.error("need --steps >= 1 and 1 <= --top-k <= --experts")
    reference = (
        "the same model published by the same Publisher over a detector that finds nothing the model "
        "keeps in float32 (its lookup replaced by an empty one), so that the routers travel as bf16"
    )
    return measure(args, "routers", reference, run, summarize, print_tables)


if __name__ == "__main__":
    main()
