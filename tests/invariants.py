"""What must hold of the books whatever happened: shared by the property-based ledger tests, the in-process spine,
and the end-to-end and fault suites with real processes."""
from __future__ import annotations

from django.db.models import Sum

from billing import money
from billing import selectors as ledger
from billing.models import Entry, Transaction
from contributors.models import Receipt
from jobs.models import Job, WorkUnit


def assert_books_balance() -> None:
    """Every transaction's entries sum to zero (so the whole ledger does)."""
    assert ledger.ledger_total() == 0
    unbalanced = Entry.objects.values("transaction").annotate(s=Sum("amount")).exclude(s=0)
    assert not unbalanced.exists(), list(unbalanced)


def assert_no_negative_balance() -> None:
    negative = {k: v for k, v in ledger.user_balances().items() if v < 0}
    assert not negative, negative


def assert_job_within_quote(job: Job) -> None:
    """Never charged more than quoted; charged exactly the verified work's share of the quoted work's price (by
    FLOPs), and, once a job succeeded, topped up to the minimum charge per job (only then, and only to it)."""
    m, quote = ledger.job_money(job=job), job.quote
    assert m["quoted"] == quote.price == max(quote.work_price, quote.minimum_charge)
    assert 0 <= m["charged"] <= quote.price, m
    assert m["flops_charged"] <= quote.flops
    work = money.price_share(quote.work_price, quote.flops, m["flops_charged"])
    assert m["charged"] == work + m["minimum"], m
    if job.status == Job.Status.SUCCEEDED and job.is_ended and m["held"] == 0:
        assert m["minimum"] == max(0, quote.minimum_charge - work), m
        assert m["charged"] == max(work, quote.minimum_charge), m
    else:
        assert m["minimum"] == 0, m
    assert m["held"] >= 0
    if job.is_ended:
        assert m["held"] == 0, m


def assert_units_credited_once(jobs) -> None:
    """One charge per accepted unit, each for exactly one accepted receipt; rejected or unfinished work costs
    nothing. `jobs`: a queryset of jobs."""
    charges = Transaction.objects.filter(kind=Transaction.Kind.CHARGE, job__in=jobs)
    for charge in charges.select_related("unit"):
        receipts = Receipt.objects.filter(unit=charge.unit, status=Receipt.Status.ACCEPTED)
        assert receipts.count() == 1, f"unit {charge.unit_id}: {receipts.count()} accepted receipts"
        assert charge.flops == charge.unit.flops
    charged_units = list(charges.values_list("unit_id", flat=True))
    assert len(charged_units) == len(set(charged_units)), "a unit was charged twice"
    accepted = WorkUnit.objects.filter(round__job__in=jobs, status=WorkUnit.Status.ACCEPTED)
    # An accepted result is charged moments after its answer (contributors.credit), and always before its job ends.
    owed = Receipt.objects.filter(unit__round__job__in=jobs, status=Receipt.Status.ACCEPTED, credit_pending=True)
    assert not owed.filter(unit__round__job__status__in=Job.ENDED).exists()
    assert set(charged_units) == set(accepted.values_list("id", flat=True)) - set(owed.values_list("unit_id", flat=True))


def assert_ledger_invariants(job: Job) -> None:
    """All of the above, for one job."""
    assert_books_balance()
    assert_no_negative_balance()
    assert_job_within_quote(job)
    assert_units_credited_once(Job.objects.filter(pk=job.pk))
