"""The control-plane contract: `UpdateInfo` as delta-sync's trainer and TRL's delta clients send it."""

from __future__ import annotations

import re

import httpx
import pytest

from delta_sync.control import Route, UpdateInfo
from delta_sync.errors import ApplyError
from delta_sync.layout import anchor_path, delta_path

from fake_vllm import FakeVLLM
from helpers import assert_bit_exact

ANCHOR = "anchors/step_00000001.safetensors"
DELTA = "deltas/step_00000002.safetensors"


# -- UpdateInfo ---------------------------------------------------------------------------------


def test_delta_sync_payload_round_trips():
    info = UpdateInfo.from_dict({"bucket": "s3://b/run", "filename": DELTA})
    assert info == UpdateInfo("s3://b/run", DELTA, kind=None)
    assert info.to_dict() == {"bucket": "s3://b/run", "filename": DELTA}
    assert UpdateInfo.from_dict({"bucket": "s3://b/run"}).to_dict() == {"bucket": "s3://b/run"}


def test_repo_id_is_an_alias_and_a_bare_id_is_a_hugging_face_bucket():
    assert UpdateInfo.from_dict({"repo_id": "me/deltas", "filename": DELTA}).bucket == "hf://buckets/me/deltas"
    same = {"bucket": "me/deltas", "repo_id": "me/deltas", "filename": DELTA}
    assert UpdateInfo.from_dict(same).bucket == "hf://buckets/me/deltas"
    with pytest.raises(ValueError, match="two buckets"):
        UpdateInfo.from_dict({"bucket": "me/a", "repo_id": "me/b"})
    with pytest.raises(ValueError, match="needs 'bucket'"):
        UpdateInfo.from_dict({"filename": DELTA})


@pytest.mark.parametrize(("update_kind", "kind"), [("dense", "anchor"), ("sparse_flat", "delta")])
def test_trl_update_kind_says_what_the_file_is(update_kind, kind):
    payload = {"repo_id": "me/deltas", "filename": ANCHOR, "update_kind": update_kind}
    info = UpdateInfo.from_dict(payload)
    assert info.kind == kind
    assert info.to_dict() == {"bucket": "hf://buckets/me/deltas", "filename": ANCHOR, "update_kind": update_kind}
    assert UpdateInfo.from_dict(info.to_dict()) == info


def test_trl_is_checkpoint_format_true_is_what_every_file_is():
    info = UpdateInfo.from_dict({"repo_id": "me/deltas", "filename": DELTA, "is_checkpoint_format": True})
    assert info == UpdateInfo("hf://buckets/me/deltas", DELTA)
    both = {"repo_id": "me/deltas", "filename": DELTA, "is_checkpoint_format": True, "update_kind": "sparse_flat"}
    assert UpdateInfo.from_dict(both).kind == "delta"


