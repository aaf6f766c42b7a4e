"""Money-moving services on the ledger: quotes, holds, unit charges, releases, clearing, earnings held for review
and their release or forfeiture, and manual credits.
Each movement is one balanced transaction with an idempotency key, run atomically with the accounts it checks
locked. Top-ups are in payments.py, payouts in payouts.py."""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from accounts.models import User
from jobs import services as job_services
from muninn.errors import Conflict, InvalidInput, MuninnError, NotFound

from . import money, pricing, selectors
from .models import Account, CreditAudit, Entry, Quote, Transaction

log = logging.getLogger(__name__)
Kind = Account.Kind
# (min_memory_bytes=..., backends=...) -> [(device id, measured FLOP/s)] of the capable devices online now. Passed
# in by the caller (contributors/ knows devices; billing/ sits below it).
OnlineCapacity = Callable[..., Sequence[tuple[int, float]]]
# (min_memory_bytes=..., backends=...) -> how many capable devices were seen within MUNINN_DEVICE_RECENT_SECONDS.
RecentCapable = Callable[..., int]


class InsufficientBalance(MuninnError):
    code = "insufficient_balance"
    status = 402


class QuoteExpired(MuninnError):
    code = "quote_expired"
    status = 410


def account_for(*, kind: str, owner=None) -> Account:
    key = f"user:{owner.pk}:{kind}" if owner is not None else f"platform:{kind}"
    account, _ = Account.objects.get_or_create(key=key, defaults={"kind": kind, "owner": owner})
    return account


def ledger_post(*, key: str, kind: str, lines: Sequence[tuple[Account, int]], memo: str = "", job=None,
                unit=None, flops: int = 0, source=None, payout=None, created_by=None) -> Transaction:
    """Post one balanced transaction, once: a second call with the same key returns the first."""
    if sum(amount for _, amount in lines) != 0:
        raise ValueError(f"unbalanced transaction {key}: {[(a.key, n) for a, n in lines]}")
    with transaction.atomic():
        existing = Transaction.objects.filter(idempotency_key=key).first()
        if existing:
            return existing
        txn = Transaction.objects.create(idempotency_key=key, kind=kind, memo=memo[:500], job=job, unit=unit,
                                         flops=flops, source=source, payout=payout, created_by=created_by)
        Entry.objects.bulk_create([Entry(transaction=txn, account=a, amount=n) for a, n in lines if n])
    return txn


def locked(account: Account) -> Account:
    return Account.objects.select_for_update().get(pk=account.pk)


def _fmt(nanos: int) -> str:
    """Amounts in memos and audit reasons are exact: they are the statement's details."""
    return money.format_money(nanos, settings.MUNINN_CURRENCY, exact=True)


def balance_grant(*, user, amount: int, reason: str, granted_by, key: str | None = None) -> Transaction:
    """Credit a customer's balance by hand (no payment provider involved): a `grant` on the ledger and its audit
    row (who, to whom, how much, when, why), once per key. `granted_by` is the staff member, or None for the
    automatic demo credit (`demo_credit_grant`)."""
    if getattr(user, "role", None) != User.Role.CUSTOMER:
        raise InvalidInput(f"{user} is not a customer account; only customers have a balance to credit.",
                           code="not_a_customer")
    if amount <= 0:
        raise InvalidInput("A credit must be a positive amount.", code="bad_amount")
    if not reason.strip():
        raise InvalidInput("A manual credit needs a reason.", code="reason_required")
    with transaction.atomic():
        txn = ledger_post(
            key=key or f"grant:{uuid.uuid4()}", kind=Transaction.Kind.GRANT, memo=reason, created_by=granted_by,
            lines=[(account_for(kind=Kind.PLATFORM_GRANTS), -amount),
                   (account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=user), amount)],
        )
        CreditAudit.objects.get_or_create(transaction=txn, defaults={
            "customer": user, "amount": amount, "actor": granted_by, "reason": reason.strip()})
    return txn


