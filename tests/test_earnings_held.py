"""Earnings are forfeited only for proven fraud. A confirmed failure holds the earnings of the device's unverified
work for review (not forfeited), and so does a quarantine; its verified work keeps its earnings; staff releasing
them (or lifting the quarantine) gives back what was held, and only staff deciding it was fraud forfeits it, back
to the customers."""
from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client

from billing import money
from billing import selectors as ledger
from billing import services as billing
from billing.models import Transaction
from contributors import reputation
from contributors import services as contributors
from contributors.models import Device, DeviceEvent, Receipt
from contributors.selectors import receipt_was_checked
from jobs.models import WorkUnit
from muninn import ui

from .conftest import cleared, digits_npz, named_file
from .test_spine import create_job, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)
HELD, PENDING, AVAILABLE = "contributor_held", "contributor_pending", "contributor_available"


def balance(user, kind: str) -> int:
    return ledger.balances_for(user=user).get(kind, 0)


def share(unit_ids) -> int:
    """What the contributor earned for these units (their charges' pending entries)."""
    return sum(e.amount for charge in Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id__in=unit_ids)
               for e in charge.entries.all() if e.account.kind == PENDING)


def charged(unit_ids) -> int:
    """What the customers paid for these units (the contributor's share and the platform's fee)."""
    return -sum(e.amount for charge in Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id__in=unit_ids)
                for e in charge.entries.all() if e.account.kind == "customer_held")


class Worked:
    def __init__(self, device, verified: list[int], unverified: list[int]):
        self.device, self.verified, self.unverified = device, verified, unverified


@pytest.fixture
def worked(settings, staff, customer, customer_api, make_device) -> Worked:
    """One device's real work on three jobs: the first unit re-executed (a new device's always is), so verified;
    then, trusted (re-executed 5% of the time on a site whose operator lowered the check floor), units of two more
    jobs accepted mostly without any check."""
    settings.MUNINN_MIN_CHECK_RATE = reputation.ADAPTIVE_MIN_RATE
    settings.MUNINN_PRICE_PER_HU = Decimal(10**11)  # tens of euros of earnings
    billing.balance_grant(user=customer, amount=money.to_nanos("1000"), reason="test", granted_by=staff)
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(200), "digits.npz")},
                                format="multipart").json()["id"]
    device = make_device("honest")
    run_until_done([device], create_job(customer_api, dataset, rounds=1)["id"])
    Device.objects.filter(pk=device.device.pk).update(verified_streak=10_000)
    for rounds, hidden in ((2, [16]), (3, [24])):  # other models: the same seed must not give the same weights
        run_until_done([device], create_job(customer_api, dataset, rounds=rounds, hidden=hidden)["id"])
    receipts = list(Receipt.objects.filter(device=device.device, status=Receipt.Status.ACCEPTED).order_by("id"))
    verified = [r.unit_id for r in receipts if receipt_was_checked(r)]
    unverified = [r.unit_id for r in receipts if not receipt_was_checked(r)]
    assert receipts[0].unit_id in verified and unverified  # (all 5 re-executed at 5%: about once in 3 million)
    return Worked(device, verified, unverified)


def quarantine(device) -> None:
    for _ in range(3):  # three failed results, as results.py and verification.py record them
        contributors.device_record_failure(device=device.device, reason="reexecution_mismatch: test")
    assert Device.objects.get(pk=device.device.pk).quarantined_at is not None


def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def test_quarantine_holds_unverified_earnings_and_leaves_verified_ones_pending(worked, contributor, staff):
    before = balance(contributor, PENDING)
    assert before == share(worked.verified + worked.unverified)

    quarantine(worked.device)

    assert balance(contributor, HELD) == share(worked.unverified)
    assert balance(contributor, PENDING) == share(worked.verified)
    holds = Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_HOLD)
    assert sorted(holds.values_list("unit_id", flat=True)) == sorted(worked.unverified)
    assert not Transaction.objects.filter(kind=Transaction.Kind.FORFEIT).exists()
    memos = [e.transaction.memo for e in ledger.statement_for(user=contributor)]
    assert all(m.startswith(f"held for review: device {worked.device.device.pk}: a failure confirmed")
               for m in holds.values_list("memo", flat=True))
    assert not any("fraudulent" in m for m in memos)
    assert DeviceEvent.objects.filter(device=worked.device.device, kind=DeviceEvent.Kind.EARNINGS_HELD).count() == 1
    assert ledger.ledger_total() == 0


