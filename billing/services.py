"""Money-moving services. Each is one balanced transaction with an idempotency key, run atomically with
the accounts it checks locked."""
from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from django.conf import settings
from django.db import transaction

from muninn.errors import InvalidInput, MuninnError

from . import money, selectors
from .models import Account, Entry, Transaction

log = logging.getLogger(__name__)
Kind = Account.Kind


class InsufficientBalance(MuninnError):
    code = "insufficient_balance"
    status = 402


def account_for(*, kind: str, owner=None) -> Account:
    key = f"user:{owner.pk}:{kind}" if owner is not None else f"platform:{kind}"
    account, _ = Account.objects.get_or_create(key=key, defaults={"kind": kind, "owner": owner})
    return account


def ledger_post(*, key: str, kind: str, lines: Sequence[tuple[Account, int]], memo: str = "", job=None,
                unit=None, unit_id: int | None = None, flops: int = 0, created_by=None) -> Transaction:
    """Post one balanced transaction, once: a second call with the same key returns the first."""
    if sum(amount for _, amount in lines) != 0:
        raise ValueError(f"unbalanced transaction {key}: {[(a.key, n) for a, n in lines]}")
    with transaction.atomic():
        existing = Transaction.objects.filter(idempotency_key=key).first()
        if existing:
            return existing
        txn = Transaction.objects.create(idempotency_key=key, kind=kind, memo=memo[:500], job=job, unit=unit,
                                         flops=flops, created_by=created_by,
                                         **({"unit_id": unit_id} if unit_id is not None else {}))
        Entry.objects.bulk_create([Entry(transaction=txn, account=a, amount=n) for a, n in lines if n])
    return txn


def _locked(account: Account) -> Account:
    return Account.objects.select_for_update().get(pk=account.pk)


def balance_grant(*, user, amount: int, reason: str, granted_by, key: str | None = None) -> Transaction:
    """Staff credit a customer's balance by hand (no payment provider involved), with a reason on record."""
    if amount <= 0:
        raise InvalidInput("A credit must be a positive amount.", code="bad_amount")
    if not reason.strip():
        raise InvalidInput("A manual credit needs a reason.", code="reason_required")
    return ledger_post(
        key=key or f"grant:{uuid.uuid4()}", kind=Transaction.Kind.GRANT, memo=reason, created_by=granted_by,
        lines=[(account_for(kind=Kind.PLATFORM_GRANTS), -amount),
               (account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=user), amount)],
    )


def hold_place(*, job) -> Transaction:
    """Move the job's quoted price from the customer's balance to held. Refused if the balance is short."""
    price = money.price_for_flops(job.flops_estimated, settings.MUNINN_PRICE_PER_HU, round_up=True)
    with transaction.atomic():
        available = _locked(account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=job.owner))
        balance = selectors.account_balance(account=available)
        key = f"hold:job:{job.pk}"
        if balance < price and not Transaction.objects.filter(idempotency_key=key).exists():
            cur = settings.MUNINN_CURRENCY
            raise InsufficientBalance(
                f"This job costs {money.format_money(price, cur)} but your balance is "
                f"{money.format_money(balance, cur)}. Top up and try again.",
                detail={"price": price, "balance": balance},
            )
        return ledger_post(
            key=key, kind=Transaction.Kind.HOLD, job=job, flops=job.flops_estimated,
            memo=f"hold for job {job.pk} ({money.format_money(price, settings.MUNINN_CURRENCY)})",
            lines=[(available, -price), (account_for(kind=Kind.CUSTOMER_HELD, owner=job.owner), price)],
        )


def unit_charge(*, unit, contributor) -> Transaction:
    """Charge one verified unit's HU from the job's hold: the contributor's share to their pending earnings,
    the rest to the platform. Never more than what is left of the hold, never twice for one unit.

    A unit is priced as the step in the job's cumulative price (money.step_price), so the job's charges add
    up to floor(price(all charged FLOPs)), within one nano of the exact price, however small the units."""
    job = unit.round.job
    key = f"charge:unit:{unit.pk}"
    with transaction.atomic():
        held = _locked(account_for(kind=Kind.CUSTOMER_HELD, owner=job.owner))  # serialises a job's charges
        existing = Transaction.objects.filter(idempotency_key=key).first()
        if existing:
            return existing
        amount = money.step_price(selectors.job_flops_charged(job=job), unit.flops, settings.MUNINN_PRICE_PER_HU)
        remaining = selectors.job_hold_remaining(job=job)
        if amount > remaining:  # cannot happen with floor/ceil rounding; the quote stays a ceiling anyway
            log.warning("unit %s: charge %s capped at the hold's remaining %s", unit.pk, amount, remaining)
            amount = remaining
        to_contributor, fee = money.split_charge(amount, settings.MUNINN_CONTRIBUTOR_SHARE)
        return ledger_post(
            key=key, kind=Transaction.Kind.CHARGE, job=job, unit=unit, flops=unit.flops,
            memo=f"job {job.pk} round {unit.round.number} unit {unit.pk}",
            lines=[(held, -amount),
                   (account_for(kind=Kind.CONTRIBUTOR_PENDING, owner=contributor), to_contributor),
                   (account_for(kind=Kind.PLATFORM_FEE), fee)],
        )


def earnings_forfeit(*, contributor, units, reason: str) -> list[Transaction]:
    """Take back the contributor's pending share of these units' charges (work later found untrustworthy):
    it returns to the customers who paid it. Once per unit."""
    pending = account_for(kind=Kind.CONTRIBUTOR_PENDING, owner=contributor)
    posted = []
    for charge in Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit__in=units).select_related("job"):
        share = sum(e.amount for e in charge.entries.filter(account=pending))
        if share <= 0:
            continue
        posted.append(ledger_post(
            key=f"forfeit:unit:{charge.unit_id}", kind=Transaction.Kind.FORFEIT, job=charge.job, unit_id=charge.unit_id,
            memo=f"forfeited: {reason}",
            lines=[(pending, -share), (account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=charge.job.owner), share)],
        ))
    return posted


def hold_release(*, job) -> Transaction | None:
    """At the job's end, what is left of its hold goes back to the customer's balance."""
    with transaction.atomic():
        held = _locked(account_for(kind=Kind.CUSTOMER_HELD, owner=job.owner))
        remaining = selectors.job_hold_remaining(job=job)
        if remaining <= 0:
            return None
        return ledger_post(
            key=f"release:job:{job.pk}", kind=Transaction.Kind.RELEASE, job=job,
            memo=f"unused hold of job {job.pk} ({job.status})",
            lines=[(held, -remaining), (account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=job.owner), remaining)],
        )