def demo_credit_grant(*, user) -> Transaction | None:
    """The demo credit a new customer gets on sign-up when MUNINN_DEMO_CREDIT is set (`make run` sets it, so the
    embedded default is usable end to end without Stripe); None when it is unset or 0, or for other roles."""
    amount = money.to_nanos(settings.MUNINN_DEMO_CREDIT)
    if amount <= 0 or user.role != User.Role.CUSTOMER:
        return None
    return balance_grant(user=user, amount=amount, reason="demo credit on sign-up (MUNINN_DEMO_CREDIT)",
                         granted_by=None, key=f"grant:demo-credit:{user.pk}")


# --- Quotes ---------------------------------------------------------------------------------------

def quote_issue(*, customer, dataset, template: str, hparams: dict, rounds: int, base_weights=None,
                aggregation: str = "fedavg", training: dict | None = None,
                online_capacity: OnlineCapacity | None = None, recent_capable: RecentCapable | None = None,
                now: datetime | None = None) -> Quote:
    """Price a job before it exists: HU and price (its work at the rate, rounded up, and at least the minimum charge
    per job, which the quote keeps: see minimum_charge_settle), the device
    tier its peak memory needs, the wall time the devices online now should take, and how many capable devices
    were seen lately (`recent_capable`; none: the quote warns). Valid for MUNINN_QUOTE_TTL_SECONDS. The quote
    keeps the training algorithm's settings (`training`, see jobs.services.job_plan), which the job is created
    with."""
    plan = job_services.job_plan(dataset=dataset, template=template, hparams=hparams, rounds=rounds,
                                 base_weights=base_weights, training=training)
    est = plan.estimate
    try:
        tier = pricing.device_tier(est.peak_memory_bytes)
    except pricing.TooBigForAnyTier as e:
        raise InvalidInput(f"This model is too big for any device: {e}.", code="too_big") from e
    devices = (list(online_capacity(min_memory_bytes=est.peak_memory_bytes, backends=plan.backends,
                                    template=template)) if online_capacity else [])
    flops_per_round = est.flops_per_round
    if est.units_per_round:  # DiLoCo: the price counts the most units a round can have; the time, those online
        flops_per_round = flops_per_round // est.units_per_round * min(est.units_per_round, max(1, len(devices)))
    now = now or timezone.now()
    rate = settings.MUNINN_PRICE_PER_HU
    minimum = money.to_nanos(settings.MUNINN_MIN_CHARGE_PER_JOB)
    return Quote.objects.create(
        customer=customer, dataset=dataset, template=template, hparams=plan.hparams, rounds=rounds,
        base_weights=base_weights, aggregation=aggregation, **plan.scheme.fields(), flops=est.flops_total,
        price=money.quote_price(est.flops_total, rate, minimum=minimum),
        work_price=money.price_for_flops(est.flops_total, rate, round_up=True), minimum_charge=minimum,
        price_per_hu=rate,
        currency=settings.MUNINN_CURRENCY,
        peak_memory_bytes=est.peak_memory_bytes, device_tier=tier.name, devices_online=len(devices),
        devices_recent=(recent_capable(min_memory_bytes=est.peak_memory_bytes, backends=plan.backends,
                                       template=template) if recent_capable else None),
        expected_seconds=pricing.expected_wall_seconds(
            flops_per_round=flops_per_round, rounds=rounds, device_flops_per_s=[speed for _, speed in devices],
            round_overhead_seconds=settings.MUNINN_ROUND_OVERHEAD_SECONDS),
        expires_at=now + timedelta(seconds=settings.MUNINN_QUOTE_TTL_SECONDS),
    )


def _quote_usable(quote: Quote, now: datetime) -> None:
    if quote.job_id is not None:
        raise Conflict(f"Quote {quote.pk} was already accepted for job {quote.job_id}.", code="quote_used")
    if quote.expires_at <= now:
        raise QuoteExpired(f"Quote {quote.pk} expired at {quote.expires_at:%Y-%m-%d %H:%M:%S} UTC; ask for a new one.",
                           detail={"expires_at": quote.expires_at.isoformat()})