def test_the_pages_show_what_is_held_for_review(worked, contributor, staff):
    quarantine(worked.device)
    held = ui.money(share(worked.unverified))  # to the cent, exactly on hover
    contributor_client = Client()
    contributor_client.force_login(contributor)

    contribute = contributor_client.get("/contribute/").content.decode()
    statement = contributor_client.get("/balance/").content.decode()
    staff_page = staff_client(staff).get("/staff/").content.decode()

    assert f'data-earnings="held for review">{held}<' in contribute
    assert 'data-earnings="payout in review"' in contribute  # the other review, named apart
    assert f"Earnings held for review: {held}" in contribute
    assert "Contributor earnings held for review" in statement and "held for review: device" in statement
    assert f'data-held="{worked.device.device.pk}">{held}<' in staff_page and "Forfeit held earnings" in staff_page


def test_held_earnings_do_not_clear_until_the_quarantine_is_lifted_then_they_clear(worked, contributor, staff):
    quarantine(worked.device)

    assert cleared(contributor) == share(worked.verified)  # past the holding period: only the verified clear
    assert balance(contributor, HELD) == share(worked.unverified)

    page = staff_client(staff).post(f"/staff/devices/{worked.device.device.pk}/lift", {"reason": "owner's GPU fixed"})
    assert page.status_code == 302
    assert balance(contributor, HELD) == 0
    assert balance(contributor, PENDING) == share(worked.unverified)
    releases = Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_RELEASE)
    assert releases.count() == len(worked.unverified)
    assert all(t.memo.startswith("released after review") and t.created_by == staff for t in releases)
    assert DeviceEvent.objects.get(device=worked.device.device, kind=DeviceEvent.Kind.RELEASED).actor == staff

    assert cleared(contributor) == share(worked.verified + worked.unverified)  # now they clear as usual
    assert balance(contributor, PENDING) == 0 and balance(contributor, HELD) == 0
    assert not Transaction.objects.filter(kind=Transaction.Kind.FORFEIT).exists()
    assert ledger.ledger_total() == 0


def test_staff_forfeit_of_held_earnings_refunds_the_customers_and_only_then_says_fraudulent(
        worked, contributor, customer, staff):
    quarantine(worked.device)
    customer_before = balance(customer, "customer_available")
    client = staff_client(staff)
    url = f"/staff/devices/{worked.device.device.pk}/forfeit-held"

    no_reason = client.post(url, {"reason": " "}, follow=True).content.decode()
    assert "Say why the held earnings are forfeited" in no_reason
    assert not Transaction.objects.filter(kind=Transaction.Kind.FORFEIT).exists()
    assert not any("fraudulent" in e.transaction.memo for e in ledger.statement_for(user=contributor))

    client.post(url, {"reason": "weights copied from another device"})

    forfeits = Transaction.objects.filter(kind=Transaction.Kind.FORFEIT)
    assert sorted(forfeits.values_list("unit_id", flat=True)) == sorted(worked.unverified)
    assert all(t.created_by == staff for t in forfeits)
    assert balance(contributor, HELD) == 0
    assert balance(customer, "customer_available") == customer_before + charged(worked.unverified)
    fraud = [e.transaction.memo for e in ledger.statement_for(user=contributor) if "fraudulent" in e.transaction.memo]
    assert fraud and set(fraud) == {"forfeited: work found fraudulent (weights copied from another device)"}
    event = DeviceEvent.objects.get(device=worked.device.device, kind=DeviceEvent.Kind.FORFEITED)
    assert event.actor == staff and "weights copied from another device" in event.reason
    # The verified work was never in question; lifting now has nothing left to release.
    contributors.device_lift_quarantine(device=worked.device.device, staff=staff, reason="owner warned")
    assert not Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_RELEASE).exists()
    assert cleared(contributor) == share(worked.verified)
    assert ledger.ledger_total() == 0


def test_holding_and_releasing_twice_moves_money_once(worked, contributor, staff):
    units = WorkUnit.objects.filter(pk__in=worked.unverified)
    quarantine(worked.device)
    held = balance(contributor, HELD)

    assert billing.earnings_hold_units(units=units, reason="again") == []
    assert balance(contributor, HELD) == held
    contributors.device_lift_quarantine(device=worked.device.device, staff=staff, reason="reviewed")
    assert billing.earnings_release_held(units=units, staff=staff, reason="again") == []
    assert balance(contributor, HELD) == 0
    assert balance(contributor, PENDING) == share(worked.verified + worked.unverified)
    for kind in (Transaction.Kind.EARNINGS_HOLD, Transaction.Kind.EARNINGS_RELEASE):
        assert Transaction.objects.filter(kind=kind).count() == len(worked.unverified)

    quarantine(worked.device)  # quarantined again after the lift: the same work is held again, once

    assert balance(contributor, HELD) == held
    assert Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_HOLD).count() == 2 * len(worked.unverified)
    assert ledger.ledger_total() == 0


