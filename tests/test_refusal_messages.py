"""A refused bucket stays identifiable after vLLM's HTTP error answer strips local paths."""

from __future__ import annotations

import re

import pytest

from delta_sync import Receiver
from delta_sync.errors import UntrustedBucketError


def like_vllms_error_answer(message: str) -> str:
    """The path rules of vLLM 0.32's `sanitize_message`
    (`vllm/entrypoints/serve/exception_handling/utils.py`), which its error answers apply."""
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    return re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)


def test_an_untrusted_local_bucket_is_named_by_its_ending(tmp_path):
    allowed, refused = tmp_path / "runs" / "deltas", tmp_path / "runs" / "other"
    receiver = Receiver(allowed_buckets=[str(allowed)])
    with pytest.raises(UntrustedBucketError) as caught:
        receiver.check_bucket(str(refused))
    message = str(caught.value)
    assert refused.as_uri() in message and allowed.as_uri() in message  # in full, where nothing strips it
    answered = like_vllms_error_answer(message)
    assert "ending 'runs/other'" in answered and "ending 'runs/deltas'" in answered
    assert "DELTA_SYNC_ALLOWED_BUCKETS" in answered


def test_a_receiver_trusting_nothing_says_what_to_set(tmp_path):
    with pytest.raises(UntrustedBucketError, match="DELTA_SYNC_ALLOWED_BUCKETS") as caught:
        Receiver(allowed_buckets=[]).check_bucket(str(tmp_path / "b"))
    assert "ending" in like_vllms_error_answer(str(caught.value))