def quote_accept(*, customer, quote_id, now: datetime | None = None):
    """Create the quoted job and start it: its hold is the quoted price. An expired or used quote changes nothing."""
    now = now or timezone.now()
    with transaction.atomic():
        quote = Quote.objects.select_for_update().filter(pk=quote_id, customer=customer).first()
        if quote is None:
            raise NotFound(f"There is no quote {quote_id}.")
        _quote_usable(quote, now)
        job = job_services.job_create(owner=customer, dataset=quote.dataset, template=quote.template,
                                      hparams=quote.hparams, rounds=quote.rounds, base_weights=quote.base_weights,
                                      aggregation=quote.aggregation, training=quote_training(quote))
        return job_services.job_start(job_id=job.pk, quote=str(quote.pk))


def _quote_for_start(*, job, quote_id, now: datetime) -> Quote:
    """The quote a starting job accepts: the one named (checked against the job), or, when the caller named none,
    one issued now from the job's own estimate."""
    if quote_id is None:
        quote = Quote.objects.select_for_update().filter(job=job).first()
        if quote is not None:
            return quote
        return quote_issue(customer=job.owner, dataset=job.dataset, template=job.template, hparams=job.hparams,
                           rounds=job.rounds, base_weights=job.base_weights, aggregation=job.aggregation,
                           training=job_services.job_scheme(job).fields(), now=now)
    try:
        quote = Quote.objects.select_for_update().filter(pk=quote_id, customer=job.owner).first()
    except ValidationError as e:  # not a UUID
        raise InvalidInput(f"{quote_id!r} is not a quote id.", code="bad_quote") from e
    if quote is None:
        raise NotFound(f"There is no quote {quote_id}.")
    if quote.job_id == job.pk:
        return quote
    _quote_usable(quote, now)
    if ((quote.dataset_id, quote.template, quote.rounds, quote.flops, quote_training(quote))
            != (job.dataset_id, job.template, job.rounds, job.flops_estimated, job_services.job_scheme(job).fields())):
        raise InvalidInput("The quote was for a different job (dataset, model, rounds, hyper-parameters or "
                           "training algorithm).", code="quote_mismatch")
    return quote


def quote_training(quote: Quote) -> dict:
    """The training algorithm's settings the quote priced, as jobs.services.job_plan takes them."""
    return {name: getattr(quote, name) for name in ("algorithm", "outer_lr", "outer_momentum", "inner_steps",
                                                    "update_encoding")}


def hold_place(*, job, quote_id=None, now: datetime | None = None) -> Transaction:
    """The starting job accepts its quote: the quoted price moves from the customer's balance to held. Refused
    if the balance is short or the quote expired; the caller's transaction then changes nothing."""
    now = now or timezone.now()
    key = f"hold:job:{job.pk}"
    with transaction.atomic():
        available = locked(account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=job.owner))
        existing = Transaction.objects.filter(idempotency_key=key).first()
        if existing:
            return existing
        quote = _quote_for_start(job=job, quote_id=quote_id, now=now)
        balance = selectors.account_balance(account=available)
        if balance < quote.price:
            raise InsufficientBalance(
                f"This job costs {money.format_money(quote.price, settings.MUNINN_CURRENCY, exact=True)} but your "
                f"balance is {money.format_money(balance, settings.MUNINN_CURRENCY, exact=True)}. Top up and try again.",
                detail={"price": quote.price, "balance": balance},
            )
        if quote.job_id is None:
            quote.job, quote.accepted_at = job, now
            quote.save(update_fields=["job", "accepted_at"])
        return ledger_post(
            key=key, kind=Transaction.Kind.HOLD, job=job, flops=quote.flops,
            memo=f"hold for job {job.pk} (quote {quote.pk}, {_fmt(quote.price)})",
            lines=[(available, -quote.price), (account_for(kind=Kind.CUSTOMER_HELD, owner=job.owner), quote.price)],
        )


