"""An accepted result is answered at once and charged moments later, off the request (contributors.credit): the
charge is posted once whatever happens to the message that asks for it (lost, delivered twice, its batch killed
half way), and always before anything that changes what is owed (the job ending, the device failing)."""
from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import transaction

from billing import money
from billing import selectors as ledger
from billing import services as billing
from billing.models import Entry, Transaction
from contributors import credit, reputation, tasks
from contributors import services as contributors
from contributors.models import Device, Receipt
from jobs.models import Job, WorkUnit

from . import invariants
from .conftest import digits_npz, named_file
from .test_spine import create_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lost(monkeypatch) -> list[int]:
    """The credit task's messages never arrive (a broker that lost them): the jobs they were for."""
    sent: list[int] = []
    monkeypatch.setattr(tasks.credit_results, "delay", sent.append)
    return sent


@pytest.fixture
def veterans(settings, staff, customer, customer_api, make_device, monkeypatch):
    """Two devices with long verified records (accepted without a re-execution, on a site whose operator lowered
    the check floor) and a running 2-round job. The 5 % draw of a veteran's units for a segment check is taken
    out: these tests are about the other 95 %."""
    settings.MUNINN_MIN_CHECK_RATE = 0.05
    monkeypatch.setattr(reputation, "should_reexecute", lambda streak, draw, **floor: False)
    settings.MUNINN_PRICE_PER_HU = Decimal(10**10)
    billing.balance_grant(user=customer, amount=money.to_nanos("1000"), reason="test", granted_by=staff)
    devices = [make_device("vet-a"), make_device("vet-b")]
    # a speed record no tiny unit can beat: an "implausibly fast" result would be checked (a timing-dependent flake)
    Device.objects.update(verified_streak=10_000, verified_total=10_000, samples_per_s=1e9)
    for device in devices:
        device.device.refresh_from_db()
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(200), "digits.npz")},
                                format="multipart").json()["id"]
    job = create_job(customer_api, dataset, rounds=2)
    return devices, Job.objects.get(pk=job["id"])


def upload(device) -> tuple[dict, dict]:
    unit = device.claim()
    response = device.submit(unit["id"], *device.train(unit))
    assert response.status_code == 201, response.content
    return unit, response.json()


def charges(unit_id: int) -> int:
    return Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit_id).count()


def test_the_answer_comes_first_and_the_sweep_charges_a_lost_credit_once(veterans, lost, contributor):
    (a, _), job = veterans
    unit, answer = upload(a)

    assert (answer["credit"], answer["earned_nanos"]) == ("pending", 0)
    assert Decimal(answer["credited_hu"]) > 0 and lost == [job.pk]
    assert charges(unit["id"]) == 0 and Receipt.objects.get(unit_id=unit["id"]).credit_pending

    tasks.sweep_pending_credits()
    tasks.sweep_pending_credits()  # again, and the task itself, as a duplicate delivery would
    tasks.credit_results(job.pk)

    assert charges(unit["id"]) == 1 and not Receipt.objects.get(unit_id=unit["id"]).credit_pending
    assert ledger.balances_for(user=contributor).get("contributor_pending", 0) > 0
    again = a.submit(unit["id"], *a.train(unit)).json()  # the same upload once more: now it says what it earned
    assert again["credit"] == "posted" and again["earned_nanos"] > 0


def test_a_batch_that_dies_before_commit_charges_nothing_and_its_rerun_charges_each_once(veterans, lost,
                                                                                       monkeypatch):
    (a, b), job = veterans
    units = [upload(device)[0]["id"] for device in (a, b)]
    owed = list(Receipt.objects.filter(unit_id__in=units, credit_pending=True).values_list("unit_id", flat=True))
    assert sorted(owed) == sorted(units)

    def killed(name: str) -> None:
        if name == "credit.before_commit":
            raise SystemExit("killed mid-batch")

    with monkeypatch.context() as patch:
        patch.setattr(credit, "failpoint", killed)
        with pytest.raises(SystemExit):
            credit.credit_pending(job_id=job.pk)
    assert all(charges(u) == 0 for u in owed)  # rolled back whole: nothing half posted
    assert Receipt.objects.filter(unit_id__in=owed, credit_pending=True).count() == len(owed)

    assert credit.credit_pending(job_id=job.pk) == len(owed)
    assert credit.credit_pending(job_id=job.pk) == 0
    assert all(charges(u) == 1 for u in owed)


