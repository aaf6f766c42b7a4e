"""No job waits forever: the waiting reason says exactly why (no capable device online; the capable ones are
quarantined; all of them are busy), and a job with no capable device for MUNINN_JOB_WAIT_LIMIT fails with that
reason and its hold released. The customer can cancel a waiting job at any time."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.utils import timezone

from billing import selectors as ledger
from contributors.models import Device
from contributors.selectors import capacity_for
from contributors.tasks import check_waiting_jobs
from jobs import services as jobs
from jobs.models import Job

from .test_scheduling import set_resources
from .test_spine import assert_ledger_consistent, create_job

pytestmark = pytest.mark.django_db(transaction=True)
GIB = 2**30
LIMIT = 600  # seconds: ten minutes


@pytest.fixture(autouse=True)
def _short_limit(settings):
    settings.MUNINN_JOB_WAIT_LIMIT = LIMIT


def start_job(api, dataset_id: int, *, memory: int = 3 * GIB, backends: str = "cpu") -> Job:
    """A one-round job that needs `memory` on one of `backends`, started: its hold placed, its round open."""
    job = create_job(api, dataset_id, rounds=1, start=False)
    Job.objects.filter(pk=job["id"]).update(peak_memory_bytes=memory, backends=backends)
    jobs.job_start(job_id=job["id"])
    return Job.objects.get(pk=job["id"])


def waiting(api, job: Job) -> str | None:
    return api.get(f"/api/jobs/{job.pk}").json()["waiting"]


def check(now) -> list[int]:
    """What beat's check-waiting-jobs does, at a chosen time."""
    return jobs.jobs_check_waiting(capacity_for=capacity_for, now=now)


def quarantine(device: Device) -> None:
    Device.objects.filter(pk=device.pk).update(quarantined_at=timezone.now(), quarantine_reason="3 failed results")


def assert_hold_released(job: Job, customer, available_before: int) -> None:
    job.refresh_from_db()
    money = ledger.job_money(job=job)
    assert money["quoted"] > 0 and money["charged"] == 0
    assert money["held"] == 0 and money["released"] == money["quoted"]
    assert ledger.job_hold_remaining(job=job) == 0
    assert ledger.balances_for(user=customer)["customer_available"] == available_before
    assert_ledger_consistent(job)


# --- The reasons -------------------------------------------------------------------------------------

def test_no_capable_device_online_says_no_device_is_online(customer_api, digits_dataset):
    job = start_job(customer_api, digits_dataset["id"])

    reason = waiting(customer_api, job)

    assert reason.startswith("No online device can run this job yet: it needs 3.00 GiB of memory on a CPU")
    assert "no device is online" in reason
    assert "waits up to 10 minutes for one, then fails and the unused hold is released" in reason
    assert "cancel it at any time" in reason


def test_only_quarantined_capable_devices_online_says_how_many(customer, customer_api, digits_dataset, make_device):
    capable = [make_device("big-1"), make_device("big-2")]
    small = make_device("small")  # registered before: a device of an owner with a quarantine starts quarantined
    set_resources(small.device, ram=1 * GIB)
    for device in capable:
        set_resources(device.device, ram=8 * GIB)
        quarantine(device.device)
    job = start_job(customer_api, digits_dataset["id"])
    client = Client()
    client.force_login(customer)

    reason = waiting(customer_api, job)

    assert reason.startswith("No device that can run this job is available: it needs 3.00 GiB of memory on a CPU")
    assert "the 2 online device(s) that could are quarantined" in reason
    assert "no device is online" not in reason  # the reported bug: they were online, but quarantined
    assert "the 2 online device(s) that could are quarantined" in client.get(f"/jobs/{job.pk}/").content.decode()
    assert small.claim() is None


def test_only_quarantined_devices_online_and_none_capable_is_no_capable_device(customer_api, digits_dataset,
                                                                                make_device):
    small = make_device("small")
    set_resources(small.device, ram=1 * GIB)
    quarantine(small.device)
    job = start_job(customer_api, digits_dataset["id"])

    reason = waiting(customer_api, job)

    assert reason.startswith("No online device can run this job yet")
    assert "the only device(s) online (1) are quarantined" in reason


def test_capable_devices_all_busy_say_so_and_start_no_clock(customer_api, digits_dataset, make_device):
    device = make_device("busy")
    first = start_job(customer_api, digits_dataset["id"], memory=1 * GIB)
    assert device.claim() is not None  # it trains the first job's unit
    second = start_job(customer_api, digits_dataset["id"], memory=1 * GIB)
    now = timezone.now()

    reason = waiting(customer_api, second)
    failed = check(now) + check(now + timedelta(seconds=10 * LIMIT))

    assert reason == ("All 1 online device(s) that can run this job are busy with other work; it carries on as "
                      "soon as one is free.")
    assert waiting(customer_api, first) is None  # the busy device is training it
    assert failed == []
    second.refresh_from_db()
    assert second.status == Job.Status.RUNNING and second.waiting_since is None