def _quoted(job) -> tuple[int, int]:
    """(work price, FLOPs) of the quote the job accepted: what its verified work shares between its units. The
    minimum charge per job is not part of it: it is settled at the job's end and never changes what work earns."""
    return Quote.objects.filter(job=job).values_list("work_price", "flops").first() or (0, 0)


def unit_charge(*, unit, contributor) -> Transaction:
    """Charge one verified unit from the job's hold: the contributor's share to their pending earnings, the rest
    to the platform. Never more than what is left of the hold, never twice for one unit.

    A unit pays its part of the quoted work's price in proportion to its FLOPs (money.step_share), so the job's
    charges add up to exactly that when it does all its quoted work, and never more. Every verified unit
    earns its contributor at least MUNINN_MIN_EARNING_PER_UNIT: when the customer's part falls short (a tiny
    unit, or re-issued work beyond the estimate once the hold is used up), the platform's fee makes up the rest."""
    return unit_charges(job=unit.round.job, charges=[(unit, contributor)])[0]


def unit_charges(*, job, charges: Sequence[tuple]) -> list[Transaction]:
    """unit_charge for many verified units of one job at once, [(unit, contributor), ...], in this order: the
    job's hold locked, and its quote, charged FLOPs, remaining hold and accounts read once; each unit's charge is
    still its own balanced transaction with its own key (never twice for one unit, never more than the hold).
    Returns them in order (the first one's for a unit charged before)."""
    if not charges:
        return []
    with transaction.atomic():
        held = locked(account_for(kind=Kind.CUSTOMER_HELD, owner=job.owner))  # serialises a job's charges
        keys = [f"charge:unit:{unit.pk}" for unit, _ in charges]
        done = {t.idempotency_key: t for t in Transaction.objects.filter(idempotency_key__in=keys)}
        price, quoted_flops = _quoted(job)
        charged_flops = selectors.job_flops_charged(job=job)
        remaining = selectors.job_hold_remaining(job=job)
        fee_account = account_for(kind=Kind.PLATFORM_FEE)
        pending: dict[int, Account] = {}
        least = money.to_nanos(settings.MUNINN_MIN_EARNING_PER_UNIT)
        new, lines_of = [], []
        for (unit, contributor), key in zip(charges, keys):
            if key in done:
                continue
            amount = money.step_share(price, quoted_flops, charged_flops, unit.flops)
            if amount > remaining:  # re-issued or extra work beyond the estimate is the platform's cost
                log.warning("unit %s: charge %s capped at the hold's remaining %s", unit.pk, amount, remaining)
                amount = remaining
            to_contributor, fee = money.split_charge(amount, settings.MUNINN_CONTRIBUTOR_SHARE)
            top_up = max(0, least - to_contributor)
            if contributor.pk not in pending:
                pending[contributor.pk] = account_for(kind=Kind.CONTRIBUTOR_PENDING, owner=contributor)
            lines = [(held, -amount), (pending[contributor.pk], to_contributor + top_up), (fee_account, fee - top_up)]
            if sum(n for _, n in lines) != 0:
                raise ValueError(f"unbalanced transaction {key}")
            txn = Transaction(idempotency_key=key, kind=Transaction.Kind.CHARGE, job=job, unit=unit, flops=unit.flops,
                              memo=(f"job {job.pk} round {unit.round.number} unit {unit.pk}"
                                    + (f" (the platform adds {_fmt(top_up)}: the least a unit earns)"
                                       if top_up else ""))[:500])
            done[key] = txn
            new.append(txn)
            lines_of.append(lines)
            charged_flops += unit.flops
            remaining -= amount
        Transaction.objects.bulk_create(new)
        Entry.objects.bulk_create([Entry(transaction=txn, account=account, amount=n)
                                   for txn, lines in zip(new, lines_of) for account, n in lines if n])
    return [done[key] for key in keys]


