"""Customer top-ups through Stripe Checkout, and Stripe's webhooks: each event verified, stored once by its id
with a handler status, and handled at most once (a replay or a concurrent duplicate changes nothing)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from muninn.errors import InvalidInput, MuninnError

from . import money, stripe_gateway
from .models import Account, Payout, PayoutAccount, StripeEvent, TopUp, Transaction
from .services import account_for, ledger_post

log = logging.getLogger(__name__)


def topup_start(*, customer, amount: Decimal) -> TopUp:
    """A Checkout Session for `amount` (in the currency, e.g. Decimal("20.00")); the customer pays on Stripe's page
    and the checkout.session.completed webhook credits the balance."""
    stripe_gateway.require_configured("Top-ups")
    currency = settings.MUNINN_CURRENCY
    low, high = settings.MUNINN_TOPUP_MIN, settings.MUNINN_TOPUP_MAX
    if not low <= amount <= high:
        raise InvalidInput(f"A top-up must be between {money.format_money(money.to_nanos(low), currency)} and "
                           f"{money.format_money(money.to_nanos(high), currency)}.",
                           code="below_minimum" if amount < low else "above_maximum",
                           detail={"minimum": str(low), "maximum": str(high)})
    try:
        nanos = money.to_nanos(amount)
        minor = money.to_minor(nanos, currency)
    except ValueError as e:
        raise InvalidInput(f"{amount} is not a whole number of cents.", code="bad_amount") from e
    topup = TopUp.objects.create(customer=customer, amount=nanos, currency=currency)
    session = stripe_gateway.checkout_session_create(
        amount_minor=minor, currency=currency, customer_email=customer.email, client_reference_id=str(topup.pk),
        success_url=f"{settings.MUNINN_SITE_URL}/balance/?topup={topup.pk}",
        cancel_url=f"{settings.MUNINN_SITE_URL}/balance/",
        idempotency_key=f"topup-{topup.pk}")
    topup.stripe_session_id, topup.checkout_url = session.id, session.url
    topup.save(update_fields=["stripe_session_id", "checkout_url"])
    return topup


def _on_checkout_completed(session: dict) -> None:
    if session.get("payment_status") != "paid":
        return  # delayed payment methods complete later; we credit only money that has arrived
    topup = TopUp.objects.select_for_update().filter(stripe_session_id=session["id"]).first()
    if topup is None:
        raise InvalidInput(f"No top-up has Checkout Session {session['id']}.", code="unknown_session")
    paid = money.from_minor(int(session.get("amount_total") or 0), topup.currency)
    if paid != topup.amount or str(session.get("currency", "")).upper() != topup.currency:
        raise InvalidInput(f"Top-up {topup.pk}: Stripe reports {session.get('amount_total')} "
                           f"{session.get('currency')}, we asked for {topup.amount} nanos.", code="amount_mismatch")
    ledger_post(key=f"topup:{topup.pk}", kind=Transaction.Kind.TOPUP,
                memo=f"top-up {topup.pk} (Stripe {session['id']})",
                lines=[(account_for(kind=Account.Kind.STRIPE_CLEARING), -topup.amount),
                       (account_for(kind=Account.Kind.CUSTOMER_AVAILABLE, owner=topup.customer), topup.amount)])
    if topup.status != TopUp.Status.PAID:
        topup.status, topup.paid_at = TopUp.Status.PAID, timezone.now()
        topup.save(update_fields=["status", "paid_at"])


def _on_account_updated(account: dict) -> None:
    PayoutAccount.objects.filter(stripe_account_id=account["id"]).update(
        details_submitted=bool(account.get("details_submitted")), payouts_enabled=bool(account.get("payouts_enabled")),
        updated_at=timezone.now())


def _on_transfer_reversed(transfer: dict) -> None:
    from .payouts import payout_transfer_reversed

    payout = Payout.objects.filter(stripe_transfer_id=transfer["id"]).first()
    if payout is None:
        raise InvalidInput(f"No payout has transfer {transfer['id']}.", code="unknown_transfer")
    payout_transfer_reversed(payout_id=payout.pk, reason="Stripe reversed the transfer")


HANDLERS: dict[str, Callable[[dict], None]] = {
    "checkout.session.completed": _on_checkout_completed,
    "account.updated": _on_account_updated,
    "transfer.reversed": _on_transfer_reversed,
}


def webhook_receive(*, payload: bytes, signature: str) -> StripeEvent:
    """Verify, store once, handle once. A bad signature or an event type we do not handle changes nothing."""
    event = stripe_gateway.webhook_event(payload=payload, signature=signature)
    if event.get("type") not in HANDLERS:
        raise InvalidInput(f"Muninn does not handle Stripe events of type {event.get('type')!r}.",
                           code="unknown_event_type", detail={"handled": sorted(HANDLERS)})
    try:
        stored, _ = StripeEvent.objects.get_or_create(
            stripe_id=event["id"], defaults={"type": event["type"], "payload": event})
    except IntegrityError:  # a concurrent duplicate inserted it first
        stored = StripeEvent.objects.get(stripe_id=event["id"])
    with transaction.atomic():
        stored = StripeEvent.objects.select_for_update().get(pk=stored.pk)  # duplicates wait here, then no-op
        if stored.status == StripeEvent.Status.PROCESSED:
            return stored
        try:
            with transaction.atomic():
                HANDLERS[stored.type](stored.payload["data"]["object"])
            stored.status, stored.error = StripeEvent.Status.PROCESSED, ""
        except MuninnError as e:
            log.warning("stripe event %s (%s) failed: %s", stored.stripe_id, stored.type, e.message)
            stored.status, stored.error = StripeEvent.Status.FAILED, f"{e.code}: {e.message}"
        stored.processed_at = timezone.now()
        stored.save(update_fields=["status", "error", "processed_at"])
    return stored