def test_a_job_cancelled_with_credits_owed_pays_them_before_its_hold_is_released(veterans, lost, customer_api):
    (a, b), job = veterans
    units = [upload(device)[0]["id"] for device in (a, b)]
    owed = list(Receipt.objects.filter(unit_id__in=units, credit_pending=True).values_list("unit_id", flat=True))
    assert sorted(owed) == sorted(units), list(Receipt.objects.filter(unit_id__in=units).values())

    assert customer_api.post(f"/api/jobs/{job.pk}/cancel").status_code == 200

    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED
    assert all(charges(u) == 1 for u in owed)
    invariants.assert_ledger_invariants(job)  # the hold is empty, and every accepted unit was charged once


def test_a_device_failure_charges_its_owed_credits_first_then_holds_them(veterans, lost, contributor):
    (a, _), job = veterans
    unit, answer = upload(a)
    assert answer["status"] == "accepted"

    contributors.device_record_failure(device=a.device, reason="reexecution_mismatch: test", unit_id=None)

    assert charges(unit["id"]) == 1 and not Receipt.objects.get(unit_id=unit["id"]).credit_pending
    assert ledger.balances_for(user=contributor).get("contributor_held", 0) > 0  # held for review, not pending
    device = Device.objects.get(pk=a.device.pk)
    assert device.verified_streak == 0 and device.verified_total == 10_001  # counted, then the streak reset


def test_the_last_round_closing_pays_every_owed_credit_before_the_job_succeeds(veterans, lost):
    devices, job = veterans
    for _ in range(job.rounds):
        for device in devices:
            unit = device.claim()
            if unit is not None:
                assert device.submit(unit["id"], *device.train(unit)).status_code == 201
    job.refresh_from_db()
    assert job.status == Job.Status.SUCCEEDED
    assert not Receipt.objects.filter(unit__round__job=job, credit_pending=True).exists()
    assert WorkUnit.objects.filter(round__job=job, status=WorkUnit.Status.ACCEPTED).count() == 4
    invariants.assert_ledger_invariants(job)


def test_a_batch_posts_exactly_what_charging_its_units_one_by_one_posts(veterans, lost, settings):
    (a, b), job = veterans
    settings.MUNINN_MIN_EARNING_PER_UNIT = "0.000000001"
    units = [upload(device)[0]["id"] for device in (a, b)]
    receipts = list(Receipt.objects.filter(unit_id__in=units).select_related("unit__round__job", "device__owner")
                    .order_by("id"))

    def posted(charge) -> list[tuple]:
        with transaction.atomic():
            charge(receipts)
            rows = sorted(Entry.objects.filter(transaction__kind=Transaction.Kind.CHARGE, transaction__job=job)
                          .values_list("transaction__unit_id", "transaction__memo", "account__key", "amount"))
            transaction.set_rollback(True)
        return rows

    one_by_one = posted(lambda rs: [billing.unit_charge(unit=r.unit, contributor=r.device.owner) for r in rs])
    batched = posted(lambda rs: billing.unit_charges(job=job, charges=[(r.unit, r.device.owner) for r in rs]))

    assert one_by_one and batched == one_by_one
    assert len({row[0] for row in batched}) == len(receipts)


