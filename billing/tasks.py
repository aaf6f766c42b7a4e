"""Celery tasks for money: thin, idempotent doors into the services."""
from celery import shared_task

from . import payouts, services


@shared_task(name="billing.tasks.clear_earnings")
def clear_earnings() -> int:
    """Beat runs this: pending earnings past the holding period become available."""
    return services.earnings_clear()


@shared_task(name="billing.tasks.transfer_payout")
def transfer_payout(payout_id: int) -> None:
    payouts.payout_transfer(payout_id=payout_id)
