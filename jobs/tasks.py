"""Celery tasks for the life of a round. Each takes ids, calls one service, and is safe to run twice.

This is the task layer, where apps are wired together: it asks contributors/ which devices are online
(jobs' services never import contributors/ or billing/), and it listens to jobs.signals to enqueue what a
service's change calls for (services never import tasks).
"""
import logging

from celery import shared_task
from django.db import DatabaseError
from django.dispatch import receiver

from muninn.celery import send_after_commit

from . import services, wakeups
from .models import Job, Round
from .signals import job_started, prediction_batch_created, round_complete

log = logging.getLogger(__name__)


def _online_devices(job: Job) -> list[tuple[int, float]]:
    from contributors.selectors import device_capacities_online

    return device_capacities_online(min_memory_bytes=job.peak_memory_bytes, backends=job.backend_list,
                                    template=job.template,
                                    trusted_only=job.dataset.sensitive)  # no shard reserved for whom it may not reach


@shared_task(name="jobs.tasks.open_round")
def open_round(job_id: int) -> int | None:
    job = Job.objects.get(pk=job_id)
    try:
        rnd = services.round_open(job_id=job_id, devices=_online_devices(job))
    except Exception as e:  # a job that cannot open a round fails visibly instead of waiting forever
        log.exception("job %s: opening a round failed", job_id)
        services.job_fail(job_id=job_id, error=f"opening a round failed: {e}")
        return None
    if rnd is not None:
        wakeups.units_queued_on_commit()  # devices waiting on a claim get its units the moment they are in
        try:  # after the wake-up: the devices claim while the statistics are read
            services.units_statistics_refresh(added=rnd.units.count())
        except DatabaseError:  # an optimisation: the round is open whatever becomes of it
            log.warning("job %s: refreshing the units' statistics failed", job_id, exc_info=True)
    return rnd.pk if rnd else None


@receiver(job_started, dispatch_uid="jobs.open_first_round")
def _open_first_round(sender, job, **kwargs) -> None:
    """A job started: its first round opens once the start commits (the hold placed with it)."""
    send_after_commit(lambda: open_round.delay(job.pk), what=f"job {job.pk}'s first round",
                      sweeper="resume_stalled_jobs")


@receiver(round_complete, dispatch_uid="jobs.aggregate_on_commit")
def _aggregate_on_commit(sender, round_id: int, **kwargs) -> None:
    """Every unit of a round is done: it is aggregated (and the next round opened) once that commits."""
    send_after_commit(lambda: aggregate_round.delay(round_id), what=f"round {round_id}'s aggregation",
                      sweeper="resume_stalled_jobs")


@receiver(prediction_batch_created, dispatch_uid="jobs.predict_on_commit")
def _predict_on_commit(sender, batch_id: int, **kwargs) -> None:
    send_after_commit(lambda: predict_batch.delay(batch_id), what=f"prediction batch {batch_id}",
                      sweeper="resume_stalled_jobs")


@shared_task(name="jobs.tasks.predict_batch")
def predict_batch(batch_id: int) -> str:
    return services.prediction_batch_run(batch_id=batch_id).status


@shared_task(name="jobs.tasks.aggregate_round")
def aggregate_round(round_id: int) -> None:
    rnd = services.round_aggregate(round_id=round_id)
    if rnd.status == Round.Status.CLOSED:
        open_round(rnd.job_id)  # in-process: the next round opens without another trip through the broker


@shared_task(name="jobs.tasks.requeue_expired_leases")
def requeue_expired_leases() -> int:
    """Expired leases go back to the queue, and their devices' records say they abandoned them."""
    from contributors.services import devices_record_abandoned

    abandoned = services.leases_expire()
    if abandoned:
        devices_record_abandoned(abandoned)
        wakeups.units_queued_on_commit()
        log.info("re-queued %s unit(s) whose lease expired", len(abandoned))
    return len(abandoned)


@shared_task(name="jobs.tasks.close_overdue_rounds")
def close_overdue_rounds() -> None:
    """Past the soft deadline, re-issue stragglers; past the hard one, close with the verified updates."""
    if services.units_reissue_stragglers():
        wakeups.units_queued_on_commit()
    for round_id in services.rounds_overdue():
        aggregate_round(round_id)


@shared_task(name="jobs.tasks.resume_stalled_jobs")
def resume_stalled_jobs() -> None:
    """Beat's safety net for lost messages: aggregate finished rounds nobody aggregated, open rounds nobody
    opened. Both services are idempotent, so a message that was only slow, not lost, does no harm."""
    for round_id in services.rounds_stalled():
        log.warning("round %s: every unit is done but it was never aggregated; aggregating it now", round_id)
        aggregate_round(round_id)
    for job_id in services.jobs_stalled():
        log.warning("job %s: running with no open round; opening its next round now", job_id)
        open_round(job_id)
    for batch_id in services.prediction_batches_stalled():
        log.warning("prediction batch %s: queued for minutes; predicting it now", batch_id)
        predict_batch(batch_id)