def check_charge(*, job, check_id: int, flops: int, contributor, memo: str) -> Transaction:
    """A peer device's verified work checking another device's segment (contributors.peers), paid once per check
    at the contributor's share of what the job's work is priced at (its quote's price per FLOP), and never less
    than the least a unit earns. Verification is the platform's cost, never the customer's (the quote counts
    training only), so it comes out of the platform's fees; the job is named in the memo only, which keeps it out
    of the job's charges."""
    key = f"charge:check:{check_id}"
    with transaction.atomic():
        existing = Transaction.objects.filter(idempotency_key=key).first()
        if existing:
            return existing
        price, quoted_flops = _quoted(job)
        if quoted_flops:
            worth = price * flops // quoted_flops
        else:
            worth = money.price_for_flops(flops, settings.MUNINN_PRICE_PER_HU, round_up=False)
        to_contributor, _ = money.split_charge(worth, settings.MUNINN_CONTRIBUTOR_SHARE)
        to_contributor = max(to_contributor, money.to_nanos(settings.MUNINN_MIN_EARNING_PER_UNIT))
        return ledger_post(
            key=key, kind=Transaction.Kind.CHARGE, flops=flops, memo=memo,
            lines=[(account_for(kind=Kind.PLATFORM_FEE), -to_contributor),
                   (account_for(kind=Kind.CONTRIBUTOR_PENDING, owner=contributor), to_contributor)],
        )


def minimum_charge_settle(*, job) -> Transaction | None:
    """A job that succeeded pays at least its quote's minimum charge per job: when its verified work cost less, the
    difference moves from its hold to the platform's fees, once (money.minimum_top_up). Contributors' earnings do
    not change. A job that failed or was cancelled pays only for its verified work. None when nothing is due."""
    key = f"minimum:job:{job.pk}"
    with transaction.atomic():
        held = locked(account_for(kind=Kind.CUSTOMER_HELD, owner=job.owner))
        existing = Transaction.objects.filter(idempotency_key=key).first()
        if existing or job.status != job.Status.SUCCEEDED:
            return existing
        minimum = Quote.objects.filter(job=job).values_list("minimum_charge", flat=True).first() or 0
        charged = selectors.job_money(job=job)["charged"]
        amount = money.minimum_top_up(minimum=minimum, charged=charged,
                                      held=max(0, selectors.job_hold_remaining(job=job)))
        if amount <= 0:
            return None
        return ledger_post(
            key=key, kind=Transaction.Kind.MINIMUM_CHARGE, job=job,
            memo=(f"minimum charge per job {_fmt(minimum)}: the verified work of job {job.pk} cost {_fmt(charged)}, "
                  f"the platform keeps the difference"),
            lines=[(held, -amount), (account_for(kind=Kind.PLATFORM_FEE), amount)])


def hold_release(*, job) -> Transaction | None:
    """At the job's end (finished, failed or cancelled), what is left of its hold goes back to the customer, once
    a job that succeeded has paid its minimum charge."""
    with transaction.atomic():
        held = locked(account_for(kind=Kind.CUSTOMER_HELD, owner=job.owner))
        minimum_charge_settle(job=job)
        remaining = selectors.job_hold_remaining(job=job)
        if remaining <= 0:
            return None
        return ledger_post(
            key=f"release:job:{job.pk}", kind=Transaction.Kind.RELEASE, job=job,
            memo=f"unused hold of job {job.pk} ({job.status})",
            lines=[(held, -remaining), (account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=job.owner), remaining)],
        )


# --- Earnings: clearing, holds for review, forfeiture --------------------------------------------------
# A charge's contributor share waits in pending for the holding period, then clears to available. While staff
# review a quarantined device, the share of its unverified work is held for review (pending → held): held
# earnings never clear; a release (held → pending) lets them clear as usual, and only a forfeit, which staff
# decide, sends them (with the platform's fee) back to the customer. Every one of these follows its charge
# (`source`), so a charge's state is derived from its follow-ups.

