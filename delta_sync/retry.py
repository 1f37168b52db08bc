"""`RetryPolicy`: the one retry path. Bounded retries with exponential backoff for
transient failures of any transport: bucket operations and requests to vLLM replicas.

Each transport says which of its errors are transient (a predicate passed to
[`RetryPolicy.call`]); this module decides how long to keep trying, and that this
library's own errors ([`DeltaSyncError`]) never are.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, stop_before_delay
from tenacity.wait import wait_exponential, wait_random

from .errors import BucketUnavailableError, DeltaSyncError

__all__ = ["RetryPolicy"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long a bucket keeps retrying an operation that fails transiently.

    Transient failures are the ones that may pass by themselves: a refused or dropped
    connection, a timeout, HTTP 408, 429 and 5xx. Each backend decides which of its
    client's errors are transient; everything else (no such bucket, no permission, no
    such file) fails at once. Waits grow exponentially with jitter, and no wait starts
    that would end past `max_seconds`, so an operation gives up within about
    `max_seconds` plus the duration of its last attempt.

    Defaults come from the environment when set: `DELTA_SYNC_RETRY_SECONDS` and
    `DELTA_SYNC_RETRY_ATTEMPTS`.

    Args:
        max_seconds: Time budget for one operation, first attempt included.
        max_attempts: Attempts at most, the first included (1 disables retries).
        initial_wait: Wait before the first retry, in seconds; doubles on every retry.
        max_wait: Longest single wait, in seconds.

    Example:
        ```python
        >>> bucket = open_bucket("s3://my-bucket/run1", retry=RetryPolicy(max_seconds=30))
        ```
    """

    max_seconds: float = 120.0
    max_attempts: int = 10
    initial_wait: float = 0.5
    max_wait: float = 15.0

    def __post_init__(self) -> None:
        if self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_wait < 0 or self.max_wait < self.initial_wait:
            raise ValueError(f"need 0 <= initial_wait <= max_wait, got {self.initial_wait} and {self.max_wait}")

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy, with `DELTA_SYNC_RETRY_SECONDS` / `DELTA_SYNC_RETRY_ATTEMPTS` applied."""
        fields = {}
        for var, name, kind in (
            ("DELTA_SYNC_RETRY_SECONDS", "max_seconds", float),
            ("DELTA_SYNC_RETRY_ATTEMPTS", "max_attempts", int),
        ):
            value = os.environ.get(var)
            if value:
                try:
                    fields[name] = kind(value)
                except ValueError:
                    raise ValueError(f"{var}={value!r} is not a valid {kind.__name__}") from None
        return cls(**fields)

    def call(
        self,
        fn: Callable[[], T],
        *,
        transient: Callable[[BaseException], bool],
        what: str,
        translate: Callable[[Exception], DeltaSyncError] | None = None,
        unavailable: Callable[[str], DeltaSyncError] = BucketUnavailableError,
    ) -> T:
        """Run `fn`, retrying it while it raises errors that `transient` accepts.

        Args:
            fn: The operation; it must be safe to repeat.
            transient: Whether an error may go away by retrying.
            what: The operation and its target, for log lines and the final error.
            translate: Maps a permanent client error to this library's error (raised from it).
            unavailable: Builds the error raised, from a message, when transient failures
                outlast the budget.

        Raises:
            BucketUnavailableError: `fn` still failed transiently when the budget ran out
                (or what `unavailable` builds).
        """
        try:
            return self._call(fn, transient=transient, what=what, unavailable=unavailable)
        except DeltaSyncError:
            raise
        except Exception as exc:
            if translate is None:
                raise
            raise translate(exc) from exc

    def _call(
        self,
        fn: Callable[[], T],
        *,
        transient: Callable[[BaseException], bool],
        what: str,
        unavailable: Callable[[str], DeltaSyncError],
    ) -> T:
        started = time.monotonic()
        client_transient = transient

        def transient(exc: BaseException) -> bool:
            # This library's own errors (a conflict, a bad path) are decisions, never glitches.
            return not isinstance(exc, DeltaSyncError) and client_transient(exc)

        def log_retry(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            logger.warning(
                "delta-sync: %s failed (attempt %d): %s; retrying in %.1f s", what, state.attempt_number, error, wait
            )

        retrying = Retrying(
            stop=stop_after_attempt(self.max_attempts) | stop_before_delay(self.max_seconds),
            wait=wait_exponential(multiplier=self.initial_wait, max=self.max_wait) + wait_random(0, self.initial_wait),
            retry=retry_if_exception(transient),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as exc:
            if not transient(exc):
                raise
            attempts = retrying.statistics.get("attempt_number", 1)
            raise unavailable(
                f"{what}: still failing after {attempts} attempt(s) in {time.monotonic() - started:.1f} s: {exc}"
            ) from exc
