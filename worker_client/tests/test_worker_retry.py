"""The retry helper: backoff with jitter on outages, never on a plain 4xx answer."""

from __future__ import annotations

import pytest
import requests

from muninn_worker.retry import call_with_retry


class FakeResponse:
    def __init__(self, status_code: int, headers: dict | None = None) -> None:
        self.status_code = status_code
        self.headers = headers or {}


class Script:
    """Returns (or raises) the scripted outcomes one call at a time and counts calls."""

    def __init__(self, *outcomes: object) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_retries_503_then_succeeds():
    sleeps: list[float] = []
    fn = Script(FakeResponse(503), FakeResponse(503), FakeResponse(200))

    response = call_with_retry(fn, sleep=sleeps.append, rng=lambda: 1.0)

    assert response.status_code == 200 and fn.calls == 3
    assert sleeps == [0.5, 1.0]  # base_delay * 2**n with the jitter draw at its maximum


def test_does_not_retry_400():
    sleeps: list[float] = []
    fn = Script(FakeResponse(400), FakeResponse(200))

    response = call_with_retry(fn, sleep=sleeps.append)

    assert response.status_code == 400 and fn.calls == 1 and sleeps == []


def test_retries_429_and_connection_errors_and_timeouts():
    fn = Script(FakeResponse(429), requests.ConnectionError("refused"), requests.Timeout("slow"), FakeResponse(201))

    response = call_with_retry(fn, sleep=lambda s: None)

    assert response.status_code == 201 and fn.calls == 4


def test_gives_up_after_attempts_returning_the_last_response():
    sleeps: list[float] = []
    fn = Script(*[FakeResponse(502)] * 4)

    response = call_with_retry(fn, attempts=4, sleep=sleeps.append, rng=lambda: 0.5)

    assert response.status_code == 502 and fn.calls == 4 and len(sleeps) == 3


def test_gives_up_after_attempts_reraising_the_last_error():
    fn = Script(*[requests.ConnectionError(f"refused {i}") for i in range(3)])

    with pytest.raises(requests.ConnectionError, match="refused 2"):
        call_with_retry(fn, attempts=3, sleep=lambda s: None)
    assert fn.calls == 3


def test_other_exceptions_are_not_retried():
    fn = Script(KeyError("bug"), FakeResponse(200))

    with pytest.raises(KeyError):
        call_with_retry(fn, sleep=lambda s: None)
    assert fn.calls == 1


def test_backoff_is_capped_by_max_delay_and_jittered():
    sleeps: list[float] = []
    fn = Script(*[FakeResponse(500)] * 8)

    call_with_retry(fn, attempts=8, base_delay=1.0, max_delay=5.0, sleep=sleeps.append, rng=lambda: 0.5)

    assert sleeps == [0.5, 1.0, 2.0, 2.5, 2.5, 2.5, 2.5]


def test_retry_after_header_raises_the_wait():
    sleeps: list[float] = []
    fn = Script(FakeResponse(429, {"Retry-After": "3"}), FakeResponse(200))

    call_with_retry(fn, sleep=sleeps.append, rng=lambda: 0.1)

    assert sleeps == [3.0]