def test_earnings_cleared_before_the_quarantine_stay_available(worked, contributor):
    available = cleared(contributor)

    quarantine(worked.device)

    assert balance(contributor, AVAILABLE) == available == share(worked.verified + worked.unverified)
    assert balance(contributor, HELD) == 0
    assert not Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_HOLD).exists()


@pytest.mark.parametrize("verification, checked", [
    ({}, False),
    ({"reexecute": {"rate": 1.0, "chosen": True}}, False),  # chosen for a check that has no result yet
    ({"reexecution": {"distance": 1e-8, "tolerance": 1e-3}}, True),  # legacy: within its tolerance
    ({"reexecution": {"distance": 0.2, "tolerance": 1e-3}}, False),
    ({"reexecution": {"distance": 0.0, "tolerance": 1e-3, "passed": False}}, False),
    ({"reexecution": {"passed": True}}, True),
    ({"segment_check": {"passed": True, "segments": [3]}}, True),
    ({"segment_check": {"passed": False}}, False),
])
def test_a_receipt_counts_as_checked_only_when_a_validator_passed_it(verification, checked):
    assert receipt_was_checked(Receipt(verification=verification)) is checked


def test_a_unit_held_for_review_can_be_forfeited_one_by_one(worked, contributor, customer, staff):
    quarantine(worked.device)
    unit = WorkUnit.objects.get(pk=worked.unverified[0])
    customer_before = balance(customer, "customer_available")

    billing.earnings_forfeit(unit=unit, staff=staff, reason="replayed weights")  # the payout review page's form

    assert balance(contributor, HELD) == share(worked.unverified[1:])
    assert balance(customer, "customer_available") == customer_before + charged([unit.pk])
    assert ledger.ledger_total() == 0


def test_a_first_confirmed_failure_holds_unverified_earnings_without_quarantining(worked, contributor, staff):
    contributors.device_record_failure(device=worked.device.device, reason="reexecution_mismatch: test",
                                       unit_id=worked.unverified[0])

    device = Device.objects.get(pk=worked.device.device.pk)
    assert device.quarantined_at is None and device.verified_streak == 0
    assert balance(contributor, HELD) == share(worked.unverified)
    assert balance(contributor, PENDING) == share(worked.verified)
    memo = Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_HOLD).values_list("memo", flat=True).first()
    assert memo == (f"held for review: device {device.pk}: a failure confirmed on unit {worked.unverified[0]}: "
                    "reexecution_mismatch: test")
    staff_page = staff_client(staff).get("/staff/").content.decode()
    held = ui.money(share(worked.unverified))  # to the cent, exactly on hover
    assert f'data-held="{device.pk}">{held}<' in staff_page and "Release held earnings" in staff_page
    assert ledger.ledger_total() == 0


def test_staff_release_what_a_device_not_quarantined_holds_and_it_clears_as_usual(worked, contributor, staff):
    contributors.device_record_failure(device=worked.device.device, reason="challenge_unanswered: test",
                                       unit_id=worked.unverified[0])
    client = staff_client(staff)
    url = f"/staff/devices/{worked.device.device.pk}/release-held"

    no_reason = client.post(url, {"reason": ""}, follow=True).content.decode()
    assert "Say why the held earnings are released" in no_reason and balance(contributor, HELD) > 0
    client.post(url, {"reason": "the owner's machine was off during the challenge"})

    assert balance(contributor, HELD) == 0
    assert cleared(contributor) == share(worked.verified + worked.unverified)
    event = DeviceEvent.objects.get(device=worked.device.device, kind=DeviceEvent.Kind.RELEASED)
    assert event.actor == staff and "machine was off" in event.reason
    again = client.post(url, {"reason": "twice"}, follow=True).content.decode()
    assert "no earnings held for review" in again
    assert DeviceEvent.objects.filter(kind=DeviceEvent.Kind.RELEASED).count() == 1
    assert ledger.ledger_total() == 0


def test_a_quarantined_device_is_released_by_lifting_not_by_the_release_form(worked, contributor, staff):
    quarantine(worked.device)

    page = staff_client(staff).post(f"/staff/devices/{worked.device.device.pk}/release-held",
                                    {"reason": "looks fine"}, follow=True).content.decode()

    assert "lifting the quarantine releases its held earnings" in page
    assert balance(contributor, HELD) == share(worked.unverified)
    assert not Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_RELEASE).exists()
