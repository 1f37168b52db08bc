"""A real `vllm serve` (CPU) running vllm_ext, driven over HTTP, against a transformers reference.

One server is shared by the whole module (start-up takes about a minute); every test
starts its chain with an anchor, so tests do not depend on each other's weights.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import torch

from delta_sync import Publisher, read_file
from delta_sync.layout import anchor_path, delta_path
from delta_sync.trainer.replicas import ReplicaSet

from helpers import REPO, free_port, stop_process, wait_for
from overflowing_streams import PAST_SLOTS, change_most_of, overflowing_copies
from vllm_server import (
    API_TOKEN,
    EMPTY_SHA256,
    PROMPT,
    SERVER_POLL_SECONDS,
    SIGNING_KEY,
    VLLM_HF_BUCKET,
    TinyTrainer,
    greedy,
    prompt_logprobs,
    run_example,
    unpacked_checksums_match,
    vllm_python,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_anchor_then_deltas_through_http(vllm_server, trainer):
    assert vllm_server.status()["version"] in (None, *range(1, 100))
    for _ in range(4):
        version = trainer.step()
        report = trainer.publisher.reports[-1]
        filename = report.delta or report.anchor
        response = vllm_server.update(trainer.bucket, filename)
        assert response.status_code == 200, response.text
        status = vllm_server.status()
        assert status["version"] == version and status["pending"] == 0
        assert status["model_checksum"] == report.model_checksum == trainer.checksum()
        reference = trainer.reference()
        assert vllm_server.greedy(PROMPT) == greedy(reference, PROMPT)
        matched = unpacked_checksums_match(vllm_server, trainer)
        assert "lm_head.weight" in matched and "model.embed_tokens.weight" in matched
    # Re-sending the version held is a no-op.
    assert vllm_server.update(trainer.bucket, delta_path(4)).status_code == 200
    assert vllm_server.status()["version"] == 4


class TokenStream:
    """A streaming completion read on a thread of its own: when each token arrived."""

    def __init__(self, server, max_tokens: int = 480) -> None:  # within the server's --max-model-len
        self.arrivals: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        body = {
            "model": str(server.model_dir),
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        self._thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self._thread.start()

    def _read(self, server, body: dict) -> None:
        try:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=300
            ) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if self._stop.is_set():
                        return  # closing the response ends the request
                    if line.startswith("data: {"):
                        self.arrivals.append(time.monotonic())
        except BaseException as exc:  # reported by `streamed`
            self.error = exc

    def streamed(self) -> int:
        """Tokens so far; raises what ended the stream early."""
        if self.error is not None:
            raise AssertionError(f"the streaming completion failed: {self.error!r}")
        return len(self.arrivals)

    def between(self, start: float, end: float) -> int:
        return sum(start < arrival < end for arrival in self.arrivals)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


def test_a_hinted_version_is_prepared_while_the_server_keeps_generating(vllm_server, trainer):
    trainer.step()
    assert vllm_server.update(trainer.bucket).status_code == 200
    for _ in range(2):  # deltas only: v4 would be an anchor (anchor_every=3)
        target = trainer.step()
    logged = len(vllm_server.log_tail(10**9))
    stream = TokenStream(vllm_server)
    try:
        wait_for(lambda: stream.streamed() >= 3, "the first streamed tokens")
        hinted = time.monotonic()
        answer = vllm_server.post(
            "/collective_rpc", json={"method": "delta_sync_prefetch", "kwargs": {"bucket": trainer.bucket}}
        )
        assert answer.status_code == 200, answer.text
        (hint,) = answer.json()["results"]
        assert hint["prefetching"] is True
        # vLLM's CPU backend binds the worker's compute threads to some of the cores (here
        # `auto`: all but one): the prefetch thread prepares on the others, where there are any.
        spare = set(os.sched_getaffinity(0)) - set(hint["compute_cpus"])
        assert set(hint["prefetch_cpus"]) == (spare or set(hint["compute_cpus"])), hint
        status = wait_for(
            lambda: (now := vllm_server.status())["prepared_version"] == target and now,
            f"v{target} prepared by the prefetch thread",
        )
        prepared = time.monotonic()
        assert status["version"] == 1  # prepared, not served: the model is untouched
        assert stream.between(hinted, prepared) > 0, "no token streamed while the version was prepared"
    finally:
        stream.close()
    assert vllm_server.update(trainer.bucket, delta_path(target)).status_code == 200
    status = vllm_server.status()
    assert status["version"] == status["prepared_version"] == target
    assert status["model_checksum"] == trainer.checksum()
    assert vllm_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)
    log = vllm_server.log_tail(10**9)[logged:]
    assert f"version {target} is prepared in the node snapshot" in log
    # Embeddings, norms and lm_head are plain tensors on the CPU backend: patched in place.
    assert re.search(r"wrote [1-9]\d* tensor\(s\) in place \([1-9]\d* changed elements\)", log), log[-3000:]


def test_compact_deltas_through_http(vllm_server, served_model, bucket_root):
    """The compact encoding, decoded by the server against the weights it holds."""
    trainer = TinyTrainer(served_model, bucket_root / "compact", encoding="compact")
    try:
        for _ in range(4):
            version = trainer.step()
            report = trainer.publisher.reports[-1]
            if report.delta:
                with read_file(bucket_root / "compact" / report.delta) as delta:
                    assert delta.header.encoding == "compact"
            response = vllm_server.update(trainer.bucket, report.delta or report.anchor)
            assert response.status_code == 200, response.text
            status = vllm_server.status()
            assert status["version"] == version and status["model_checksum"] == trainer.checksum()
        assert vllm_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)
    finally:
        trainer.close()


def test_linear_layers_really_change(vllm_server, trainer):
    trainer.publish()
    assert vllm_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    before = torch.tensor(vllm_server.prompt_logprobs(PROMPT))
    # A large, known edit of linear layers only (packed and repacked by vLLM's CPU backend).
    edited = [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
    ]
    with torch.no_grad():
        for name in edited:
            trainer.model.get_parameter(name).mul_(-3.0)
    trainer.detector.mark_changed(edited)
    trainer.publish()
    assert set(read_file(trainer.publisher.bucket.local_path(delta_path(2))).changes) == set(edited)
    assert vllm_server.update(trainer.bucket, delta_path(2)).status_code == 200
    after = torch.tensor(vllm_server.prompt_logprobs(PROMPT))
    expected = prompt_logprobs(trainer.reference(), PROMPT)
    assert (after - before).abs().max() > 0.1, "the edit did not move the server's output"
    assert (after - expected).abs().max() < 1e-3
    assert vllm_server.status()["model_checksum"] == trainer.checksum()


def test_refusals_leave_the_server_serving_its_weights(vllm_server, trainer, tmp_path_factory):
    for _ in range(3):
        trainer.step()
    assert vllm_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    for version in (2, 3):
        assert vllm_server.update(trainer.bucket, delta_path(version)).status_code == 200
    trainer.step()
    trainer.step()
    root = trainer.publisher.bucket.root
    damaged = bytearray((root / delta_path(4)).read_bytes())
    damaged[-5] ^= 0x10
    (root / "damaged.safetensors").write_bytes(bytes(damaged))
    outside = tmp_path_factory.mktemp("untrusted")
    shutil.copytree(root, outside / "bucket")
    held = vllm_server.status()
    completion = vllm_server.greedy(PROMPT)
    cases = [
        (trainer.bucket, "damaged.safetensors", "payload digest"),
        (trainer.bucket, delta_path(5), "applies on top of version 4, but version 3 is held"),
        ((outside / "bucket").as_uri(), delta_path(4), "allow list"),
        (trainer.bucket, "../" + root.name + "/" + delta_path(4), "must not contain '..'"),
        (trainer.bucket, "deltas/step_00000099.safetensors", "no file"),
    ]
    for bucket, filename, message in cases:
        response = vllm_server.update(bucket, filename)
        assert response.status_code >= 400, (filename, response.text)
        assert message in response.text, response.text
        assert vllm_server.status() == held
        assert vllm_server.greedy(PROMPT) == completion
    # The server is healthy and the genuine file still applies.
    assert vllm_server.update(trainer.bucket, delta_path(4)).status_code == 200
    assert vllm_server.status()["model_checksum"] == read_file(root / delta_path(4)).header.model_checksum


def test_streams_that_once_overflowed_the_decoder_leave_the_server_serving(vllm_server, served_model, bucket_root):
    """A worker decodes compact streams in compiled code: streams that once wrote past its
    buffer (a heap overflow that ends the worker, and vLLM's engine with it) are refused, and
    the server keeps serving its version."""
    trainer = TinyTrainer(served_model, bucket_root / "overflow", encoding="compact")
    try:
        trainer.publish()
        assert vllm_server.update(trainer.bucket, anchor_path(1)).status_code == 200
        anchored = trainer.bf16()
        name = "model.layers.0.mlp.down_proj.weight"
        change_most_of(trainer.model.get_parameter(name))
        trainer.detector.mark_changed([name])
        trainer.publish()
        root = trainer.publisher.bucket.root
        copies = overflowing_copies((root / delta_path(2)).read_bytes(), anchored, count=3)
        assert len(copies) == 3
        held = vllm_server.status()
        completion = vllm_server.greedy(PROMPT)
        for i, (tensor, data) in enumerate(copies):
            (root / f"overflow-{i}.safetensors").write_bytes(data)
            response = vllm_server.update(trainer.bucket, f"overflow-{i}.safetensors")
            assert response.status_code >= 400, response.text
            assert PAST_SLOTS in response.text and tensor in response.text, response.text
            assert vllm_server.status() == held
            assert vllm_server.greedy(PROMPT) == completion
        assert vllm_server.update(trainer.bucket, delta_path(2)).status_code == 200
        assert vllm_server.status()["model_checksum"] == trainer.checksum()
    finally:
        trainer.close()


def test_late_replica_catches_up_from_the_bucket_alone(vllm_server, trainer):
    for _ in range(8):
        trainer.step()  # anchors at 1, 4, 7 (4 and 7 kept), deltas after them
    response = vllm_server.update(trainer.bucket)  # no filename: catch up to latest.json
    assert response.status_code == 200, response.text
    status = vllm_server.status()
    assert status["version"] == 8 and status["anchor_version"] == 7
    assert status["model_checksum"] == trainer.checksum()
    assert vllm_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)


def test_replica_set_updates_live_replicas_and_reports_dead_ones(vllm_server, trainer):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    replicas = ReplicaSet([vllm_server.url, dead], trainer.bucket, retry_seconds=1.0, timeout=60)
    try:
        for _ in range(3):
            version = trainer.step()
            report = trainer.publisher.reports[-1]
            replicas.announce(version, report.delta, report.model_checksum)
            behind = replicas.wait(version, timeout=300)
            assert [state.url for state in behind] == [dead]
            assert "unreachable" in behind[0].error
            live = replicas.states[vllm_server.url]
            assert live.version == version and live.model_checksum == trainer.checksum()
    finally:
        replicas.close()


def test_the_trainer_has_each_version_prepared_before_it_commits(vllm_server, trainer):
    trainer.step()
    assert vllm_server.update(trainer.bucket).status_code == 200
    replicas = ReplicaSet([vllm_server.url], trainer.bucket, timeout=120)
    try:
        for _ in range(2):
            version = trainer.step()
            report = trainer.publisher.reports[-1]
            logged = len(vllm_server.log_tail(10**9))
            replicas.announce(version, report.delta, report.model_checksum)
            assert replicas.wait(version, timeout=300) == []
            # The server's prefetch thread prepared it on the client's hint; the update only loaded it.
            log = vllm_server.log_tail(10**9)[logged:]
            assert f"version {version} is prepared in the node snapshot" in log, log[-3000:]
            assert "inline" not in log, log[-3000:]
            # vLLM names the version it serves: /weight_info, and every completion's metadata.
            assert httpx.get(f"{vllm_server.url}/weight_info", headers=vllm_server.headers).json() == {
                "weight_version": str(version)
            }
        assert vllm_server.status()["model_checksum"] == trainer.checksum()
        assert vllm_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)
    finally:
        replicas.close()


@pytest.mark.parametrize("encoding", ["raw", "compact"])
def test_server_follows_a_bucket_written_by_two_fsdp2_ranks(vllm_server, served_model, bucket_root, encoding):
    from test_distributed import torchrun

    bucket = bucket_root / f"fsdp2-{encoding}"
    args = ["--bucket", str(bucket), "--steps", "3", "--anchor-every", "2", "--model-dir", str(served_model)]
    results = torchrun("fsdp2_publish.py", 2, *args, "--fp32-masters", "--encoding", encoding)
    response = vllm_server.update(bucket.as_uri())  # catch up: anchor parts v1, then delta parts v2, v3
    assert response.status_code == 200, response.text
    status = vllm_server.status()
    assert status["version"] == 3 and status["model_checksum"] == results[0]["checksum"]
    response = vllm_server.update(bucket.as_uri(), "deltas/step_00000003/part_00000.safetensors")
    assert response.status_code != 200 and "manifest" in response.text
    assert vllm_server.status()["model_checksum"] == results[0]["checksum"]


def test_vllm_ext_imports_no_training_stack():
    script = (
        "import sys, vllm_ext; "
        "bad = [m for m in ('trl', 'transformers.trainer', 'datasets', 'delta_sync.trainer.callback') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([str(vllm_python()), "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_grpo_trainer_generates_through_the_server(vllm_server, bucket_root):
    """The main example with --vllm-url: a real GRPOTrainer(use_vllm=True, vllm_mode="server")."""
    completions_before = vllm_server.log_tail(10**9).count("POST /v1/completions")
    output = run_example(vllm_server, bucket_root / "grpo-vllm", "--steps", "6", "--anchor-every", "4")
    assert re.search(r"vLLM server checks\s+6\n", output), output[-3000:]
    assert re.search(r"vLLM server bit-exact\s+yes", output), output[-3000:]
    assert re.search(r"replica bit-exact\s+yes", output), output[-3000:]
    server_log = vllm_server.log_tail(10**9)
    # Every step generated through the server, and TRL never set up its NCCL weight sync.
    assert server_log.count("POST /v1/completions") - completions_before >= 6
    assert "POST /init_weight_transfer_engine" not in server_log
    assert vllm_server.status()["version"] == 6


def test_grpo_trainer_with_bounded_staleness(vllm_server, bucket_root):
    """Asynchronous mode: generation may run one version behind; the server still ends bit-exact."""
    output = run_example(vllm_server, bucket_root / "async", "--steps", "5", "--max-staleness", "1")
    assert re.search(r"vLLM server checks\s+1\n", output), output[-3000:]
    assert re.search(r"vLLM server bit-exact\s+yes", output), output[-3000:]
    assert vllm_server.status()["version"] == 5


def test_server_reads_deltas_from_a_hugging_face_bucket(vllm_server, served_model, hub_server, monkeypatch):
    """The replica side through the real huggingface_hub + hf_xet client (Hub test double)."""
    from bucket_fixtures import HF_TOKEN

    from delta_sync.storage.hf import HFBucket

    monkeypatch.setenv("HF_ENDPOINT", hub_server.endpoint)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    url = f"hf://buckets/{VLLM_HF_BUCKET}"
    HFBucket(url, create=True)
    trainer = TinyTrainer(served_model, url)
    try:
        for _ in range(3):
            trainer.step()
            report = trainer.publisher.reports[-1]
            response = vllm_server.update(url, report.delta or report.anchor)
            assert response.status_code == 200, response.text
            assert vllm_server.status()["model_checksum"] == report.model_checksum == trainer.checksum()
        # The published TRL client names the bucket by id, as `repo_id`.
        trainer.step()
        assert vllm_server.post("/start_weight_update").status_code == 200
        response = vllm_server.post(
            "/update_weights",
            json={"update_info": {"repo_id": VLLM_HF_BUCKET, "filename": trainer.publisher.reports[-1].delta}},
        )
        assert response.status_code == 200, response.text
        assert vllm_server.post("/finish_weight_update").status_code == 200
        assert vllm_server.status()["version"] == 4
        # Catch-up with no filename, across two missed versions.
        trainer.step()
        trainer.step()
        assert vllm_server.update(url).status_code == 200
        status = vllm_server.status()
        assert status["version"] == 6 and status["model_checksum"] == trainer.checksum()
        assert vllm_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)
    finally:
        trainer.close()


def test_trl_client_payloads_drive_the_engine(vllm_server, trainer):
    """TRL's delta clients' `update_info`: accepted when it says what the file is, refused otherwise."""
    trainer.step()
    trainer.step()  # an anchor at version 1, a delta at version 2

    def session(update_info: dict):
        assert vllm_server.post("/start_weight_update").status_code == 200
        response = vllm_server.post("/update_weights", json={"update_info": update_info})
        if response.status_code == 200:
            assert vllm_server.post("/finish_weight_update").status_code == 200
        return response

    # TRL's later branches: start / update with update_kind / finish.
    response = session({"repo_id": trainer.bucket, "filename": anchor_path(1), "update_kind": "dense"})
    assert response.status_code == 200, response.text
    held = vllm_server.status()
    assert held["version"] == 1
    # The announced kind contradicts the file's own metadata: refused, nothing applied.
    response = session({"repo_id": trainer.bucket, "filename": delta_path(2), "update_kind": "dense"})
    assert response.status_code >= 400, response.text
    assert "is a delta, but update_info 'update_kind' is 'dense'" in response.text, response.text
    assert vllm_server.status() == held
    # Keys or values not understood: refused, naming them.
    for extra, message in [({"packed": True}, "unknown key(s) ['packed']"), ({"update_kind": "full"}, "'full'")]:
        response = session({"repo_id": trainer.bucket, "filename": delta_path(2), **extra})
        assert response.status_code >= 400 and message in response.text, response.text
        assert vllm_server.status() == held
    # TRL's first branch POSTs /update_weights without a session: vLLM refuses it before the engine runs.
    info = {"repo_id": trainer.bucket, "filename": delta_path(2), "is_checkpoint_format": True}
    response = vllm_server.post("/update_weights", json={"update_info": info})
    assert response.status_code >= 400 and "start_weight_update" in response.text, response.text
    assert vllm_server.status() == held
    # Its payload inside a session applies.
    response = session(info)
    assert response.status_code == 200, response.text
    status = vllm_server.status()
    assert status["version"] == 2 and status["model_checksum"] == trainer.checksum()


def test_grpo_trainer_from_an_environment_without_vllm(vllm_server, bucket_root):
    """The trainer extra alone (no vLLM installed) runs GRPOTrainer in server mode against the real server."""
    import importlib.util
    import sys

    assert importlib.util.find_spec("vllm") is None, "the test environment must not have vLLM installed"
    bucket = bucket_root / "no-vllm-trainer"
    bucket.mkdir()
    command = [sys.executable, str(REPO / "examples" / "grpo_delta_sync.py"), "--bucket", str(bucket)]
    command += ["--vllm-url", vllm_server.url, "--steps", "3", "--anchor-every", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=bucket.parent)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert re.search(r"vLLM server checks\s+3\n", output), output[-3000:]
    assert re.search(r"vLLM server bit-exact\s+yes", output), output[-3000:]
    assert vllm_server.status()["version"] == 3


def test_follow_mode_keeps_the_server_at_the_newest_version(vllm_server, trainer, tmp_path):
    """`delta-sync follow` beside the server: the trainer never pushes, the server follows
    the bucket bit-exactly (by checksum), also across versions published between two polls."""
    import sys

    def wait_for_checksum(expected: str) -> dict:
        def served() -> dict | None:
            assert follower.poll() is None, log.read_text()[-3000:]
            status = vllm_server.status()
            return status if status["model_checksum"] == expected else None

        return wait_for(
            served,
            lambda: f"the server to serve {expected} (it is at {vllm_server.status()}):\n{log.read_text()[-3000:]}",
            timeout=300.0,
            interval=SERVER_POLL_SECONDS,
        )

    log = tmp_path / "follow.log"
    command = [sys.executable, "-m", "delta_sync.cli", "follow", trainer.bucket, "--vllm-url", vllm_server.url]
    with open(log, "wb") as out:
        follower = subprocess.Popen([*command, "--interval", "2"], stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(3):
            trainer.step()
            status = wait_for_checksum(trainer.checksum())
            assert status["version"] == trainer.version and not status["updating"]
        trainer.step()
        trainer.step()
        status = wait_for_checksum(trainer.checksum())
        assert status["version"] == 5 and status["run_id"] == trainer.publisher.run_id
        assert vllm_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)
    finally:
        stop_process(follower, 120)
    output = log.read_text()
    assert follower.returncode == 0, output[-3000:]
    assert "serves version 5" in output and "Traceback" not in output


# -- the guarded server (conftest's `guarded_server`: a token and a verify key) ---------------


def test_a_server_with_a_verify_key_refuses_replayed_signed_pointers(
    guarded_server, trainer, served_model, bucket_root
):
    """Someone who can write the bucket puts back what the trainer once signed: an older
    `latest.json` (rollback), another run's bucket signed with the same key (cross-run), the
    abandoned epoch's pointer after a resume (epoch replay). The server refuses each, keeps
    serving what it served, and follows the trainer's genuine next pointer."""
    from delta_sync.layout import LATEST

    root = trainer.publisher.bucket.root
    for _ in range(3):
        trainer.step()
    v3_pointer = (root / LATEST).read_bytes()
    trainer.step()
    trainer.step()
    assert guarded_server.update(trainer.bucket).status_code == 200
    held, completion = guarded_server.status(), guarded_server.greedy(PROMPT)
    assert held["version"] == 5 and guarded_server.pointer_age() is not None

    def assert_refused(reason: str) -> None:
        response = guarded_server.update(trainer.bucket)
        assert response.status_code != 200 and reason in response.text, response.text
        assert guarded_server.status() == held
        assert guarded_server.greedy(PROMPT) == completion

    v5_pointer = (root / LATEST).read_bytes()
    (root / LATEST).write_bytes(v3_pointer)
    assert_refused("an old latest.json was put back")
    # Another run, signed with the same key into another bucket, copied over this one.
    other = TinyTrainer(served_model, bucket_root / f"{root.name}-other")
    other.step()
    other.step()
    other.close()
    kept = root.with_name(f"{root.name}-kept")
    shutil.copytree(root, kept)
    shutil.rmtree(root)
    shutil.copytree(other.publisher.bucket.root, root)
    assert_refused("signed for bucket")
    shutil.rmtree(root)
    shutil.copytree(kept, root)
    # The run resumes in place from a checkpoint of step 3: a new epoch rewrites v4 on.
    trainer.publisher.close()
    trainer.publisher = Publisher(
        root,
        trainer.detector,
        run_id=trainer.publisher.run_id,
        anchor_every=3,
        anchor_bytes_ratio=None,
        background=False,
        signing_key=SIGNING_KEY,
    )
    trainer.version = 3
    for _ in range(3):
        trainer.step()
    assert guarded_server.update(trainer.bucket).status_code == 200
    held = guarded_server.status()
    assert (held["version"], held["epoch"], held["model_checksum"]) == (6, trainer.publisher.epoch, trainer.checksum())
    completion = guarded_server.greedy(PROMPT)
    (root / LATEST).write_bytes(v5_pointer)
    assert_refused("ReplayError")


def test_a_server_with_a_verify_key_refuses_a_forged_delta(guarded_server, trainer):
    """Someone who can write the bucket rewrites delta 2 with recomputed checksums: a server
    that trusts only the trainer's key refuses it and keeps serving what it holds."""
    from delta_sync.format import SparseChange, write_delta

    for _ in range(3):
        trainer.step()
    assert guarded_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    held = guarded_server.status()
    root = trainer.publisher.bucket.local_path(delta_path(2)).parent.parent
    forged = read_file(root / delta_path(2))
    name = sorted(forged.changes)[0]
    change = forged.changes[name]
    values = change.values.clone()
    values[0] = 9984.0
    (root / delta_path(2)).unlink()
    write_delta(root / delta_path(2), {**forged.changes, name: SparseChange(change.indices, values)}, forged.header)
    response = guarded_server.update(trainer.bucket, delta_path(2))
    assert response.status_code != 200 and "SignatureError" in response.text, response.text
    assert guarded_server.status() == held
    # A catch-up cannot chain past the forged delta; it lands on v4 through v4's signed anchor.
    trainer.step()
    assert guarded_server.update(trainer.bucket).status_code == 200
    assert guarded_server.status()["model_checksum"] == trainer.checksum()


def test_the_trainer_side_sends_the_token_in_its_headers(guarded_server, trainer):
    """`DeltaSyncCallback(vllm_headers=...)` hands its headers to `ReplicaSet`, as here."""
    from delta_sync.control.client import Replica
    from delta_sync.errors import ReplicaError

    for _ in range(3):
        trainer.step()
    refused = Replica(guarded_server.url, retry_seconds=0)
    try:
        with pytest.raises(ReplicaError, match="/start_weight_update: HTTP 401") as caught:
            refused.update(trainer.bucket, anchor_path(1))
        assert caught.value.status == 401 and caught.value.route == "/start_weight_update"
    finally:
        refused.close()
    # A private Space: Authorization carries the Hub token for its proxy, the header ours.
    headers = {"Authorization": "Bearer hf_for_the_proxy", "X-Delta-Sync-Token": API_TOKEN}
    for replica_headers in ({"Authorization": f"Bearer {API_TOKEN}"}, headers):
        replicas = ReplicaSet(
            [guarded_server.url], trainer.bucket, retry_seconds=1.0, timeout=60, headers=replica_headers
        )
        try:
            report = trainer.publisher.reports[-1]
            replicas.announce(trainer.version, report.delta, report.model_checksum)
            assert replicas.wait(trainer.version, timeout=300) == []
            assert replicas.states[guarded_server.url].model_checksum == trainer.checksum()
        finally:
            replicas.close()
        trainer.step()


# -- all or nothing: a load that fails midway ------------------------------------------------
# vLLM's load cannot be made to fail halfway for real, so this server runs a test double of
# the worker extension (tests/load_fault_extension.py) that fails one `load_weights` call
# after it has handed vLLM's loader some tensors.


@pytest.fixture(scope="module")
def module_servers(served_model, tied_model, bucket_root, tmp_path_factory):
    """The servers of this module's last tests, launched together at the first of them (see
    `vllm_server.launched`): one with a test double of the extension, one in bf16, one of a
    model whose lm_head is tied to its embedding."""
    from vllm_server import launched, server_in

    servers = {
        "faults": server_in(
            tmp_path_factory.mktemp("vllm-load-faults"),
            served_model,
            allowed_buckets=bucket_root.as_uri(),
            # The server imports the test double from tests/; updates prepare inline.
            extra_env={"PYTHONPATH": str(REPO / "tests"), "DELTA_SYNC_PREFETCH": "off"},
            extra_args=["--worker-extension-cls", "load_fault_extension.LoadFaultExtension"],
        ),
        "bf16": server_in(
            tmp_path_factory.mktemp("vllm-bf16"), served_model, allowed_buckets=bucket_root.as_uri(), dtype="bfloat16"
        ),
        "tied": server_in(tmp_path_factory.mktemp("vllm-tied"), tied_model, allowed_buckets=bucket_root.as_uri()),
    }
    with launched(servers):
        yield servers


@pytest.fixture(scope="module")
def fault_server(module_servers):
    return module_servers["faults"].wait_healthy()


IN_PLACE_LINE = re.compile(
    r"wrote ([1-9]\d*) tensor\(s\) in place \(([1-9]\d*) changed elements\), (\d+) rewritten whole, reloaded (\d+) whole"
)


def served_identity(status: dict) -> dict:
    """What a status says the model serves (not what the snapshot has prepared)."""
    return {key: value for key, value in status.items() if key != "prepared_version"}


#: A large, known edit of linear layers (reloaded whole; q_proj brings its fused k and v
#: shards) and of parameters patched in place, so that the two versions' outputs differ clearly.
LARGE_EDIT = {
    "model.layers.0.mlp.down_proj.weight": (slice(None),),
    "model.layers.1.self_attn.q_proj.weight": (slice(None),),
    "lm_head.weight": (slice(0, 64),),
    "model.embed_tokens.weight": (PROMPT,),
    "model.norm.weight": (slice(0, 32),),
}


def publish_large_edit(trainer: TinyTrainer, names: list[str] | None = None) -> int:
    """Publish the next version with `LARGE_EDIT` (of `names` only, when given) applied."""
    names = list(LARGE_EDIT) if names is None else names
    with torch.no_grad():
        for name in names:
            trainer.model.get_parameter(name)[LARGE_EDIT[name]] *= -3.0
    trainer.detector.mark_changed(names)
    return trainer.publish()


@pytest.mark.parametrize(
    ("stage", "fault"),
    [("patches", {"direct": True, "tensors": 2}), ("whole tensors", {"calls_before": 0, "tensors": 2})],
)
def test_a_load_failing_midway_leaves_the_old_version_served(fault_server, trainer, stage, fault):
    """The failure hits after some tensors were written: while the changed elements are
    written in place (after the linear layers were reloaded whole), or midway through the
    whole-tensor reload (inside the fused qkv layer)."""
    trainer.step()
    trainer.step()
    assert fault_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    assert fault_server.update(trainer.bucket, delta_path(2)).status_code == 200
    held = served_identity(fault_server.status())
    checksums = fault_server.weight_checksums()
    old_reference = trainer.reference()
    old_completion, old_logprobs = greedy(old_reference, PROMPT), prompt_logprobs(old_reference, PROMPT)
    assert fault_server.greedy(PROMPT) == old_completion
    target = publish_large_edit(trainer)
    assert set(read_file(trainer.publisher.bucket.local_path(delta_path(target))).changes) == set(LARGE_EDIT)
    new_logprobs = prompt_logprobs(trainer.reference(), PROMPT)
    assert (new_logprobs - old_logprobs).abs().max() > 0.1, "the two versions are too close to tell apart"

    armed = fault_server.post(
        "/collective_rpc",
        json={"method": "delta_sync_fail_next_load", "kwargs": fault},
    )
    assert armed.status_code == 200, armed.text
    response = fault_server.update(trainer.bucket, delta_path(target))
    (fault,) = fault_server.rpc("delta_sync_load_fault")
    assert response.status_code >= 400 and fault["error"] and fault["error"] in response.text, (fault, response.text)
    assert not fault["armed"] and len(fault["written"]) == 2, fault
    if stage == "patches":
        # New values had been written in place when the load failed.
        assert fault["written"] == ["lm_head.weight", "model.embed_tokens.weight"], fault
        assert fault["changed_before_failure"] == fault["written"], fault
    else:
        assert fault["written"] == ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight"]

    # The server still serves the old version, and vLLM's own digests agree.
    assert served_identity(fault_server.status()) == held
    assert fault_server.weight_checksums() == checksums
    served_logprobs = torch.tensor(fault_server.prompt_logprobs(PROMPT))
    assert (served_logprobs - old_logprobs).abs().max() < 1e-3
    assert fault_server.greedy(PROMPT) == old_completion

    # It keeps serving, and the same update tried again goes through, patching in place.
    logged = len(fault_server.log_tail(10**9))
    response = fault_server.update(trainer.bucket, delta_path(target))
    assert response.status_code == 200, response.text
    status = fault_server.status()
    assert status["version"] == target and status["model_checksum"] == trainer.checksum()
    assert not status["updating"] and status["pending"] == 0
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(unpacked_checksums_match(fault_server, trainer))
    served_logprobs = torch.tensor(fault_server.prompt_logprobs(PROMPT))
    assert (served_logprobs - new_logprobs).abs().max() < 1e-3
    assert fault_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)
    log = fault_server.log_tail(10**9)[logged:]
    assert IN_PLACE_LINE.search(log), log[-3000:]


