"""Long-poll claims (contributors/push.py): a claim with a wait is held until a unit is queued for the device,
and answered with it; 204 when the wait runs out; 204 with a Retry-After at once when the process holds all the
claims it may; 400 for a wait that is not a number of seconds."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from contributors import push
from jobs import tasks, wakeups
from jobs.models import WorkUnit

from .test_spine import create_job

WAIT = 20  # far longer than any answer below needs: the claims must be answered by a wake-up, not a timeout


@pytest.fixture(params=["stamp", "redis"])
def wakeups_by(request, settings, tmp_path):
    """Each carrier of wake-ups, with the periodic re-check turned off (longer than the wait), so that only a
    wake-up can answer a held claim before its wait is over."""
    settings.MUNINN_CLAIM_RECHECK_SECONDS = 3 * WAIT
    settings.MUNINN_WAKEUP_DIR = str(tmp_path / "wakeups")
    if request.param == "stamp":
        settings.MUNINN_WAKEUP_REDIS_URL = ""
    elif not django_settings.CELERY_BROKER_URL.startswith("redis://"):
        pytest.skip("needs Redis as the broker (CELERY_BROKER_URL=redis://...), as `make test` runs it")
    else:
        settings.MUNINN_WAKEUP_REDIS_URL = django_settings.CELERY_BROKER_URL
    return request.param


def _claim_in_thread(device, wait: float = WAIT) -> tuple[threading.Thread, dict]:
    answer: dict = {}

    def claim() -> None:
        try:
            answer["response"] = device.client.post("/api/worker/claim", {"wait": wait}, format="json")
        finally:
            connection.close()

    thread = threading.Thread(target=claim)
    thread.start()
    deadline = time.monotonic() + WAIT
    while push.waiting.held == 0:  # until the site holds the claim
        assert thread.is_alive() and time.monotonic() < deadline, answer
        time.sleep(0.01)
    return thread, answer


@pytest.mark.django_db(transaction=True)
def test_a_held_claim_gets_the_unit_of_a_round_opened_while_it_waits(customer_api, digits_dataset, make_device,
                                                                     wakeups_by):
    device = make_device()
    job = create_job(customer_api, digits_dataset["id"], rounds=1, start=False)
    thread, answer = _claim_in_thread(device)

    started = customer_api.post(f"/api/jobs/{job['id']}/start")  # opens round 1 (Celery runs eagerly here)
    thread.join(timeout=WAIT / 2)

    assert started.status_code == 200, started.content
    assert not thread.is_alive(), "the held claim was not woken by the round opening"
    assert answer["response"].status_code == 200, answer["response"].content
    assert answer["response"].json()["unit"]["job"] == job["id"]


@pytest.mark.django_db(transaction=True)
def test_a_held_claim_gets_a_unit_whose_lease_expired(customer_api, digits_dataset, make_device, wakeups_by):
    first = make_device("first")
    create_job(customer_api, digits_dataset["id"], rounds=1)  # one unit, planned for the first device
    second = make_device("second")
    units = []
    while (unit := first.claim()) is not None:
        units.append(unit)
    thread, answer = _claim_in_thread(second)

    WorkUnit.objects.filter(pk=units[0]["id"]).update(lease_expires_at=timezone.now() - timezone.timedelta(seconds=1))
    tasks.requeue_expired_leases()
    thread.join(timeout=WAIT / 2)

    assert not thread.is_alive(), "the held claim was not woken by the re-queued unit"
    assert answer["response"].status_code == 200, answer["response"].content
    assert answer["response"].json()["unit"]["id"] == units[0]["id"]


@pytest.mark.django_db(transaction=True)
def test_a_held_claim_is_answered_204_at_once_when_the_process_stops(make_device, wakeups_by, monkeypatch):
    """What the web server's SIGTERM does (wakeups.stop_waiting_on_sigterm): a stopping process answers the claims
    it holds, so that it can exit, and their devices claim again elsewhere."""
    monkeypatch.setattr(wakeups, "_stopping", threading.Event())  # this test's process stops; the next tests' not
    device = make_device()
    thread, answer = _claim_in_thread(device)
    time.sleep(0.5)  # past the wake-up a new Redis subscriber gives its waiters (they then wait again)

    stopped = time.monotonic()
    wakeups.stop()
    thread.join(timeout=WAIT / 2)

    assert not thread.is_alive(), "the held claim was not answered when the process stopped"
    assert answer["response"].status_code == 204 and "Retry-After" not in answer["response"].headers
    assert time.monotonic() - stopped < WAIT / 4
    assert device.client.post("/api/worker/claim", {"wait": WAIT}, format="json").status_code == 204  # not held


def test_a_held_claim_is_answered_204_when_its_wait_is_over(make_device):
    device = make_device()
    asked = time.monotonic()

    response = device.client.post("/api/worker/claim", {"wait": 0.2}, format="json")

    assert response.status_code == 204
    assert time.monotonic() - asked >= 0.2  # held for its wait, not answered at once
    assert "Retry-After" not in response.headers


def test_a_claim_beyond_the_processs_held_claims_is_answered_at_once_with_retry_after(make_device, settings):
    device = make_device()
    settings.MUNINN_CLAIM_WAITERS = 1
    assert push.waiting.take(1)  # another device's claim is held
    try:
        turned_away = device.client.post("/api/worker/claim", {"wait": WAIT}, format="json")
        plain = device.client.post("/api/worker/claim", {}, format="json")
    finally:
        push.waiting.give()

    assert turned_away.status_code == 204 and int(turned_away.headers["Retry-After"]) >= 1
    assert plain.status_code == 204 and "Retry-After" not in plain.headers  # a claim without a wait is never held


def test_claims_turned_away_are_counted_in_a_warning_now_and_then(make_device, settings, caplog, monkeypatch):
    """The operator's sign that web processes are short of room for waiting claims (devices turned away start their
    work a Retry-After late): one warning per process every TURNED_AWAY_LOG_S, with the count since the last."""
    device = make_device()
    settings.MUNINN_CLAIM_WAITERS = 1
    monkeypatch.setattr(push.waiting, "_warned_at", -push.TURNED_AWAY_LOG_S)
    assert push.waiting.take(1)
    try:
        with caplog.at_level(logging.WARNING, logger="contributors.push"):
            for _ in range(3):
                assert device.client.post("/api/worker/claim", {"wait": WAIT}, format="json").status_code == 204
            monkeypatch.setattr(push.waiting, "_warned_at", time.monotonic() - push.TURNED_AWAY_LOG_S)
            device.client.post("/api/worker/claim", {"wait": WAIT}, format="json")
    finally:
        push.waiting.give()

    warnings = [r.getMessage() for r in caplog.records if r.name == "contributors.push"]
    assert len(warnings) == 2, warnings  # the first at once, the next after the interval: not one per claim
    assert warnings[0].startswith("turned away 1 claim(s)") and warnings[1].startswith("turned away 3 claim(s)")


def test_a_wait_longer_than_the_site_allows_is_cut_to_it_not_refused(make_device, settings):
    device = make_device()
    settings.MUNINN_CLAIM_WAIT_MAX = 0.1

    response = device.client.post("/api/worker/claim", {"wait": 3600}, format="json")

    assert response.status_code == 204


@pytest.mark.parametrize("body, query", [({"wait": -1}, ""), ({"wait": "soon"}, ""), ({"wait": True}, ""),
                                         ({"wait": "nan"}, ""), ({}, "?wait=later")])
def test_a_wait_that_is_not_a_number_of_seconds_is_refused(make_device, body, query):
    device = make_device()

    response = device.client.post(f"/api/worker/claim{query}", body, format="json")

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "bad_wait" and "'wait' must be a number of seconds from 0 to 30" in error["message"]