def test_an_idle_capable_device_online_means_no_waiting_reason(customer_api, digits_dataset, make_device):
    make_device("idle")
    job = start_job(customer_api, digits_dataset["id"], memory=1 * GIB)

    assert waiting(customer_api, job) is None


# --- The wait limit ----------------------------------------------------------------------------------

def test_a_job_without_a_capable_device_fails_at_the_limit_and_its_hold_is_released(customer, customer_api,
                                                                                   digits_dataset, make_device):
    make_device("laptop")  # online, but no CUDA GPU
    available_before = ledger.balances_for(user=customer)["customer_available"]
    job = start_job(customer_api, digits_dataset["id"], backends="cuda")
    t0 = timezone.now()

    assert check(t0) == []
    job.refresh_from_db()
    assert job.waiting_since == t0
    assert check(t0 + timedelta(seconds=LIMIT - 1)) == []
    assert Job.objects.get(pk=job.pk).status == Job.Status.RUNNING
    assert check(t0 + timedelta(seconds=LIMIT)) == [job.pk]

    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert job.error == ("No device able to run this job (needs 3.00 GiB of memory on a CUDA GPU) was online for "
                         "10 minutes; the unused hold was released. Try a smaller model or a CPU template.")
    assert customer_api.get(f"/api/jobs/{job.pk}").json()["error"] == job.error
    assert waiting(customer_api, job) is None
    assert_hold_released(job, customer, available_before)
    assert check(t0 + timedelta(seconds=2 * LIMIT)) == []  # ended: nothing more to do


def test_only_quarantined_capable_devices_count_toward_the_limit(customer, customer_api, digits_dataset,
                                                                make_device):
    device = make_device("suspect")
    set_resources(device.device, ram=8 * GIB)
    quarantine(device.device)
    available_before = ledger.balances_for(user=customer)["customer_available"]
    job = start_job(customer_api, digits_dataset["id"])
    t0 = timezone.now()

    failed = check(t0) + check(t0 + timedelta(seconds=LIMIT))

    job.refresh_from_db()
    assert failed == [job.pk] and job.status == Job.Status.FAILED
    assert job.error == ("No device able to run this job (needs 3.00 GiB of memory on a CPU) was online for "
                         "10 minutes (1 online device(s) that could are quarantined); the unused hold was released. "
                         "Try a smaller model, or start it again when more devices are online.")
    assert_hold_released(job, customer, available_before)


def test_a_job_is_not_failed_while_a_capable_device_is_online(customer_api, digits_dataset, make_device):
    make_device("capable")
    job = start_job(customer_api, digits_dataset["id"], memory=1 * GIB)
    t0 = timezone.now()

    failed = check(t0) + check(t0 + timedelta(seconds=LIMIT)) + check(t0 + timedelta(seconds=10 * LIMIT))

    job.refresh_from_db()
    assert failed == [] and job.status == Job.Status.RUNNING and job.waiting_since is None


def test_a_job_that_regains_a_capable_device_starts_its_clock_again(customer_api, digits_dataset, make_device):
    job = start_job(customer_api, digits_dataset["id"], memory=1 * GIB)
    t0 = timezone.now()
    assert check(t0) == []
    assert Job.objects.get(pk=job.pk).waiting_since == t0

    device = make_device("comes-and-goes")  # a capable device comes online: the clock stops
    assert check(t0 + timedelta(seconds=LIMIT / 2)) == []
    assert Job.objects.get(pk=job.pk).waiting_since is None

    Device.objects.filter(pk=device.device.pk).update(last_seen_at=None)  # ...and goes away: it starts again
    again = t0 + timedelta(seconds=LIMIT / 2 + 1)
    assert check(again) == []
    assert Job.objects.get(pk=job.pk).waiting_since == again

    assert check(t0 + timedelta(seconds=LIMIT)) == []  # the limit from the first start has passed: not failed
    assert Job.objects.get(pk=job.pk).status == Job.Status.RUNNING
    assert check(again + timedelta(seconds=LIMIT)) == [job.pk]


def test_beat_checks_waiting_jobs(customer_api, digits_dataset):
    job = start_job(customer_api, digits_dataset["id"])
    schedule = {entry["task"] for entry in django_settings.CELERY_BEAT_SCHEDULE.values()}

    check_waiting_jobs.delay()

    assert "contributors.tasks.check_waiting_jobs" in schedule
    assert Job.objects.get(pk=job.pk).waiting_since is not None


# --- Cancelling ----------------------------------------------------------------------------------------

def test_a_waiting_job_can_be_cancelled_and_its_hold_is_released(customer, customer_api, digits_dataset):
    available_before = ledger.balances_for(user=customer)["customer_available"]
    job = start_job(customer_api, digits_dataset["id"])
    check(timezone.now())
    assert waiting(customer_api, job) is not None

    response = customer_api.post(f"/api/jobs/{job.pk}/cancel")

    assert response.status_code == 200 and response.json()["status"] == Job.Status.CANCELLED
    assert_hold_released(job, customer, available_before)
    assert check(timezone.now() + timedelta(seconds=LIMIT)) == []
    assert Job.objects.get(pk=job.pk).status == Job.Status.CANCELLED