def test_in_place_patches_change_what_the_server_computes(fault_server, trainer):
    """Embeddings, norms and lm_head are written in place; the CPU backend computes lm_head
    with a packed copy of its weight, which must follow the patch."""
    trainer.publish()
    assert fault_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    before = torch.tensor(fault_server.prompt_logprobs(PROMPT))
    plain = [name for name in LARGE_EDIT if not name.startswith("model.layers.")]
    publish_large_edit(trainer, plain)
    logged = len(fault_server.log_tail(10**9))
    assert fault_server.update(trainer.bucket, delta_path(2)).status_code == 200
    line = IN_PLACE_LINE.search(fault_server.log_tail(10**9)[logged:])
    assert line and line.group(1, 3, 4) == (str(len(plain)), "0", "0"), line
    after = torch.tensor(fault_server.prompt_logprobs(PROMPT))
    assert (after - before).abs().max() > 0.1, "the edit did not move the server's output"
    assert (after - prompt_logprobs(trainer.reference(), PROMPT)).abs().max() < 1e-3
    assert set(plain) <= set(unpacked_checksums_match(fault_server, trainer))


def test_a_changed_value_that_is_nan_is_written_as_nan(fault_server, trainer):
    """vLLM's patch loader reads NaN as "unchanged", so a changed value that is NaN must not
    go through it: weights written straight into their runtime range take it as any other
    value, and vLLM's digest of the tensor holds the NaN's bits."""
    norm, embed = "model.norm.weight", "model.embed_tokens.weight"
    trainer.publish()
    assert fault_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    for value in (float("nan"), 0.5):
        with torch.no_grad():
            trainer.model.get_parameter(norm)[3] = value
            trainer.model.get_parameter(norm)[5] += 1.0
            trainer.model.get_parameter(embed)[7, 2] += 1.0
        trainer.detector.mark_changed([norm, embed])
        version = trainer.publish()
        logged = len(fault_server.log_tail(10**9))
        response = fault_server.update(trainer.bucket, delta_path(version))
        assert response.status_code == 200, response.text
        line = IN_PLACE_LINE.search(fault_server.log_tail(10**9)[logged:])
        # (tensors patched in place, written whole into their own tensors, reloaded whole)
        assert line and line.group(1, 3, 4) == ("2", "0", "0"), line
        assert fault_server.status()["model_checksum"] == trainer.checksum()
        # vLLM's own digest of the norm holds the NaN's bits (or the value that replaced it).
        assert {norm, embed} <= set(unpacked_checksums_match(fault_server, trainer))
    assert fault_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)