PENDING, HELD, CLEARED, FORFEITED = "pending", "held", "cleared", "forfeited"
_SETTLED = (Transaction.Kind.CLEAR, Transaction.Kind.FORFEIT)


def _earnings_state(charge: Transaction) -> str:
    kinds = list(charge.followups.values_list("kind", flat=True))
    if Transaction.Kind.FORFEIT in kinds:
        return FORFEITED
    if Transaction.Kind.CLEAR in kinds:
        return CLEARED
    if kinds.count(Transaction.Kind.EARNINGS_HOLD) > kinds.count(Transaction.Kind.EARNINGS_RELEASE):
        return HELD
    return PENDING


def _share(charge: Transaction) -> tuple[Account | None, int]:
    """The contributor's pending account and share of a charge (None, 0 when the share was nothing)."""
    entry = charge.entries.filter(account__kind=Kind.CONTRIBUTOR_PENDING).select_related("account").first()
    return (entry.account, entry.amount) if entry is not None else (None, 0)


def _open_charges(units):
    """The charges for `units` whose earnings have neither cleared nor been forfeited."""
    return (Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit__in=units)
            .exclude(followups__kind__in=_SETTLED).order_by("id").values_list("id", flat=True))


def earnings_forfeit(*, unit, staff, reason: str) -> Transaction:
    """Work found fraudulent (staff decided, or a check confirmed it) before its earnings cleared: the
    contributor's share, pending or held for review, and the platform's fee for the unit go back to the
    customer's balance. Refused once the earnings have cleared (they may be paid)."""
    if not reason.strip():
        raise InvalidInput("Say why the work is forfeited.", code="reason_required")
    with transaction.atomic():
        charge = Transaction.objects.select_for_update().filter(kind=Transaction.Kind.CHARGE, unit=unit).first()
        if charge is None:
            raise NotFound(f"Unit {unit.pk} was never charged.")
        state = _earnings_state(charge)
        if state == FORFEITED:
            return charge.followups.get(kind=Transaction.Kind.FORFEIT)
        if state == CLEARED:
            raise Conflict(f"The earnings for unit {unit.pk} have already cleared; they can no longer be forfeited.",
                           code="already_cleared")
        lines = []
        for e in charge.entries.select_related("account").exclude(account__kind=Kind.CUSTOMER_HELD):
            account = e.account
            if state == HELD and account.kind == Kind.CONTRIBUTOR_PENDING:  # the share sits in held for now
                account = account_for(kind=Kind.CONTRIBUTOR_HELD, owner=account.owner)
            lines.append((account, -e.amount))
        refund = -sum(n for _, n in lines)
        return ledger_post(
            key=f"forfeit:charge:{charge.pk}", kind=Transaction.Kind.FORFEIT, source=charge, job=charge.job,
            unit=unit, flops=charge.flops, created_by=staff,
            memo=f"forfeited: work found fraudulent ({reason.strip()})",
            lines=[*lines, (account_for(kind=Kind.CUSTOMER_AVAILABLE, owner=charge.job.owner), refund)])


def earnings_hold_units(*, units, reason: str) -> list[Transaction]:
    """Hold the pending earnings of the charged units among `units` for review (a quarantined device's unverified
    work): they stay the contributor's but do not clear until staff release or forfeit them. Earnings that
    cleared stay paid, and held ones stay held: calling this again moves nothing. Returns the holds posted now."""
    holds = []
    for charge_id in list(_open_charges(units)):
        with transaction.atomic():
            charge = Transaction.objects.select_for_update().get(pk=charge_id)
            if _earnings_state(charge) != PENDING:
                continue
            pending, amount = _share(charge)
            lines = [] if pending is None else [
                (pending, -amount), (account_for(kind=Kind.CONTRIBUTOR_HELD, owner=pending.owner), amount)]
            # A charge may be held, released and held again (a second quarantine): one key per hold.
            n = charge.followups.filter(kind=Transaction.Kind.EARNINGS_HOLD).count()
            holds.append(ledger_post(
                key=f"earnings_hold:charge:{charge.pk}:{n}", kind=Transaction.Kind.EARNINGS_HOLD, source=charge,
                job=charge.job, unit=charge.unit, flops=charge.flops, lines=lines,
                memo=f"held for review: {reason.strip()}"))
    return holds


