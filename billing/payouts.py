"""Contributor payouts: Stripe Connect onboarding, requests of available earnings, staff review (approve → a
Stripe Transfer, or reject with a reason), failed or reversed transfers back to available. Every decision is
audited (who, when, why); the ledger moves available → in review → paid out (or back to available)."""
from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from muninn.errors import Conflict, InvalidInput, NotFound

from . import money, selectors, stripe_gateway
from .models import Account, Payout, PayoutAccount, PayoutAudit, Transaction
from .services import InsufficientBalance, account_for, ledger_post, locked

Kind = Account.Kind


def payout_account_onboard(*, contributor) -> str:
    """The Stripe-hosted onboarding link for the contributor's Express account (created on first use)."""
    stripe_gateway.require_configured("Payouts")
    account = PayoutAccount.objects.filter(contributor=contributor).first()
    if account is None:
        account_id = stripe_gateway.connect_account_create(email=contributor.email,
                                                           idempotency_key=f"connect-account-user-{contributor.pk}")
        account, _ = PayoutAccount.objects.get_or_create(contributor=contributor,
                                                         defaults={"stripe_account_id": account_id})
    return stripe_gateway.account_link_create(
        account_id=account.stripe_account_id, refresh_url=f"{settings.MUNINN_SITE_URL}/contribute/?payouts=refresh",
        return_url=f"{settings.MUNINN_SITE_URL}/contribute/?payouts=done")


def _audit(payout: Payout, action: str, actor=None, reason: str = "") -> None:
    PayoutAudit.objects.create(payout=payout, action=action, actor=actor, reason=reason)


def payout_request(*, contributor, amount: int) -> Payout:
    """Ask for `amount` nanos (whole cents, at least MUNINN_PAYOUT_MIN) of the available earnings. The amount
    moves to "in review" at once, so two requests can never spend the same money."""
    currency = settings.MUNINN_CURRENCY
    minimum = money.to_nanos(settings.MUNINN_PAYOUT_MIN)
    if amount < minimum:
        raise InvalidInput(f"The smallest payout is {money.format_money(minimum, currency)}.", code="below_minimum",
                           detail={"minimum": minimum})
    if amount % money.nanos_per_minor(currency):
        raise InvalidInput("A payout must be a whole number of cents.", code="bad_amount")
    account = PayoutAccount.objects.filter(contributor=contributor).first()
    if account is None or not account.payouts_enabled:
        raise Conflict("Finish setting up your Stripe payout account first (POST /api/payouts/onboarding).",
                       code="payout_account_not_ready")
    with transaction.atomic():
        available = locked(account_for(kind=Kind.CONTRIBUTOR_AVAILABLE, owner=contributor))
        balance = selectors.account_balance(account=available)
        if amount > balance:
            raise InsufficientBalance(
                f"You asked for {money.format_money(amount, currency)} but "
                f"{money.format_money(balance, currency, exact=True)} "
                "of your earnings is available (pending earnings become available after the holding period).",
                code="above_available", detail={"amount": amount, "available": balance})
        payout = Payout.objects.create(contributor=contributor, amount=amount, currency=currency)
        ledger_post(key=f"payout:{payout.pk}:request", kind=Transaction.Kind.PAYOUT_REQUEST, payout=payout,
                    memo=f"payout {payout.pk} requested",
                    lines=[(available, -amount),
                           (account_for(kind=Kind.CONTRIBUTOR_IN_REVIEW, owner=contributor), amount)])
        _audit(payout, "requested", contributor)
    return payout


def _locked_payout(payout_id: int) -> Payout:
    payout = Payout.objects.select_for_update().filter(pk=payout_id).first()
    if payout is None:
        raise NotFound(f"There is no payout {payout_id}.")
    return payout


def _decided(payout: Payout) -> Conflict:
    by = f" by {payout.reviewed_by} at {payout.reviewed_at:%Y-%m-%d %H:%M:%S}" if payout.reviewed_by else ""
    return Conflict(f"Payout {payout.pk} was already decided{by}: it is {payout.status}.", code="already_decided")


def payout_approve(*, payout_id: int, staff, reason: str = "") -> Payout:
    """Approve a requested payout and transfer it. Two staff approving at once: the row lock lets one through,
    the other is told it was already decided, and Stripe is asked once (with an idempotency key, besides)."""
    with transaction.atomic():
        payout = _locked_payout(payout_id)
        if payout.status != Payout.Status.REQUESTED:
            raise _decided(payout)
        payout.status, payout.reviewed_by, payout.reviewed_at = Payout.Status.APPROVED, staff, timezone.now()
        payout.review_reason = reason
        payout.save(update_fields=["status", "reviewed_by", "reviewed_at", "review_reason"])
        _audit(payout, "approved", staff, reason)
    return payout_transfer(payout_id=payout.pk)


