"""Reads on the ledger. Balances are always derived from entries."""
from __future__ import annotations

from django.conf import settings
from django.db.models import QuerySet, Sum
from django.shortcuts import get_object_or_404

from accounts.models import User
from jobs import selectors as job_selectors
from jobs import services as job_services
from jobs.hu import hu_str
from muninn import sql

from . import money, pricing
from .models import Account, CreditAudit, Entry, Payout, Quote, Transaction


def account_balance(*, account: Account) -> int:
    return Entry.objects.filter(account=account).aggregate(s=Sum("amount"))["s"] or 0


def balances_for(*, user) -> dict[str, int]:
    rows = Entry.objects.filter(account__owner=user).values("account__kind").annotate(s=Sum("amount"))
    return {row["account__kind"]: row["s"] for row in rows}


def job_hold_remaining(*, job) -> int:
    return Entry.objects.filter(
        account__kind=Account.Kind.CUSTOMER_HELD, account__owner_id=job.owner_id, transaction__job=job,
    ).aggregate(s=Sum("amount"))["s"] or 0


def job_flops_charged(*, job) -> int:
    return Transaction.objects.filter(job=job, kind=Transaction.Kind.CHARGE).aggregate(f=Sum("flops"))["f"] or 0


def job_money(*, job) -> dict[str, int]:
    """What the job was quoted (held), charged so far (its verified work and, once it succeeded, what the minimum
    charge per job added: `minimum`), released back, and still holds, from the entries on the customer's held
    account that carry this job."""
    rows = (Entry.objects.filter(transaction__job=job, account__kind=Account.Kind.CUSTOMER_HELD)
            .values("transaction__kind").annotate(s=Sum("amount")))
    by_kind = {row["transaction__kind"]: row["s"] for row in rows}
    return {"quoted": by_kind.get("hold", 0),
            "charged": -by_kind.get("charge", 0) - by_kind.get("minimum_charge", 0),  # verified work and the minimum
            "minimum": -by_kind.get("minimum_charge", 0), "released": -by_kind.get("release", 0),
            "held": sum(by_kind.values()),
            "flops_charged": job_flops_charged(job=job)}


def job_charges(job) -> dict:
    """A job's HU and money as its certificate states them: the HU and FLOPs quoted and charged (verified work), and
    the amounts quoted, charged and released, in nano-units of the currency and written out exactly."""
    m, currency = job_money(job=job), settings.MUNINN_CURRENCY
    return {"currency": currency, "hu_quoted": hu_str(job.hu_estimated),
            "hu_charged": hu_str(money.flops_to_hu(m["flops_charged"])),
            "flops_quoted": job.flops_estimated, "flops_charged": m["flops_charged"],
            **{f"{kind}_nanos": m[kind] for kind in ("quoted", "charged", "released")},
            **{kind: money.format_money(m[kind], currency, exact=True) for kind in ("quoted", "charged", "released")}}


def units_with_open_earnings(*, units):
    """The ids of the charged units among `units` whose earnings have neither cleared nor been forfeited."""
    return (Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit__in=units)
            .exclude(followups__kind__in=[Transaction.Kind.CLEAR, Transaction.Kind.FORFEIT])
            .values_list("unit_id", flat=True))


def earnings_held(*, units) -> int:
    """How much of the earnings for `units` is held for review now (holds less releases and forfeits)."""
    return Entry.objects.filter(account__kind=Account.Kind.CONTRIBUTOR_HELD,
                                transaction__unit__in=units).aggregate(s=Sum("amount"))["s"] or 0


def statement_for(*, user) -> QuerySet[Entry]:
    """Every entry that touched the user's accounts, newest first, with the job, round and unit it came from."""
    return (Entry.objects.filter(account__owner=user)
            .select_related("transaction", "account", "transaction__unit__round", "transaction__payout")
            .order_by("-id"))


def quotes_for(*, customer) -> QuerySet[Quote]:
    return Quote.objects.filter(customer=customer)


def quote_tier(quote: Quote) -> dict:
    """The quote's device tier as pages and the API show it: its name, memory, the backend the units go to, the
    line that names them, and the warning when no capable device has been seen lately."""
    tier = next(t for t in pricing.TIERS if t.name == quote.device_tier)
    backends = job_services.template_backends(quote.template)
    return {"name": tier.name, "memory_bytes": tier.memory_bytes, "backends": list(backends),
            "description": pricing.tier_line(tier, backends).split(" — ", 1)[1],
            "line": pricing.tier_line(tier, backends),
            "warning": pricing.no_device_warning(
                devices_online=quote.devices_online, devices_recent=quote.devices_recent, tier=tier, backends=backends,
                recent=job_selectors.span(settings.MUNINN_DEVICE_RECENT_SECONDS),
                wait_limit=job_selectors.span(settings.MUNINN_JOB_WAIT_LIMIT))}


def quote_get(*, customer, quote_id) -> Quote:
    return get_object_or_404(quotes_for(customer=customer), pk=quote_id)


def payouts_for(*, contributor) -> QuerySet[Payout]:
    return Payout.objects.filter(contributor=contributor).order_by("-requested_at")


def user_balances() -> dict[str, int]:
    """Each person's account balance by account key (the ones that must never go below zero)."""
    rows = (Entry.objects.filter(account__kind__in=Account.USER_KINDS).values("account__key")
            .annotate(s=Sum("amount")))
    return {row["account__key"]: row["s"] for row in rows}


def ledger_total() -> int:
    """The sum of every entry ever posted: zero, always."""
    return Entry.objects.aggregate(s=Sum("amount"))["s"] or 0


def topups_for(*, customer) -> QuerySet:
    from .models import TopUp

    return TopUp.objects.filter(customer=customer).order_by("-created_at")


def payout_account_for(*, contributor):
    from .models import PayoutAccount

    return PayoutAccount.objects.filter(contributor=contributor).first()


def payouts_requested() -> QuerySet[Payout]:
    """The staff's review queue: requests waiting for a decision, oldest first."""
    return Payout.objects.filter(status=Payout.Status.REQUESTED).select_related("contributor").order_by("requested_at")


def customer_named(*, username: str):
    """The customer account with this username, or None (another role's account is not a customer)."""
    return User.objects.filter(username=username, role=User.Role.CUSTOMER).first()


def credits_recent(*, limit: int = 50) -> QuerySet[CreditAudit]:
    """The latest manual credits with who gave them and why, newest first (the staff's audit)."""
    return CreditAudit.objects.select_related("customer", "actor", "transaction")[:limit]


def unit_earned(*, unit) -> int:
    """What the unit's charge put in its contributor's pending earnings (nanos; 0 before it is charged). One fixed
    statement (muninn/sql.py): every accepted result's answer says it."""
    return int(sql.fetch_one(
        f"SELECT COALESCE(SUM(e.amount), 0) FROM {sql.table(Entry)} e "
        f"JOIN {sql.table(Transaction)} t ON t.id = e.transaction_id "
        f"JOIN {sql.table(Account)} a ON a.id = e.account_id "
        "WHERE t.kind = %s AND t.unit_id = %s AND a.kind = %s",
        [Transaction.Kind.CHARGE, unit.pk, Account.Kind.CONTRIBUTOR_PENDING])[0])


def units_earned(*, units) -> int:
    """What the charges of `units` put in their contributors' pending earnings, together (nanos): unit_earned
    summed in one query."""
    return Entry.objects.filter(transaction__kind=Transaction.Kind.CHARGE, transaction__unit__in=units,
                                account__kind=Account.Kind.CONTRIBUTOR_PENDING).aggregate(s=Sum("amount"))["s"] or 0
