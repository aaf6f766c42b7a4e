"""Beat's safety net for lost Celery messages (a broker restart, a killed worker): a round whose every unit is done
but that nobody aggregated is aggregated, and a running job with no open round gets one. The messages here are
really lost: tasks go to the broker and nothing consumes them."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from contributors import verification
from jobs import services as jobs
from jobs import tasks
from jobs.models import Job, Round, WorkUnit
from muninn.celery import app as celery_app

from .test_spine import create_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lost_messages():
    """Tasks are sent to the broker, where no worker takes them; they are dropped at the end."""
    def purge():
        with celery_app.connection_for_write() as conn:
            for queue in ("celery", "validation"):
                conn.default_channel.queue_purge(queue)

    celery_app.conf.task_always_eager = False
    purge()
    yield
    purge()
    celery_app.conf.task_always_eager = True


def finish_round_without_aggregating(devices, job_id: int) -> Round:
    for device in devices:
        assert device.work_one()
    for unit in WorkUnit.objects.filter(round__job_id=job_id, status=WorkUnit.Status.VERIFYING):
        verification.unit_verify(unit_id=unit.pk)  # the re-execution runs; the aggregation it sends is lost
    return Round.objects.get(job_id=job_id, number=1)


def test_a_finished_round_whose_aggregation_was_lost_is_aggregated(customer_api, digits_dataset, make_device,
                                                                    lost_messages, settings):
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, digits_dataset["id"], rounds=2)
    # its open_round message is lost too: open it by hand, one shard per device
    jobs.round_open(job_id=job["id"], devices=[(devices[0].device.pk, 1.0), (devices[1].device.pk, 1.0)])
    rnd = finish_round_without_aggregating(devices, job["id"])
    assert rnd.status == Round.Status.OPEN and not rnd.units.exclude(status=WorkUnit.Status.ACCEPTED).exists()

    assert jobs.rounds_stalled() == []  # within the grace period the aggregation may just be on its way
    assert jobs.rounds_stalled(now=timezone.now() + timedelta(seconds=settings.MUNINN_STALL_SECONDS + 1)) == [rnd.pk]
    settings.MUNINN_STALL_SECONDS = 0
    tasks.resume_stalled_jobs()
    tasks.resume_stalled_jobs()  # twice: nothing more happens

    rnd.refresh_from_db()
    assert rnd.status == Round.Status.CLOSED and rnd.metrics["units"] == 2
    assert list(Round.objects.filter(job_id=job["id"]).values_list("number", "status").order_by("number")) == [
        (1, "closed"), (2, "open")]


def test_a_round_with_work_still_out_is_not_stalled(customer_api, digits_dataset, make_device, lost_messages,
                                                    settings):
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, digits_dataset["id"], rounds=2)
    jobs.round_open(job_id=job["id"], devices=[(devices[0].device.pk, 1.0), (devices[1].device.pk, 1.0)])
    assert devices[0].work_one()
    devices[1].claim()  # leased, never returned
    for unit in WorkUnit.objects.filter(round__job_id=job["id"], status=WorkUnit.Status.VERIFYING):
        verification.unit_verify(unit_id=unit.pk)

    later = timezone.now() + timedelta(seconds=settings.MUNINN_STALL_SECONDS + 1)
    assert jobs.rounds_stalled(now=later) == []  # the lease expires and is re-queued first
    assert jobs.jobs_stalled(now=later) == []


def test_a_running_job_whose_first_round_was_never_opened_gets_it(customer_api, digits_dataset, lost_messages,
                                                                  settings):
    job = create_job(customer_api, digits_dataset["id"], rounds=2)  # job_start's open_round message is lost
    assert Job.objects.get(pk=job["id"]).status == Job.Status.RUNNING and not Round.objects.exists()

    assert jobs.jobs_stalled() == []
    assert jobs.jobs_stalled(now=timezone.now() + timedelta(seconds=settings.MUNINN_STALL_SECONDS + 1)) == [job["id"]]
    settings.MUNINN_STALL_SECONDS = 0
    tasks.resume_stalled_jobs()
    tasks.resume_stalled_jobs()

    assert list(Round.objects.filter(job_id=job["id"]).values_list("number", "status")) == [(1, "open")]
    assert WorkUnit.objects.filter(round__job_id=job["id"], status=WorkUnit.Status.QUEUED).exists()
