"""Celery tasks of contributors/: segment checks run on their own queue ("validation"), inside the trust
boundary, so that checking work never waits behind round tasks. Beat's wait-limit check lives here too: it
tells jobs/ which devices could run each job, which jobs/ cannot ask itself."""
import logging
import threading
import time

from celery import current_app, shared_task
from django.conf import settings
from django.dispatch import receiver

from jobs import services as jobs
from muninn.celery import send_after_commit

from . import challenges, credit, peers, selectors, verification
from .signals import credit_due, reexecution_due

log = logging.getLogger(__name__)


@receiver(reexecution_due, dispatch_uid="contributors.verify_on_commit")
def _verify_on_commit(sender, unit_id: int, **kwargs) -> None:
    send_after_commit(lambda: verify_unit.delay(unit_id), what=f"unit {unit_id}'s check",
                      sweeper="sweep_pending_verifications")


@receiver(credit_due, dispatch_uid="contributors.credit_on_commit")
def _credit_on_commit(sender, job_id: int, **kwargs) -> None:
    send_after_commit(lambda: _credit_soon(job_id), what=f"job {job_id}'s credit batch",
                      sweeper="sweep_pending_credits")


_credit_due_at = 0.0  # when (time.time) the batch this process last sent runs
_credit_lock = threading.Lock()


def _credit_soon(job_id: int) -> None:
    """One `credit_results` message per MUNINN_CREDIT_BATCH_SECONDS from this process, for every job, not one per
    result: a message is sent to run that many seconds later, and the results committed before then are left to it
    (each was committed before the batch it waits for can run, so the batch finds it). Sending a message per
    accepted result cost the web ~4 % of its CPU under load, and the Celery worker one task each; one per job and
    window still sent nearly one per result with 40 jobs on 3 web processes (~3 % of the web's CPU). A worker whose
    clock runs ahead of this one's by more than the window could run a batch early; beat's sweep
    (sweep_pending_credits) posts whatever that missed."""
    global _credit_due_at
    window = settings.MUNINN_CREDIT_BATCH_SECONDS
    if window <= 0 or current_app.conf.task_always_eager:  # eager (tests): the task runs now, so one per result
        credit_results.delay(job_id)
        return
    now = time.time()
    with _credit_lock:
        if now < _credit_due_at:
            return
        _credit_due_at = now + window
    credit_results.apply_async((None,), countdown=window)


@shared_task(name="contributors.tasks.verify_unit")
def verify_unit(unit_id: int) -> None:
    verification.unit_verify(unit_id=unit_id)


@shared_task(name="contributors.tasks.credit_results")
def credit_results(job_id: int | None) -> int:
    """Charge the accepted results that wait for it, of the job (None: of every job), a batch at a time."""
    return credit.credit_all_pending(job_id=job_id)


@shared_task(name="contributors.tasks.sweep_pending_credits")
def sweep_pending_credits() -> None:
    """Accepted results whose credit message was lost (a broker restart, a killed worker): credited now."""
    for job_id in credit.jobs_with_pending_credit():
        credit_results(job_id)


@shared_task(name="contributors.tasks.sweep_pending_verifications")
def sweep_pending_verifications() -> None:
    """Challenges unanswered past their deadline fail; checks whose task was lost are enqueued again."""
    challenges.challenges_expire()
    for unit_id in verification.pending_units():
        log.warning("unit %s: its result's check has not finished (a lost or killed task, or a long queue); "
                    "enqueued again", unit_id)
        verify_unit.delay(unit_id)
    for unit_id in peers.peer_checks_sweep():  # no peer came: the site's validator decides
        verify_unit.delay(unit_id)


@shared_task(name="contributors.tasks.check_waiting_jobs")
def check_waiting_jobs() -> list[int]:
    """Fail the running jobs that have had no capable device for MUNINN_JOB_WAIT_LIMIT (their holds are released)."""
    return jobs.jobs_check_waiting(capacity_for=selectors.capacity_for)
