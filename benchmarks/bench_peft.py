"""LoRA training, published two ways: merged mode against adapter mode.

For each model shape: a random-init Qwen3 checkpoint (bf16) and a small tokenizer are
built; a transformers copy of it (fp32 master weights) gets a peft LoRA adapter
(`--rank`, on q_proj and v_proj) and takes real AdamW steps (`--lr`); after every step
the same model is published three ways:

* merged mode, raw encoding (the real `Publisher` over a `BF16ChangeDetector`, which
  merges the adapter as `peft`'s `merge_and_unload()` would), to a bucket the server follows;
* merged mode, compact encoding (bytes only);
* adapter mode (`AdapterPublisher`: `adapter_model.safetensors` + `adapter_config.json`
  per version), to a bucket the server loads through `/v1/load_lora_adapter`.

With the vLLM server (the default; `--no-vllm` measures bytes and trainer time only), one
real `vllm serve --enable-lora` from `.venv-vllm` serves the base checkpoint, and the
trainer's real client drives each version to it: merged mode with `Replica.update` (hint,
prepare, start / update / finish, paused), adapter mode with `Replica.load_adapter`
(fetch and check on every worker, then vLLM's in-place load). The seconds are the
client's, from the first request to the answer of the last. The generation cost of the
adapter at the replica is measured too: the seconds of a 64-token greedy completion
through the base model's name and through the adapter's (median of 3).

Per shape the table shows, averaged over the versions after the first: bytes per version
(the merged delta, raw and compact, against the adapter's two files), what a replica
joining late downloads (the merged anchor, against one adapter version), the trainer's
seconds per version (the training thread's and the writer's), and the replica's update
seconds. JSON goes to `DIR/results.json`.

    python benchmarks/bench_peft.py --out benchmarks/results/peft
    python benchmarks/bench_peft.py --quick --out benchmarks/results/peft-quick   # the tiny shape, 2 steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pause import PROMPT, Server, build_model  # noqa: E402

from delta_sync import BF16ChangeDetector, Publisher  # noqa: E402
from delta_sync.control.client import Replica  # noqa: E402
from delta_sync.trainer.adapter import AdapterPublisher  # noqa: E402
from delta_sync.trainer.publisher import PublisherOptions  # noqa: E402

#: Model shapes: name -> (hidden size, decoder layers, vocabulary, attention heads).
SHAPES = {"tiny": (128, 2, 512, 4), "30M": (512, 8, 4096, 8)}
ADAPTER_NAME = "policy"


def lora_trainer(model_dir: Path, rank: int, lr: float):
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    return model, optimizer


def train_step(model, optimizer, vocab: int, seed: int) -> None:
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def completion_seconds(url: str, model: str) -> float:
    """Seconds of one 64-token greedy completion naming `model` (median of 3)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        response = httpx.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True},
            timeout=300,
        )
        response.raise_for_status()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_shape(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    hidden, layers, vocab, heads = SHAPES[name]
    model_dir = workdir / "model"
    params = build_model(model_dir, hidden=hidden, layers=layers, vocab=vocab, heads=heads, max_len=512)
    model, optimizer = lora_trainer(model_dir, args.rank, args.lr)
    buckets = workdir / "buckets"
    merged_detector = BF16ChangeDetector(model, optimizer)
    compact_detector = BF16ChangeDetector(model, optimizer)
    quiet = {"anchor_every": 10**6, "anchor_bytes_ratio": None, "background": False}
    merged = Publisher(buckets / "merged", merged_detector, **quiet)
    compact = Publisher(buckets / "compact", compact_detector, encoding="compact", **quiet)
    adapter = AdapterPublisher(buckets / "adapter", model, PublisherOptions(background=False))
    server = replica = None
    rows: list[dict[str, Any]] = []
    stack = contextlib.ExitStack()
    try:
        if not args.no_vllm:
            server = Server(
                Path(args.vllm_python),
                model_dir,
                buckets.as_uri(),
                workdir,
                device="cpu",
                dtype="bfloat16",
                max_len=512,
            )
            server.args += ["--enable-lora", "--max-lora-rank", str(args.rank), "--gpu-memory-utilization", "0.5"]
            server.env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", DELTA_SYNC_PREFETCH="2")
            stack.enter_context(server.running(timeout=900))
            replica = Replica(server.url)
        for version in range(1, args.steps + 1):
            if version > 1:
                train_step(model, optimizer, vocab, seed=version)
            row: dict[str, Any] = {"version": version}
            for label, publisher in (("merged", merged), ("compact", compact), ("adapter", adapter)):
                publisher.publish(version)
                report = publisher.reports[-1]
                row[f"{label}_bytes"] = report.bytes_written
                row[f"{label}_trainer_seconds"] = report.detect_seconds + report.publish_seconds
                row[f"{label}_changed"] = report.changed_elements
            if replica is not None:
                started = time.perf_counter()
                status = replica.update(merged.bucket.url, merged.reports[-1].delta or merged.reports[-1].anchor)
                row["merged_update_seconds"] = time.perf_counter() - started
                assert status.version == version, status
                started = time.perf_counter()
                loaded = replica.load_adapter(adapter.bucket.url, ADAPTER_NAME)
                row["adapter_update_seconds"] = time.perf_counter() - started
                assert loaded.version == version, loaded
            rows.append(row)
            print(f"  {name} v{version}: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "version"))
        generation = None
        if server is not None:
            generation = {
                "base_seconds": completion_seconds(server.url, server.model),
                "adapter_seconds": completion_seconds(server.url, ADAPTER_NAME),
            }
    finally:
        for closing in (merged, compact, adapter):
            closing.close()
        merged_detector.close()
        compact_detector.close()
        if replica is not None:
            replica.close()
        stack.close()
    later = rows[1:] or rows

    def mean(key: str) -> float | None:
        values = [row[key] for row in later if key in row]
        return statistics.mean(values) if values else None

    return {
        "shape": {"hidden": hidden, "layers": layers, "vocab": vocab, "heads": heads, "parameters": params},
        "rank": args.rank,
        "lr": args.lr,
        "adapter_elements": rows[0]["adapter_changed"],
        "versions": rows,
        "merged_anchor_bytes": rows[0]["merged_bytes"],
        "adapter_version_bytes": rows[0]["adapter_bytes"],
        "mean_after_first": {
            key: mean(key)
            for key in (
                "merged_bytes",
                "compact_bytes",
                "adapter_bytes",
                "merged_changed",
                "merged_trainer_seconds",
                "adapter_trainer_seconds",
                "merged_update_seconds",
                "adapter_update_seconds",
            )
        },
        "generation_64_tokens": generation,
    }


def table(results: dict[str, Any]) -> str:
    def fmt(value: float | None, unit: str = "") -> str:
        if value is None:
            return "-"
        if unit == "B":
            return f"{value / 1024:.1f} KB" if value < 1 << 20 else f"{value / (1 << 20):.2f} MB"
        return f"{value * 1000:.0f} ms"

    lines = [
        "| shape | merged delta raw | merged delta compact | adapter version | merged anchor (join) "
        "| trainer merged / adapter | replica update merged / adapter | 64-token greedy base / adapter |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, shape in results["shapes"].items():
        means, generation = shape["mean_after_first"], shape["generation_64_tokens"] or {}
        lines.append(
            f"| {name} ({shape['shape']['parameters'] / 1e6:.1f}M, r={shape['rank']}) "
            f"| {fmt(means['merged_bytes'], 'B')} | {fmt(means['compact_bytes'], 'B')} "
            f"| {fmt(means['adapter_bytes'], 'B')} | {fmt(shape['merged_anchor_bytes'], 'B')} "
            f"| {fmt(means['merged_trainer_seconds'])} / {fmt(means['adapter_trainer_seconds'])} "
            f"| {fmt(means['merged_update_seconds'])} / {fmt(means['adapter_update_seconds'])} "
            f"| {fmt(generation.get('base_seconds'))} / {fmt(generation.get('adapter_seconds'))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "peft"), help="results directory")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "30M"])
    parser.add_argument("--steps", type=int, default=6, help="versions per shape (default 6)")
    parser.add_argument("--rank", type=int, default=16, choices=[8, 16, 32, 64], help="LoRA rank (default 16)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    parser.add_argument("--no-vllm", action="store_true", help="bytes and trainer time only: start no server")
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"), help="vLLM's interpreter")
    parser.add_argument("--quick", action="store_true", help="the tiny shape, 2 versions")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.steps = ["tiny"], 2
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    results: dict[str, Any] = {"args": vars(args), "shapes": {}}
    for name in args.shapes:
        print(f"{name}:")
        with tempfile.TemporaryDirectory(prefix=f"bench-peft-{name}-") as tmp:
            results["shapes"][name] = run_shape(name, args, Path(tmp))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
