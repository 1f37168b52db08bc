"""`HFBucket`: a Hugging Face Storage Bucket, through huggingface_hub's bucket API."""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BucketError, BucketNotFoundError, BucketPermissionError, IncompleteTransfer
from ..retry import RetryPolicy
from .base import RemoteBucket, split_bucket_url
from .progress import show_progress

if TYPE_CHECKING:
    from huggingface_hub import BucketFile, HfApi

__all__ = ["HFBucket", "parse_hf_url"]

SCHEME = "hf://buckets/"
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def parse_hf_url(url: str) -> tuple[str, str]:
    """Split `hf://buckets/<namespace>/<name>[/prefix]` into the bucket id and the prefix ("" for none).

    Raises:
        BucketPathError: The URL is not of that form, or its prefix escapes the bucket.

    Example:
        ```python
        >>> parse_hf_url("hf://buckets/me/deltas/run1")
        ('me/deltas', 'run1')
        ```
    """
    return split_bucket_url(
        url,
        SCHEME + "<namespace>/<name>[/prefix]",
        kind="a Hugging Face bucket URL",
        name="a namespace and a bucket name",
    )


class HFBucket(RemoteBucket):
    """A prefix inside a Hugging Face Storage Bucket.

    Bytes move through Xet storage (`hf_xet`); every write is one `batch` call that
    makes the file visible only once it is fully stored, so readers never see a part
    of it. Files go up from disk, never through a giant in-memory byte string.

    Authentication is huggingface_hub's: the `token` argument, else `HF_TOKEN`, else the
    token file written by `hf auth login`. The endpoint is `endpoint`, else `HF_ENDPOINT`,
    else the public Hub. huggingface_hub retries its own API calls on 429 and 5xx; the
    [`RetryPolicy`] adds a bounded retry around each whole operation, which also covers
    bucket creation and the Xet transfer itself.

    `upload(..., overwrite=False)` checks that the path is free before the batch: Hugging
    Face Buckets have no atomic create-if-absent, so two writers racing for the same new
    path can both succeed. delta-sync assumes a single trainer per prefix here (the
    Publisher refuses to start on a prefix that holds another run's files). An upload
    that finds its own earlier write (same Xet hash, e.g. after a lost response) succeeds.

    Args:
        url: `hf://buckets/<namespace>/<name>[/prefix]`.
        token: A Hugging Face token; None for the usual lookup, False for none.
        endpoint: The Hub's URL; defaults to `HF_ENDPOINT` or the public Hub.
        create: Create the bucket if it does not exist (needs a token that may create
            buckets in the namespace).
        private: Visibility of a bucket that `create` creates (None: the namespace default).
        retry: Retry policy; [`RetryPolicy.from_env`] by default.

    Example:
        ```python
        >>> bucket = HFBucket("hf://buckets/me/deltas/run1", create=True)
        >>> bucket.upload("latest.json", b"{}")
        >>> bucket.list()
        ['latest.json']
        ```
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | bool | None = None,
        endpoint: str | None = None,
        create: bool = False,
        private: bool | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        try:
            from huggingface_hub import HfApi, constants
        except ImportError as exc:
            raise ImportError(
                "hf:// buckets need huggingface_hub and hf_xet: pip install 'delta-weight-sync[hf]'"
            ) from exc
        self.bucket_id, prefix = parse_hf_url(url)
        super().__init__(SCHEME + self.bucket_id, prefix, retry)
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self._api: HfApi = HfApi(endpoint=self.endpoint, token=token)
        if create:
            self._run(
                "create the bucket",
                None,
                lambda: self._api.create_bucket(self.bucket_id, private=private, exist_ok=True),
            )

    def upload(self, path: str, source: bytes | os.PathLike, *, overwrite: bool = True) -> None:
        key = self._key(path)
        content, size = self._source(path, source)
        own_hash: list[str] = []

        def attempt() -> None:
            if not overwrite:
                existing = self._file_info(key)
                if existing is not None:
                    if not own_hash:
                        own_hash.append(_xet_hash(content))
                    if existing.xet_hash == own_hash[0]:
                        return  # an earlier attempt stored it and only its answer was lost
                    raise self._conflict(path)
            with _hub_progress(show_progress(size)):
                self._api.batch_bucket_files(self.bucket_id, add=[(content, key)])

        self._run("upload", path, attempt)

    def read_if_changed(self, path: str, tag: str | None) -> tuple[bytes | None, str]:
        """One paths-info request: the file's Xet hash is its tag; the content is fetched
        only when the hash differs."""
        key = self._key(path)

        def attempt() -> tuple[bytes | None, str]:
            info = self._file_info(key)
            if info is None:
                raise self._not_found(path)
            if info.xet_hash == tag:
                return None, tag
            with tempfile.TemporaryDirectory(prefix="delta-sync-read-") as tmp:
                local = Path(tmp) / "file"
                self._fetch(info, local)
                content = local.read_bytes()
            if len(content) != info.size:
                raise IncompleteTransfer(f"got {len(content)} of {info.size} bytes")
            return content, info.xet_hash

        return self._run("read", path, attempt)

    # -- store calls ----------------------------------------------------------------------

    def _get(self, key: str, tmp: Path, path: str, max_bytes: int | None) -> int:
        info = self._file_info(key)
        if info is None:
            raise self._not_found(path)
        self.check_size(path, info.size, max_bytes)
        self._fetch(info, tmp)
        return info.size

    def _fetch(self, info: BucketFile, dest: Path) -> None:
        """Download the file `info` describes (that content, by its Xet hash) to `dest`."""
        with _hub_progress(show_progress(info.size)):
            self._api.download_bucket_files(self.bucket_id, [(info, str(dest))], raise_on_missing_files=True)

    def _list_keys(self, under: str) -> list[str]:
        from huggingface_hub import BucketFile

        entries = self._api.list_bucket_tree(self.bucket_id, prefix=under or None, recursive=True)
        return [entry.path for entry in entries if isinstance(entry, BucketFile)]

    def _delete_keys(self, keys: list[str]) -> None:
        # Only paths that exist: deleting an absent path is not an error here.
        present = [info.path for info in self._api.get_bucket_paths_info(self.bucket_id, keys)]
        if present:
            self._api.batch_bucket_files(self.bucket_id, delete=present)

    def _file_info(self, key: str) -> BucketFile | None:
        for info in self._api.get_bucket_paths_info(self.bucket_id, [key]):
            if info.path == key:
                return info
        return None

    # -- what the Hub's errors mean ---------------------------------------------------------

    @staticmethod
    def _is_transient(exc: BaseException) -> bool:
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(exc, (HfHubHTTPError, ConnectionError)) and (status := _status(exc)) is not None:
            return status in _TRANSIENT_STATUS
        try:
            import httpx2 as httpx
        except ImportError:  # older huggingface_hub releases use httpx
            import httpx
        # A request that got no answer (refused, reset, timed out), from either client.
        return isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError))

    def _translate(self, exc: Exception, what: str, path: str | None) -> BucketError:
        from hf_xet import XetAuthenticationError, XetObjectNotFoundError
        from huggingface_hub.errors import (
            BucketBatchError,
            EntryNotFoundError,
            HfHubHTTPError,
            RepositoryNotFoundError,
        )
        from huggingface_hub.errors import (
            BucketNotFoundError as HubBucketNotFound,
        )

        status = _status(exc)
        # hf_xet's own Hub request is the bucket's token route: a 404 there is a missing bucket.
        xet_not_found = isinstance(exc, ConnectionError) and status == 404
        if isinstance(exc, (HubBucketNotFound, RepositoryNotFoundError)) or xet_not_found:
            return BucketNotFoundError(
                f"{what}: bucket {self.bucket_id} not found at {self.endpoint}, or not visible with this token"
            )
        if isinstance(exc, (EntryNotFoundError, XetObjectNotFoundError)):
            return self._not_found(path)
        if status in (401, 403) or isinstance(exc, XetAuthenticationError):
            return BucketPermissionError(
                f"{what}: permission denied (HTTP {status}); check the token (HF_TOKEN, `hf auth login`) "
                f"has {'write' if 'upload' in what or 'delete' in what or 'create' in what else 'read'} access "
                f"to bucket {self.bucket_id}"
            )
        if isinstance(exc, BucketBatchError):
            return BucketError(f"{what}: the Hub refused the batch: {exc}")
        if isinstance(exc, HfHubHTTPError):
            return BucketError(f"{what}: HTTP {status}: {exc}")
        return BucketError(f"{what}: {type(exc).__name__}: {exc}")


def _xet_hash(content: bytes | Path) -> str:
    import hf_xet

    if isinstance(content, Path):
        return hf_xet.hash_files([str(content)])[0].hash
    with tempfile.NamedTemporaryFile(prefix="delta-sync-hash-") as tmp:
        tmp.write(content)
        tmp.flush()
        return hf_xet.hash_files([tmp.name])[0].hash


#: How hf_xet words the HTTP status of a failed request (that of its HTTP client, reqwest).
_XET_STATUS = re.compile(r"HTTP status (?:client|server) error \((\d{3})\b")


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a failed Hub request, if it got an answer.

    huggingface_hub's errors carry the response. hf_xet raises no error of its own for a
    failed HTTP request of its own (it fetches the bucket's Xet token from the Hub): a
    `ConnectionError` whose message alone holds the status, read here and only here.
    """
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        return exc.response.status_code if exc.response is not None else None
    if isinstance(exc, ConnectionError) and (match := _XET_STATUS.search(str(exc))):
        return int(match.group(1))
    return None


_quiet_lock = threading.Lock()
_quiet_users = 0
_quiet_reenable = False


@contextmanager
def _hub_progress(show: bool) -> Iterator[None]:
    """Let huggingface_hub draw its transfer bars only for large files on a terminal.

    Its bars can only be switched off process-wide; a count of the transfers that want
    them off keeps concurrent transfers (publisher and receiver threads) consistent.
    """
    global _quiet_users, _quiet_reenable
    if show:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    with _quiet_lock:
        if _quiet_users == 0:
            _quiet_reenable = not are_progress_bars_disabled()
            if _quiet_reenable:
                disable_progress_bars()
        _quiet_users += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users -= 1
            if _quiet_users == 0 and _quiet_reenable:
                enable_progress_bars()
