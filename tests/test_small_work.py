"""Small work still pays: a tiny job that succeeds costs the minimum charge per job (the difference above its work
goes to the platform), its units share the work's price by their FLOPs, and every verified unit earns its
contributor a non-zero, exact amount, the same with or without the minimum."""
from __future__ import annotations

from decimal import Decimal

import pytest

from billing import money
from billing import selectors as ledger
from billing.models import Account, Entry, Transaction

from . import invariants
from .test_spine import create_job, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)


def contributor_shares(job) -> list[int]:
    return list(Entry.objects.filter(transaction__job=job, transaction__kind=Transaction.Kind.CHARGE,
                                     account__kind=Account.Kind.CONTRIBUTOR_PENDING)
                .order_by("id").values_list("amount", flat=True))


def units_trained(job) -> int:
    """Units the job's rounds aggregated: round 1 gives both devices a shard; later shards are sized by the speeds
    measured on real units, so a device the clock found far slower (a loaded machine) may get none."""
    return sum(r.metrics["units"] for r in job.round_set.all())


def _from_hold(charge: Transaction) -> int:
    """What a charge took from the customer's hold. A unit's share of a price of a few nanos can round to 0 (shards
    are sized by the devices' measured speed, so which unit gets the rounding depends on the clock): a 0 line is
    not written, and the platform alone pays that unit's least earning."""
    return -sum(e.amount for e in charge.entries.filter(account__kind=Account.Kind.CUSTOMER_HELD))


def test_a_tiny_job_pays_the_minimum_charge_and_its_contributor_only_for_the_work(
        customer_api, digits_dataset, make_device, contributor, settings):
    settings.MUNINN_MIN_CHARGE_PER_JOB = Decimal("0.50")
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, digits_dataset["id"], rounds=2)
    assert job["flops_estimated"] * settings.MUNINN_PRICE_PER_HU < money.FLOPS_PER_HU // 100  # far below a cent

    done = run_until_done(devices, job["id"])

    invariants.assert_ledger_invariants(done)
    quote, paid = done.quote, ledger.job_money(job=done)
    assert quote.price == quote.minimum_charge == money.to_nanos("0.50") > quote.work_price > 0
    assert paid["quoted"] == paid["charged"] == money.to_nanos("0.50")  # the minimum, charged to the nano
    charges = Transaction.objects.filter(job=done, kind=Transaction.Kind.CHARGE)
    work = sum(_from_hold(c) for c in charges)
    assert work == quote.work_price  # the units shared the work's price, not the minimum
    least = money.to_nanos(settings.MUNINN_MIN_EARNING_PER_UNIT)
    shares = contributor_shares(done)
    assert len(shares) == charges.count() == units_trained(done)
    for charge, share in zip(charges.order_by("id"), shares):  # what the work earns, as if there were no minimum
        amount = _from_hold(charge)
        assert share == max(money.split_charge(amount, settings.MUNINN_CONTRIBUTOR_SHARE)[0], least)
    minimum = Transaction.objects.get(job=done, kind=Transaction.Kind.MINIMUM_CHARGE)
    assert sorted((e.account.kind, e.amount) for e in minimum.entries.all()) == sorted(
        [(Account.Kind.CUSTOMER_HELD, -(money.to_nanos("0.50") - work)),
         (Account.Kind.PLATFORM_FEE, money.to_nanos("0.50") - work)])
    assert ledger.balances_for(user=contributor)["contributor_pending"] == sum(shares)
    assert money.format_money(shares[0], exact=True) != "€0.00"
    statement = customer_api.get("/api/balance").json()["statement"]  # the statement shows the line, exactly
    assert [(line["amount"]["nanos"], line["amount"]["exact"]) for line in statement
            if line["kind"] == "minimum_charge"] == [(-(money.to_nanos("0.50") - work),
                                                      money.format_money(-(money.to_nanos("0.50") - work), exact=True))]


def test_a_unit_whose_share_is_below_the_least_a_unit_earns_is_topped_up_by_the_platform(
        customer_api, digits_dataset, make_device, contributor, settings):
    settings.MUNINN_MIN_CHARGE_PER_JOB = Decimal("0.01")
    settings.MUNINN_MIN_EARNING_PER_UNIT = Decimal("0.005")  # more than a unit's 70 % of a quarter of €0.01
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, digits_dataset["id"], rounds=2)

    done = run_until_done(devices, job["id"])

    invariants.assert_ledger_invariants(done)  # the customer still pays exactly the quote, never more
    assert ledger.job_money(job=done)["charged"] == money.to_nanos("0.01")
    units = units_trained(done)  # 2 in round 1; round 2 may give a device the clock found far slower none
    assert units in (3, 4)
    assert contributor_shares(done) == [money.to_nanos("0.005")] * units
    fees = Entry.objects.filter(transaction__job=done, account__kind=Account.Kind.PLATFORM_FEE)
    assert sum(fees.values_list("amount", flat=True)) == money.to_nanos("0.01") - units * money.to_nanos("0.005")
