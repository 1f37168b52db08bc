"""The replica's download cache: one download per machine, complete files only, pruned as it goes."""

from __future__ import annotations

import subprocess
import sys

from delta_sync import Receiver
from delta_sync.layout import anchor_path, parse_step_path
from delta_sync.storage.cache import DownloadCache

from two_tower import PublishedRun

FETCH = """
import sys
from delta_sync.storage import open_bucket
from delta_sync.storage.cache import DownloadCache
print(DownloadCache(sys.argv[1]).fetch(open_bucket(sys.argv[2]), sys.argv[3]))
"""


def test_processes_on_one_machine_download_a_file_once(hf_target, tmp_path):
    run = PublishedRun(hf_target.url, versions=2)
    run.close()
    cache = tmp_path / "node-cache"
    mark = len(hf_target.hub.requests)
    # Like the workers of one vLLM server: separate processes, one cache directory, at once.
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", FETCH, str(cache), hf_target.url, anchor_path(1)],
            env=hf_target.subprocess_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    paths = {worker.communicate(timeout=300)[0].strip() for worker in workers}
    assert all(worker.returncode == 0 for worker in workers)
    assert len(paths) == 1
    resolves = [r for r in hf_target.hub.requests_since(mark) if "/resolve/" in r.path and r.method == "HEAD"]
    assert len(resolves) == 1, [r.path for r in hf_target.hub.requests_since(mark)]
    assert not list(cache.rglob("*.tmp"))


def test_replica_prunes_downloads_it_can_no_longer_use(hf_target, tmp_path):
    run = PublishedRun(hf_target.url, versions=2, anchor_every=3, keep_anchors=5)
    cache = DownloadCache(tmp_path / "cache")
    receiver = Receiver(cache=cache)
    assert receiver.update(hf_target.url).version == 2
    for _ in range(6):
        version = run.step()
        assert receiver.update(hf_target.url, f"deltas/step_{version:08d}.safetensors").version == version
    run.close()
    # <bucket>/<run and start namespace>/<path in the bucket>
    cached = [
        f.relative_to(tmp_path / "cache").as_posix().split("/", 2)[2]
        for f in (tmp_path / "cache").rglob("*.safetensors")
    ]
    steps = sorted(parse_step_path(path) for path in cached)
    # The replica holds version 8, descended from anchor 7 (which it never needed to download):
    # anchor 1 and deltas 2-6 are gone, only the last two deltas remain.
    assert steps == [("delta", 7), ("delta", 8)], steps