def test_json_nulls_are_absent_keys():
    payload = {"bucket": "s3://b", "repo_id": None, "filename": None, "update_kind": None, "is_checkpoint_format": None}
    assert UpdateInfo.from_dict(payload) == UpdateInfo("s3://b")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"bucket": "s3://b", "filename": DELTA, "update_kind": "full"}, "'update_kind' is 'full'"),
        ({"bucket": "s3://b", "filename": DELTA, "update_kind": "sparse"}, "understood: 'dense' (an anchor)"),
        ({"bucket": "s3://b", "filename": DELTA, "update_kind": 1}, "'update_kind' is 1"),
        ({"bucket": "s3://b", "filename": DELTA, "is_checkpoint_format": False}, "'is_checkpoint_format' is False"),
        ({"bucket": "s3://b", "filename": DELTA, "is_checkpoint_format": "true"}, "'is_checkpoint_format' must be"),
        ({"bucket": "s3://b", "filename": DELTA, "is_checkpoint_format": 1}, "'is_checkpoint_format' must be"),
        ({"bucket": "s3://b", "update_kind": "dense"}, "there is no 'filename'"),
        ({"bucket": "s3://b", "filename": DELTA, "packed": True}, "unknown key(s) ['packed']"),
        ({"bucket": "", "filename": DELTA}, "'bucket' must be a non-empty string"),
        ({"bucket": "s3://b", "filename": 7}, "'filename' must be a string"),
        (["s3://b"], "must be a JSON object"),
    ],
)
def test_values_not_understood_are_refused_naming_the_key(payload, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        UpdateInfo.from_dict(payload)
    assert message in str(error.value)


def test_the_announced_kind_must_be_the_files():
    anchor = UpdateInfo("s3://b", ANCHOR, kind="anchor")
    anchor.check_kind("anchor", source="s3://b/" + ANCHOR)
    with pytest.raises(
        ApplyError, match="s3://b/x is a delta, but update_info 'update_kind' is 'dense' \\(an anchor\\)"
    ):
        anchor.check_kind("delta", source="s3://b/x")
    delta = UpdateInfo("s3://b", DELTA, kind="delta")
    with pytest.raises(ApplyError, match="is an anchor, but update_info 'update_kind' is 'sparse_flat'"):
        delta.check_kind("anchor", source="s3://b/x")
    UpdateInfo("s3://b", DELTA).check_kind("anchor", source="s3://b/x")  # nothing announced, nothing to check
    with pytest.raises(ValueError, match="kind must be"):
        UpdateInfo("s3://b", DELTA, kind="dense")


# -- over HTTP, against the vLLM test double ---------------------------------------------------


def post(server: FakeVLLM, route: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + route, timeout=60, **kwargs)


def session(server: FakeVLLM, update_info: dict) -> httpx.Response:
    """vLLM's start / update / finish, as TRL's later delta branches drive it."""
    assert post(server, Route.START).status_code == 200
    response = post(server, Route.UPDATE, json={"update_info": update_info})
    if response.status_code == 200:
        assert post(server, Route.FINISH).status_code == 200
    return response


def test_trl_clients_payloads_are_accepted_over_http(run):
    bucket = run.publisher.bucket.url
    with FakeVLLM() as server:
        # TRL's later branches: update_kind names what was uploaded.
        response = session(server, {"repo_id": bucket, "filename": anchor_path(1), "update_kind": "dense"})
        assert response.status_code == 200, response.text
        response = session(server, {"repo_id": bucket, "filename": delta_path(2), "update_kind": "sparse_flat"})
        assert response.status_code == 200, response.text
        # TRL's first branch: is_checkpoint_format, inherited from vLLM's update info.
        response = session(server, {"repo_id": bucket, "filename": delta_path(3), "is_checkpoint_format": True})
        assert response.status_code == 200, response.text
        assert server.receiver.version == 3
        assert_bit_exact(run.states[3], server.receiver.weights)


def test_trl_first_branch_flow_needs_a_session(run):
    """TRL's first branch POSTs /update_weights alone; vLLM >= 0.22 refuses that before the engine sees it."""
    with FakeVLLM() as server:
        info = {"repo_id": run.publisher.bucket.url, "filename": anchor_path(1), "is_checkpoint_format": True}
        response = post(server, Route.UPDATE, json={"update_info": info})
        assert response.status_code == 500
        assert "start_weight_update must be called before update_weights" in response.text
        assert server.receiver.version is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"packed": True}, "unknown key(s) ['packed']"),
        ({"update_kind": "sparse_v2"}, "'update_kind' is 'sparse_v2'"),
        ({"is_checkpoint_format": False}, "'is_checkpoint_format' is False"),
    ],
)
def test_payloads_not_understood_are_refused_over_http(run, extra, message):
    with FakeVLLM() as server:
        response = session(server, {"repo_id": run.publisher.bucket.url, "filename": anchor_path(1), **extra})
        assert response.status_code == 400
        assert message in response.json()["error"]["message"]
        assert server.receiver.version is None and not server.updating
