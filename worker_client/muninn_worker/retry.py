"""The one retry helper every network call of the client goes through.

Exponential backoff with full jitter (AWS architecture blog, "Exponential Backoff and Jitter"): the n-th
wait is uniform in [0, min(max_delay, base_delay * 2**n)], so a crowd of workers that lost the server at the
same moment does not come back at the same moment. Retried: connection errors, timeouts, a body cut off
mid-stream, and responses with status 5xx or 429. Any other 4xx is an answer, not an outage: returned at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import requests

__all__ = ["NETWORK_ERRORS", "call_with_retry", "is_retryable_status", "retry_after_seconds"]

T = TypeVar("T")

NETWORK_ERRORS: tuple[type[BaseException], ...] = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
)

# (attempt number that failed, seconds until the next one, why) -> None; the runner logs it.
RetryHook = Callable[[int, float, str], None]


def is_retryable_status(status: int) -> bool:
    return status == 429 or 500 <= status <= 599


def call_with_retry(
    fn: Callable[[], T],
    *,
    attempts: int = 6,
    base_delay: float = 0.5,
    max_delay: float = 30.0,
    retry_on: tuple[type[BaseException], ...] = NETWORK_ERRORS,
    sleep: Callable[[float], Any] = time.sleep,
    rng: Callable[[], float] = random.random,
    on_retry: RetryHook | None = None,
) -> T:
    """Call `fn` until it succeeds or `attempts` calls have been made.

    `fn` either raises (retried if the exception is one of `retry_on`) or returns a value; a value with a
    `status_code` of 5xx/429 (a requests.Response) is retried too. After the last attempt the last
    response is returned, or the last exception re-raised, so the caller reports the real failure.
    A numeric `Retry-After` header raises the wait to at least that many seconds (still capped).
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    for attempt in range(attempts):
        last = attempt == attempts - 1
        try:
            result = fn()
        except retry_on as exc:
            if last:
                raise
            reason, retry_after = f"{type(exc).__name__}: {exc}", None
        else:
            status = getattr(result, "status_code", None)
            if last or not isinstance(status, int) or not is_retryable_status(status):
                return result
            reason, retry_after = f"HTTP {status}", retry_after_seconds(result)
        delay = _backoff(attempt, base_delay, max_delay, rng)
        if retry_after is not None:
            delay = min(max_delay, max(delay, retry_after))
        if on_retry is not None:
            on_retry(attempt + 1, delay, reason)
        sleep(delay)
    raise AssertionError("unreachable")


def _backoff(attempt: int, base_delay: float, max_delay: float, rng: Callable[[], float]) -> float:
    """Full jitter: uniform in [0, min(max_delay, base_delay * 2**attempt)]."""
    return rng() * min(max_delay, base_delay * (2**attempt))


def retry_after_seconds(response: object) -> float | None:
    headers = getattr(response, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except (TypeError, ValueError):
        return None  # an HTTP-date; rare enough to fall back to plain backoff