# -- a server in bf16: linear layers the CPU backend keeps as plain tensors ------------------------

#: vLLM's fused modules and the checkpoint modules they hold, in order (Qwen3).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def bf16_server(module_servers):
    return module_servers["bf16"].wait_healthy()


def runtime_digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """The SHA-256 of each tensor a bf16 server holds, from checkpoint weights: a fused
    module's tensor is its shards' tensors stacked in vLLM's order."""
    digests = {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest() for name, t in weights.items()
    }
    for name in weights:
        for fused, shards in FUSED.items():
            if f".{shards[0]}." in name:
                stacked = torch.cat([weights[name.replace(f".{shards[0]}.", f".{shard}.")] for shard in shards])
                digests[name.replace(f".{shards[0]}.", f".{fused}.")] = hashlib.sha256(
                    stacked.contiguous().view(torch.uint8).numpy()
                ).hexdigest()
    return digests


def test_a_server_keeping_linear_layers_plain_patches_every_changed_element_where_it_lives(bf16_server, trainer):
    """Where vLLM keeps a linear layer's weight as a plain tensor (a GPU; the CPU backend in
    bf16 when the CPU has no bf16 matrix kernels for oneDNN), every changed element is
    written in place, fused qkv and gate_up shards included, and nothing goes through the
    layerwise reload; vLLM's digest of every tensor it holds equals the trainer's."""
    logged = len(bf16_server.log_tail(10**9))
    trainer.step()
    assert bf16_server.update(trainer.bucket, anchor_path(1)).status_code == 200
    for _ in range(2):
        version = trainer.step()
        response = bf16_server.update(trainer.bucket, delta_path(version))
        assert response.status_code == 200, response.text
        status = bf16_server.status()
        assert status["version"] == version and status["model_checksum"] == trainer.checksum()
        expected = runtime_digests(trainer.bf16())
        served = bf16_server.weight_checksums()
        plain = {name for name, digest in served.items() if digest != EMPTY_SHA256}
        assert plain, "the server reports no tensor"
        for name in plain:
            assert served[name] == expected[name], f"{name} differs on the server"
    log = bf16_server.log_tail(10**9)[logged:]
    loads = IN_PLACE_LINE.findall(log)
    assert len(loads) == 2, log[-3000:]
    if plain >= set(expected) & set(served):  # every linear layer is a plain tensor on this machine
        assert "self_attn.qkv_proj.weight" in " ".join(plain)
        # (patched, changed elements, rewritten whole, reloaded whole) per delta
        assert all(load[2:] == ("0", "0") for load in loads), loads
        assert all(int(load[0]) >= 7 for load in loads), loads  # q, k, v, o, gate, up, down at least