def _held_charges(units) -> list[Transaction]:
    return [charge for charge in Transaction.objects.filter(pk__in=list(_open_charges(units)))
            if _earnings_state(charge) == HELD]


def earnings_release_held(*, units, staff, reason: str = "") -> list[Transaction]:
    """Staff found nothing wrong (a quarantine lifted): the held earnings of `units` go back to pending and clear
    after their holding period as usual. Calling this again moves nothing. Returns the releases posted now."""
    releases = []
    for held in _held_charges(units):
        with transaction.atomic():
            charge = Transaction.objects.select_for_update().get(pk=held.pk)
            if _earnings_state(charge) != HELD:
                continue
            pending, amount = _share(charge)
            lines = [] if pending is None else [
                (account_for(kind=Kind.CONTRIBUTOR_HELD, owner=pending.owner), -amount), (pending, amount)]
            n = charge.followups.filter(kind=Transaction.Kind.EARNINGS_RELEASE).count()
            releases.append(ledger_post(
                key=f"earnings_release:charge:{charge.pk}:{n}", kind=Transaction.Kind.EARNINGS_RELEASE, source=charge,
                job=charge.job, unit=charge.unit, flops=charge.flops, lines=lines, created_by=staff,
                memo="released after review" + (f" ({reason.strip()})" if reason.strip() else "")))
    return releases


def earnings_forfeit_held(*, units, staff, reason: str) -> list[Transaction]:
    """Staff decided the held work was fraudulent: the held earnings of `units` go back to their customers
    (earnings_forfeit, unit by unit). Pending earnings that were never held are left alone."""
    if not reason.strip():
        raise InvalidInput("Say why the held earnings are forfeited.", code="reason_required")
    forfeits = []
    for held in _held_charges(units):
        with transaction.atomic():
            charge = Transaction.objects.select_for_update().get(pk=held.pk)
            if _earnings_state(charge) == HELD:  # not released meanwhile
                forfeits.append(earnings_forfeit(unit=charge.unit, staff=staff, reason=reason))
    return forfeits


def earnings_clear(*, now: datetime | None = None) -> int:
    """Pending earnings older than the holding period become available, charge by charge (until then, work
    found fraudulent can still be forfeited); earnings held for review wait for their release. Safe to run any
    number of times, from any number of processes. Returns how many charges were cleared."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.MUNINN_EARNINGS_HOLD_SECONDS)
    kind = Transaction.Kind
    due = (Transaction.objects.filter(kind=kind.CHARGE, created_at__lte=cutoff).exclude(followups__kind__in=_SETTLED)
           .annotate(holds=Count("followups", filter=Q(followups__kind=kind.EARNINGS_HOLD)),
                     releases=Count("followups", filter=Q(followups__kind=kind.EARNINGS_RELEASE)))
           .filter(holds__lte=F("releases")).values_list("id", flat=True))
    cleared = 0
    for charge_id in list(due):
        with transaction.atomic():
            charge = Transaction.objects.select_for_update().get(pk=charge_id)
            if _earnings_state(charge) != PENDING:
                continue
            pending, amount = _share(charge)
            lines = [] if pending is None else [
                (pending, -amount), (account_for(kind=Kind.CONTRIBUTOR_AVAILABLE, owner=pending.owner), amount)]
            ledger_post(key=f"clear:charge:{charge.pk}", kind=kind.CLEAR, source=charge, job=charge.job,
                        unit=charge.unit, flops=charge.flops, lines=lines,
                        memo=f"earnings cleared: job {charge.job_id} unit {charge.unit_id}")
            cleared += 1
    return cleared
