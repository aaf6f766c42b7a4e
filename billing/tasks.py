"""Celery tasks for money: thin, idempotent doors into the services."""
from datetime import timedelta

from celery import shared_task
from django.utils import timezone

from . import payouts, services


@shared_task(name="billing.tasks.clear_earnings")
def clear_earnings() -> int:
    """Beat runs this: pending earnings past the holding period become available."""
    return services.earnings_clear()


@shared_task(name="billing.tasks.transfer_payout")
def transfer_payout(payout_id: int) -> None:
    payouts.payout_transfer(payout_id=payout_id)


@shared_task(name="billing.tasks.retry_approved_payouts")
def retry_approved_payouts() -> int:
    """Beat runs this: payouts approved over five minutes ago but never transferred (the process died in
    between) are transferred now; Stripe's idempotency key makes a transfer that did happen come back as it was."""
    return payouts.payouts_retry_approved(older_than=timezone.now() - timedelta(minutes=5))