# -- a model whose lm_head is tied to its embedding ---------------------------------------------------


@pytest.fixture(scope="module")
def tied_model(served_model, tmp_path_factory):
    """The served tiny model with `lm_head` tied to the embedding (as in Qwen3-0.6B): the
    checkpoint holds `model.embed_tokens.weight` only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tied-model")
    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(served_model).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_server(module_servers):
    return module_servers["tied"].wait_healthy()


def test_a_tied_lm_head_computes_with_the_embedding_just_written(tied_server, tied_model, bucket_root):
    """The CPU backend computes a tied `lm_head` with a packed copy of the embedding's
    weight: written in place, the embedding must be packed again for `lm_head`, or the
    server's logits stay those of the old weights."""
    trainer = TinyTrainer(tied_model, bucket_root / "tied")
    try:
        assert "lm_head.weight" not in dict(trainer.model.named_parameters())
        trainer.publish()
        assert tied_server.update(trainer.bucket, anchor_path(1)).status_code == 200
        before = torch.tensor(tied_server.prompt_logprobs(PROMPT))
        with torch.no_grad():
            trainer.model.get_parameter("model.embed_tokens.weight")[:64] *= -3.0
        trainer.detector.mark_changed(["model.embed_tokens.weight"])
        trainer.publish()
        logged = len(tied_server.log_tail(10**9))
        assert tied_server.update(trainer.bucket, delta_path(2)).status_code == 200
        line = IN_PLACE_LINE.search(tied_server.log_tail(10**9)[logged:])
        assert line and line.group(1, 3, 4) == ("1", "0", "0"), line
        after = torch.tensor(tied_server.prompt_logprobs(PROMPT))
        assert (after - before).abs().max() > 0.1, "the edit did not move the server's output"
        assert (after - prompt_logprobs(trainer.reference(), PROMPT)).abs().max() < 1e-3
        assert tied_server.greedy(PROMPT) == greedy(trainer.reference(), PROMPT)
    finally:
        trainer.close()
