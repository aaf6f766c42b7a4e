"""Celery tasks of contributors/: segment checks run on their own queue ("validation"), inside the trust
boundary, so that checking work never waits behind round tasks."""
from celery import shared_task

from . import challenges, verification


@shared_task(name="contributors.tasks.verify_unit")
def verify_unit(unit_id: int) -> None:
    verification.unit_verify(unit_id=unit_id)


@shared_task(name="contributors.tasks.sweep_pending_verifications")
def sweep_pending_verifications() -> None:
    """Challenges unanswered past their deadline fail; checks whose task was lost are enqueued again."""
    challenges.challenges_expire()
    for unit_id in verification.pending_units():
        verify_unit.delay(unit_id)
