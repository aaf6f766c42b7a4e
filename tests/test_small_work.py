"""Small work still pays: a tiny job costs at least the minimum charge per job, its units share that price by
their FLOPs, and every verified unit earns its contributor a non-zero, exact amount."""
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


def test_a_tiny_job_pays_its_contributor_a_non_zero_exact_amount(customer_api, digits_dataset, make_device,
                                                                 contributor, settings):
    settings.MUNINN_MIN_CHARGE_PER_JOB = Decimal("0.01")
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, digits_dataset["id"], rounds=2)
    assert job["flops_estimated"] * settings.MUNINN_PRICE_PER_HU < money.FLOPS_PER_HU // 100  # far below a cent

    done = run_until_done(devices, job["id"])

    invariants.assert_ledger_invariants(done)
    paid = ledger.job_money(job=done)
    assert paid["quoted"] == paid["charged"] == money.to_nanos("0.01")  # the minimum, charged to the nano
    charges = Transaction.objects.filter(job=done, kind=Transaction.Kind.CHARGE)
    shares = contributor_shares(done)
    assert len(shares) == charges.count() == 4 and all(share > 0 for share in shares)
    for charge in charges:  # each unit: its FLOPs' share of the price, split exactly between contributor and fee
        amount = -charge.entries.get(account__kind=Account.Kind.CUSTOMER_HELD).amount
        assert amount > 0
        assert (charge.entries.get(account__kind=Account.Kind.CONTRIBUTOR_PENDING).amount
                == money.split_charge(amount, settings.MUNINN_CONTRIBUTOR_SHARE)[0])
    assert ledger.balances_for(user=contributor)["contributor_pending"] == sum(shares)
    # 70 % of the cent, plus at most a nano per unit: each split rounds the platform's fee down
    assert money.to_nanos("0.007") <= sum(shares) <= money.to_nanos("0.007") + len(shares)
    assert money.format_money(shares[0]) != "€0.00"


def test_a_unit_whose_share_is_below_the_least_a_unit_earns_is_topped_up_by_the_platform(
        customer_api, digits_dataset, make_device, contributor, settings):
    settings.MUNINN_MIN_CHARGE_PER_JOB = Decimal("0.01")
    settings.MUNINN_MIN_EARNING_PER_UNIT = Decimal("0.005")  # more than a unit's 70 % of a quarter of €0.01
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, digits_dataset["id"], rounds=2)

    done = run_until_done(devices, job["id"])

    invariants.assert_ledger_invariants(done)  # the customer still pays exactly the quote, never more
    assert ledger.job_money(job=done)["charged"] == money.to_nanos("0.01")
    assert contributor_shares(done) == [money.to_nanos("0.005")] * 4
    fees = Entry.objects.filter(transaction__job=done, account__kind=Account.Kind.PLATFORM_FEE)
    assert sum(fees.values_list("amount", flat=True)) == money.to_nanos("0.01") - 4 * money.to_nanos("0.005")