def payout_transfer(*, payout_id: int) -> Payout:
    """Send an approved payout to the contributor's connected account. Safe to run again (e.g. after a crash
    between approval and transfer): Stripe's idempotency key is the payout's id."""
    payout = Payout.objects.select_related("contributor__payout_account").get(pk=payout_id)
    if payout.status != Payout.Status.APPROVED:
        return payout
    try:
        transfer_id = stripe_gateway.transfer_create(
            amount_minor=money.to_minor(payout.amount, payout.currency), currency=payout.currency,
            destination=payout.contributor.payout_account.stripe_account_id,
            idempotency_key=f"payout-{payout.pk}", metadata={"muninn_payout": str(payout.pk)})
    except stripe_gateway.PaymentProviderError as e:
        return _payout_return(payout_id=payout.pk, from_status=Payout.Status.APPROVED, to_status=Payout.Status.FAILED,
                              from_kind=Kind.CONTRIBUTOR_IN_REVIEW, action="failed", reason=e.message)
    with transaction.atomic():
        payout = _locked_payout(payout_id)
        if payout.status != Payout.Status.APPROVED:
            return payout
        ledger_post(key=f"payout:{payout.pk}:paid", kind=Transaction.Kind.PAYOUT, payout=payout,
                    memo=f"payout {payout.pk} transferred (Stripe {transfer_id})",
                    lines=[(locked(account_for(kind=Kind.CONTRIBUTOR_IN_REVIEW, owner=payout.contributor)),
                            -payout.amount),
                           (account_for(kind=Kind.CONTRIBUTOR_PAID_OUT, owner=payout.contributor), payout.amount)])
        payout.status, payout.stripe_transfer_id = Payout.Status.PAID, transfer_id
        payout.save(update_fields=["status", "stripe_transfer_id"])
        _audit(payout, "transferred", None, transfer_id)
    return payout


def payout_reject(*, payout_id: int, staff, reason: str) -> Payout:
    if not reason.strip():
        raise InvalidInput("Say why the payout is rejected: the contributor sees the reason.", code="reason_required")
    with transaction.atomic():
        payout = _locked_payout(payout_id)
        if payout.status != Payout.Status.REQUESTED:
            raise _decided(payout)
        payout.reviewed_by, payout.reviewed_at, payout.review_reason = staff, timezone.now(), reason
        payout.save(update_fields=["reviewed_by", "reviewed_at", "review_reason"])
        return _payout_return(payout_id=payout.pk, from_status=Payout.Status.REQUESTED,
                              to_status=Payout.Status.REJECTED, from_kind=Kind.CONTRIBUTOR_IN_REVIEW,
                              action="rejected", reason=reason, actor=staff)


def payout_transfer_reversed(*, payout_id: int, reason: str) -> Payout:
    """Stripe reversed a transfer we made: the money is the contributor's again, available."""
    return _payout_return(payout_id=payout_id, from_status=Payout.Status.PAID, to_status=Payout.Status.REVERSED,
                          from_kind=Kind.CONTRIBUTOR_PAID_OUT, action="reversed", reason=reason)


def _payout_return(*, payout_id: int, from_status: str, to_status: str, from_kind: str, action: str, reason: str,
                   actor=None) -> Payout:
    with transaction.atomic():
        payout = _locked_payout(payout_id)
        if payout.status != from_status:
            return payout
        ledger_post(key=f"payout:{payout.pk}:return", kind=Transaction.Kind.PAYOUT_RETURN, payout=payout,
                    memo=f"payout {payout.pk} {action}: {reason}", created_by=actor,
                    lines=[(locked(account_for(kind=from_kind, owner=payout.contributor)), -payout.amount),
                           (account_for(kind=Kind.CONTRIBUTOR_AVAILABLE, owner=payout.contributor), payout.amount)])
        payout.status = to_status
        if to_status != Payout.Status.REJECTED:
            payout.failure = reason
        payout.save(update_fields=["status", "failure"])
        _audit(payout, action, actor, reason)
    return payout


def payouts_retry_approved(*, older_than: datetime | None = None) -> int:
    """Transfers for payouts left approved (the process died between approval and transfer)."""
    qs = Payout.objects.filter(status=Payout.Status.APPROVED)
    if older_than is not None:
        qs = qs.filter(reviewed_at__lt=older_than)
    ids = list(qs.values_list("id", flat=True))
    for payout_id in ids:
        payout_transfer(payout_id=payout_id)
    return len(ids)