def test_one_credit_message_per_batch_window_for_every_job(settings, monkeypatch):
    """Away from eager tests (a real broker), the results accepted within MUNINN_CREDIT_BATCH_SECONDS of each
    other, of any job, are left to one batch message, sent to run at the window's end (after every one of them has
    committed) for every job; a result after the window needs a new one."""
    from muninn.celery import app as celery_app

    settings.MUNINN_CREDIT_BATCH_SECONDS = 0.25
    sent: list[tuple] = []
    monkeypatch.setattr(tasks.credit_results, "apply_async", lambda args, countdown: sent.append((args, countdown)))
    clock = [1000.0]
    monkeypatch.setattr(tasks.time, "time", lambda: clock[0])
    monkeypatch.setattr(tasks, "_credit_due_at", 0.0)

    celery_app.conf.task_always_eager = False
    try:
        for _ in range(5):
            tasks._credit_soon(7)
            clock[0] += 0.04
        tasks._credit_soon(8)
        assert sent == [((None,), 0.25)]
        clock[0] = 1000.0 + 0.25  # the first batch's time has come: a result now needs the next one
        tasks._credit_soon(8)
        assert sent[-1] == ((None,), 0.25) and len(sent) == 2
    finally:
        celery_app.conf.task_always_eager = True

    settings.MUNINN_CREDIT_BATCH_SECONDS = 0  # turned off (or eager tests): one message per result, at once
    monkeypatch.setattr(tasks.credit_results, "delay", lambda job_id: sent.append(((job_id,), 0)))
    tasks._credit_soon(7)
    tasks._credit_soon(7)
    assert sent[-2:] == [((7,), 0), ((7,), 0)]


def test_a_broker_that_refuses_the_messages_after_the_commit_costs_the_devices_nothing(veterans, monkeypatch,
                                                                                      settings, caplog):
    """An accepted result's messages (its job's credit batch; the aggregation, when it was its round's last) are
    sent after its commit. A broker that refuses them then must not answer a 500 for work the site has kept (the
    device would send it again, and count an error): the refusals are logged, and beat's sweepers do the rest."""
    from celery.app.task import Task
    from kombu.exceptions import OperationalError

    from jobs import tasks as job_tasks
    from muninn import celery_app

    (a, b), job = veterans

    def refused(*args, **kwargs):
        raise OperationalError("[Errno 111] Connection refused")

    accepted = []
    with monkeypatch.context() as down:  # messages go to the broker, which is down
        down.setattr(Task, "apply_async", refused)
        celery_app.conf.task_always_eager = False  # (conftest's _eager_celery sets it back for the next test)
        idle = 0
        while idle < 2:  # until neither device gets a unit: the next round opens only once this one is aggregated
            for device in (a, b):
                unit = device.claim()
                idle = idle + 1 if unit is None else 0
                if unit is not None:
                    response = device.submit(unit["id"], *device.train(unit))
                    assert response.status_code == 201, response.content
                    accepted.append(unit["id"])

        celery_app.conf.task_always_eager = True

    first = job.round_set.get(number=1)
    assert accepted and set(accepted) == set(first.units.filter(status=WorkUnit.Status.ACCEPTED)
                                             .values_list("id", flat=True))
    assert not first.units.exclude(status__in=[WorkUnit.Status.ACCEPTED, WorkUnit.Status.CANCELLED]).exists()
    assert all(r.status == Receipt.Status.ACCEPTED and r.credit_pending
               for r in Receipt.objects.filter(unit_id__in=accepted))
    first.refresh_from_db()
    assert first.status == first.Status.OPEN  # complete, but its aggregation's message was refused
    refusals = [r.getMessage() for r in caplog.records if "the message was not sent" in r.getMessage()]
    assert any("credit batch" in m for m in refusals) and any("aggregation" in m for m in refusals)

    settings.MUNINN_STALL_SECONDS = 0  # the broker is back (and the tests' Celery eager again); beat's sweepers run
    tasks.sweep_pending_credits()
    job_tasks.resume_stalled_jobs()

    assert all(charges(unit_id) == 1 for unit_id in accepted)
    assert not Receipt.objects.filter(unit_id__in=accepted, credit_pending=True).exists()
    first.refresh_from_db()
    assert first.status != first.Status.OPEN and job.round_set.filter(number=2).exists()
