"""Celery tasks of contributors/: re-execution runs on its own queue ("validation"), inside the trust
boundary, so that checking work never waits behind round tasks."""
from celery import shared_task

from . import verification


@shared_task(name="contributors.tasks.verify_unit")
def verify_unit(unit_id: int) -> None:
    verification.unit_verify(unit_id=unit_id)


@shared_task(name="contributors.tasks.sweep_pending_verifications")
def sweep_pending_verifications() -> None:
    for unit_id in verification.pending_units():
        verify_unit.delay(unit_id)
