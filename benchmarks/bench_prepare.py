"""What preparing versions in the background costs a thread that generates, without vLLM.

A stand-in for a vLLM worker on the CPU backend: one thread, bound to one core, runs short
torch calls back to back (each drops the interpreter lock and takes it back, as the
engine loop's do), and times each round of them. On another core, a `Receiver` over a
node snapshot prepares deltas as the worker's prefetch thread does (`Receiver.prefetch`:
download, verify, apply to the snapshot, write the undo record). The versions come from
real AdamW steps (lr 3e-6) on fp32 master weights of a random-init Qwen3 (the model of
`bench_pause.py`), published as bf16 by the real `Publisher`.

The reference is the same thread's rounds in a quiet window of the same run: the figures
are the rounds while preparing against the quiet median (`longest_x_quiet`), and the time
the thread lost (`lost_seconds`: the rounds' total less as many quiet medians). The lock
is what the two threads share here; `bench_pause.py` measures the real server.

    python benchmarks/bench_prepare.py --out benchmarks/results/prepare
    python benchmarks/bench_prepare.py --quick --out benchmarks/results/prepare-quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_pause import Settings, Trainer, build_model, layers_for  # noqa: E402

from delta_sync.replica.compiled import load_compiled_passes  # noqa: E402
from delta_sync.replica.receiver import Receiver  # noqa: E402
from delta_sync.replica.shared import NodeStore  # noqa: E402


class Generator:
    """The stand-in engine loop: rounds of `calls` small matmuls on `cpu`, each round timed."""

    def __init__(self, cpu: int, calls: int = 40) -> None:
        self.cpu, self.calls = cpu, calls
        self.rounds: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generator", daemon=True)

    def _run(self) -> None:
        os.sched_setaffinity(0, {self.cpu})
        a = torch.randn(64, 64)
        while not self._stop.is_set():
            start = time.perf_counter()
            for _ in range(self.calls):
                a = torch.tanh(a @ a)
            self.rounds.append((start, time.perf_counter()))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[float]:
        return [e - s for s, e in self.rounds if s >= start and e <= end]


def measure(settings: Settings, deltas: int, workdir: Path) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs: one for the generating thread, one for the prefetch")
    torch.set_num_threads(1)
    layers = layers_for(settings.params, hidden=settings.hidden, vocab=settings.vocab, heads=settings.heads)
    params = build_model(
        workdir / "model",
        hidden=settings.hidden,
        layers=layers,
        vocab=settings.vocab,
        heads=settings.heads,
        max_len=512,
    )
    trainer = Trainer(workdir / "model", workdir / "bucket", lr=settings.lr, anchor_every=deltas + 1)
    trainer.publish()
    shapes = {name: tuple(p.shape) for name, p in trainer.model.named_parameters()}
    receiver = Receiver(store=NodeStore(workdir / "snapshots"), expected_shapes=shapes)
    load_compiled_passes()  # as the engine does when it starts
    receiver.prefetch(trainer.bucket)  # the anchor
    generator = Generator(cpus[0])
    generator.start()
    os.sched_setaffinity(0, set(cpus[1:]))
    updates = []
    try:
        for _ in range(deltas):
            trainer.step()  # on the prefetch's cores: the rounds meanwhile are not counted
            time.sleep(0.5)  # settle: the quiet window is the half second before preparing
            start = time.perf_counter()
            prepared = receiver.prefetch(trainer.bucket)
            end = time.perf_counter()
            quiet = generator.between(start - 0.5, start)
            during = generator.between(start, end)
            updates.append(
                {
                    "version": trainer.version,
                    "prepared_version": prepared,
                    "prepare_seconds": end - start,
                    "quiet": quiet,
                    "during": during,
                }
            )
    finally:
        generator.stop()
        trainer.close()
    quiet_median = statistics.median(r for u in updates for r in u["quiet"])
    for update in updates:
        during = update.pop("during")
        update.pop("quiet")
        update["rounds"] = len(during)
        update["longest_seconds"] = max(during, default=0.0)
        update["longest_x_quiet"] = update["longest_seconds"] / quiet_median
        update["lost_seconds"] = max(0.0, sum(during) - len(during) * quiet_median)
    return {
        "model": {"parameters": params, "hidden": settings.hidden, "layers": layers, "vocab": settings.vocab},
        "versions_from": f"real AdamW steps, lr {settings.lr:g}, on fp32 master weights (bf16 published)",
        "generator": {"cpu": cpus[0], "calls_per_round": generator.calls, "quiet_median_seconds": quiet_median},
        "prefetch_cpus": cpus[1:],
        "updates": updates,
        "summary": {
            "longest_x_quiet": max(u["longest_x_quiet"] for u in updates),
            "lost_seconds_per_update": statistics.median(u["lost_seconds"] for u in updates),
            "prepare_seconds_per_update": statistics.median(u["prepare_seconds"] for u in updates),
        },
    }


def print_table(results: dict[str, Any]) -> None:
    model = results["model"]
    quiet = results["generator"]["quiet_median_seconds"]
    print(
        f"model: Qwen3, {model['parameters'] / 1e6:.1f}M parameters; {results['versions_from']}; "
        f"quiet round {quiet * 1e3:.2f} ms"
    )
    print("| version | prepare s | rounds | longest round ms (x quiet) | lost ms |")
    print("| --- | --- | --- | --- | --- |")
    for u in results["updates"]:
        print(
            f"| {u['version']} | {u['prepare_seconds']:.3f} | {u['rounds']} | "
            f"{u['longest_seconds'] * 1e3:.1f} ({u['longest_x_quiet']:.1f}x) | {u['lost_seconds'] * 1e3:.0f} |"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deltas", type=int, default=6, help="deltas prepared, one at a time")
    parser.add_argument("--quick", action="store_true", help="a ~1M model and 2 deltas: a smoke run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "prepare"), help="output directory")
    args = parser.parse_args(argv)
    settings = Settings(params=1e6, hidden=128, vocab=1024, heads=2) if args.quick else Settings()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
        results = measure(settings, 2 if args.quick else args.deltas, Path(scratch))
    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
