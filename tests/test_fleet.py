"""A rollout fleet for real: a tensor-parallel `vllm serve` holding one snapshot for its two
workers, and three servers on one machine following one bucket (pushed, joining late,
killed and restarted, following on their own), all converging bit-exactly."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from delta_sync import Receiver
from delta_sync.layout import LATEST, Latest
from delta_sync.trainer.replicas import ReplicaSet

from helpers import stop_process, wait_for
from vllm_server import (
    EMPTY_SHA256,
    PROMPT,
    SERVER_POLL_SECONDS,
    TinyTrainer,
    VLLMServer,
    greedy,
    run_example,
    serving,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

#: How long the trainer waits for replicas after each version (the callback's `sync_timeout`).
SYNC_TIMEOUT = 30.0


def snapshot_dirs(cache: Path) -> list[Path]:
    return sorted(path for path in (cache / "snapshots").iterdir() if path.is_dir())


def shard_digests(tensor: torch.Tensor, rank: int, ranks: int) -> set[str]:
    """SHA-256 of what a tensor-parallel rank may hold of a float32 tensor: all of it
    (replicated) or its slice along either dimension (column-, row-, vocab-parallel)."""
    candidates = [tensor] + [
        chunk[rank] for dim in range(tensor.dim()) if len(chunk := tensor.chunk(ranks, dim)) == ranks
    ]
    return {hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest() for t in candidates}


@pytest.fixture
def tp_server(served_model, bucket_root, tmp_path_factory):
    with serving(
        served_model,
        tmp_path_factory.mktemp("vllm-tp2"),
        allowed_buckets=bucket_root.as_uri(),
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        extra_args=["--tensor-parallel-size", "2"],
    ) as server:
        yield server


def test_a_tensor_parallel_server_follows_grpo_with_one_snapshot(tp_server, bucket_root):
    bucket = bucket_root / "tp2-grpo"
    output = run_example(tp_server, bucket, "--steps", "4", "--anchor-every", "3")
    # The example checks after every version that both workers serve the trainer's checksum.
    assert re.search(r"vLLM server checks\s+4\n", output), output[-3000:]
    assert re.search(r"vLLM server bit-exact\s+yes", output), output[-3000:]

    latest = Latest.from_json((bucket / LATEST).read_bytes())
    statuses = tp_server.rpc("delta_sync_status")
    assert len(statuses) == 2
    assert all((s["version"], s["model_checksum"]) == (4, latest.model_checksum) for s in statuses)

    # vLLM's own digests of each worker's shard equal the published weights' shards.
    published = Receiver()
    published.update(bucket)
    matched: dict[int, set[str]] = {0: set(), 1: set()}
    for key, digest in tp_server.raw_weight_checksums().items():
        rank, name = int(re.search(r"tp(\d+):", key).group(1)), key.rsplit(":", 1)[-1]
        if digest == EMPTY_SHA256 or name not in published.weights:
            continue  # linear layers the CPU backend repacks, and fused vLLM-only names
        assert digest in shard_digests(published.weights[name].float(), rank, 2), f"{key} differs"
        matched[rank].add(name)
    for names in matched.values():
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    # Each worker wrote the deltas' changed elements of its slices in place.
    log = tp_server.log_tail(10**9)
    in_place = re.findall(r"\((\S+ pid=\d+)\)[^\n]* wrote [1-9]\d* tensor\(s\) in place", log)
    assert len(set(in_place)) == 2, log[-3000:]

    # Both workers map the one node snapshot; neither holds a copy of any page of it, and
    # their proportional shares add up to one copy.
    memory = tp_server.rpc("delta_sync_snapshot")
    print(f"TP=2 snapshot memory per worker: {memory}")  # shown with -s: docs/vllm.md quotes it
    assert len({m["shared_path"] for m in memory}) == 1
    assert all(m["private_bytes"] == 0 for m in memory), memory
    assert all(m["resident_bytes"] > 0 for m in memory), memory
    assert sum(m["proportional_bytes"] for m in memory) <= 1.01 * memory[0]["shared_bytes"], memory
    (directory,) = snapshot_dirs(tp_server.cache_dir)
    model_bytes = sum(t.numel() * 2 for t in published.weights.values())
    assert Path(memory[0]["shared_path"]).parent == directory
    assert (directory / "weights.bin").stat().st_size == memory[0]["shared_bytes"]
    assert model_bytes <= memory[0]["shared_bytes"] <= model_bytes + 64 * len(published.weights)


@pytest.mark.timeout(2400)  # four server starts, one of them a restart
def test_a_fleet_converges_with_a_late_joiner_a_restart_and_a_follower(served_model, bucket_root, tmp_path):
    cache = tmp_path / "node-cache"  # one machine: the servers share the download cache and snapshot

    def server(name: str) -> VLLMServer:
        return VLLMServer(
            served_model,
            allowed_buckets=bucket_root.as_uri(),
            log_path=tmp_path / f"{name}.log",
            cache_dir=cache,
        )

    pushed, late, follower_server = server("pushed"), server("late"), server("follower")
    trainer = TinyTrainer(served_model, bucket_root / "fleet")
    replicas = ReplicaSet([pushed.url, late.url], trainer.bucket, retry_seconds=1.0, timeout=120)
    log = tmp_path / "follow.log"
    follower = None
    try:
        for process in (pushed.launch(), follower_server.launch()):
            process.wait_healthy()
        command = [sys.executable, "-m", "delta_sync.cli", "follow", trainer.bucket]
        # Polls every 2 s: see SERVER_POLL_SECONDS.
        with open(log, "wb") as out:
            follower = subprocess.Popen(
                [*command, "--vllm-url", follower_server.url, "--interval", "2"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def publish_and_wait(expect_behind: set[str]) -> None:
            version = trainer.step()
            report = trainer.publisher.reports[-1]
            replicas.announce(version, report.delta, report.model_checksum)
            started = time.monotonic()
            behind = replicas.wait(version, timeout=SYNC_TIMEOUT)
            assert time.monotonic() - started < SYNC_TIMEOUT + 5  # never waits on the dead past the timeout
            assert {state.url for state in behind} == expect_behind, [(s.url, s.error) for s in behind]
            live = [s for s in (pushed, late) if s.url not in expect_behind] + [follower_server]
            for replica in live:
                wait_for(
                    lambda r=replica: r.status()["model_checksum"] == trainer.checksum(),
                    f"{replica.url} to serve v{version}",
                    timeout=300.0,
                    interval=SERVER_POLL_SECONDS,
                )

        publish_and_wait({late.url})  # v1: the late joiner is not up yet
        publish_and_wait({late.url})  # v2
        late.start()
        publish_and_wait(set())  # v3: it catches up by itself
        pushed.kill()
        publish_and_wait({pushed.url})  # v4: killed; the others go on
        publish_and_wait({pushed.url})  # v5
        pushed.start()  # restarted on its port: the next version brings it back
        publish_and_wait(set())  # v6

        reference = greedy(trainer.reference(), PROMPT)
        for replica in (pushed, late, follower_server):
            statuses = replica.rpc("delta_sync_status")
            assert all(s["version"] == 6 and s["model_checksum"] == trainer.checksum() for s in statuses)
            assert replica.greedy(PROMPT) == reference
        # Three servers, one machine: one snapshot.
        (directory,) = snapshot_dirs(cache)
        paths = {m["shared_path"] for r in (pushed, late, follower_server) for m in r.rpc("delta_sync_snapshot")}
        assert paths == {str(directory / "weights.bin")}
    finally:
        if follower is not None:
            stop_process(follower, 60)
        replicas.close()
        trainer.close()
        for replica in (pushed, late, follower_server):
            replica.stop()
    assert "Traceback" not in log.read_text()
