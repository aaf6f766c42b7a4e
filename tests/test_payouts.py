"""Contributor earnings: clearing after the holding period, Stripe Connect onboarding, payout requests, staff review
(approve → transfer, reject with a reason), failed and reversed transfers, all audited."""
from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from billing import money, payouts, services
from billing import selectors as ledger
from billing.models import Payout, PayoutAccount, PayoutAudit, Transaction
from billing.tasks import clear_earnings, retry_approved_payouts

from .conftest import cleared, post_webhook
from .fake_stripe import event

pytestmark = pytest.mark.django_db(transaction=True)


def balance(user, kind: str) -> int:
    return ledger.balances_for(user=user).get(kind, 0)


def test_earnings_become_available_only_after_the_holding_period(earned, settings):
    pending = balance(earned, "contributor_pending")
    assert pending > money.to_nanos("10")

    assert clear_earnings() == 0  # the beat task, now: still inside the holding period
    assert balance(earned, "contributor_available") == 0
    settings.MUNINN_EARNINGS_HOLD_SECONDS = 0
    assert clear_earnings() == 1
    assert clear_earnings() == 0  # once

    assert balance(earned, "contributor_available") == pending
    assert balance(earned, "contributor_pending") == 0
    assert settings.CELERY_BEAT_SCHEDULE["clear-earnings"]["task"] == "billing.tasks.clear_earnings"
    assert ledger.ledger_total() == 0


def test_statement_shows_job_round_and_unit(earned, contributor_api):
    statement = contributor_api.get("/api/balance").json()["statement"]
    charge = next(line for line in statement if line["kind"] == "charge")
    assert charge["job"] and charge["round"] == 1 and charge["unit"] and charge["account"] == "contributor_pending"


def test_onboarding_creates_one_express_account_and_returns_a_link(contributor_api, contributor, fake_stripe):
    first = contributor_api.post("/api/payouts/onboarding")
    second = contributor_api.post("/api/payouts/onboarding")

    assert first.status_code == 201 and first.json()["url"].startswith("https://connect.stripe.com/setup/")
    assert second.status_code == 201
    assert len(fake_stripe.calls("/v1/accounts")) == 1
    assert fake_stripe.calls("/v1/accounts")[0].params["type"] == "express"
    account = PayoutAccount.objects.get(contributor=contributor)
    assert not account.payouts_enabled

    updated = {"id": account.stripe_account_id, "object": "account", "details_submitted": True, "payouts_enabled": True}
    assert post_webhook(APIClient(), event("account.updated", updated)).status_code == 200
    assert PayoutAccount.objects.get(contributor=contributor).payouts_enabled


def request_payout(api, amount: str):
    return api.post("/api/payouts", {"amount": amount}, format="json")


def test_payout_above_the_available_earnings_is_refused_and_nothing_changes(ready, contributor_api):
    available = balance(ready, "contributor_available")
    txns = Transaction.objects.count()

    too_much = (Decimal(available) / money.NANOS_PER_UNIT + 1).quantize(Decimal("0.01"))

    response = request_payout(contributor_api, str(too_much))

    assert response.status_code == 402
    assert response.json()["error"]["code"] == "above_available"
    assert Transaction.objects.count() == txns and not Payout.objects.exists()


def test_payout_below_the_minimum_is_refused(ready, contributor_api):
    response = request_payout(contributor_api, "1.00")
    assert response.status_code == 400 and response.json()["error"]["code"] == "below_minimum"
    assert not Payout.objects.exists()


def test_payout_needs_a_finished_payout_account(earned, contributor_api):
    cleared(earned)
    response = request_payout(contributor_api, "10.00")
    assert response.status_code == 409 and response.json()["error"]["code"] == "payout_account_not_ready"


def test_approved_payout_is_transferred_once_and_audited(ready, contributor_api, staff, fake_stripe):
    available = balance(ready, "contributor_available")
    payout_id = request_payout(contributor_api, "10.00").json()["id"]
    assert balance(ready, "contributor_in_review") == money.to_nanos("10")

    payout = payouts.payout_approve(payout_id=payout_id, staff=staff, reason="receipts look fine")
    with pytest.raises(Exception) as second:
        payouts.payout_approve(payout_id=payout_id, staff=staff)

    assert payout.status == Payout.Status.PAID and payout.stripe_transfer_id.startswith("tr_")
    assert second.value.code == "already_decided"
    transfers = fake_stripe.calls("/v1/transfers")
    assert len(transfers) == 1
    assert transfers[0].params["amount"] == "1000" and transfers[0].params["destination"] == "acct_testready"
    assert transfers[0].headers["idempotency-key"] == f"payout-{payout_id}"
    assert balance(ready, "contributor_paid_out") == money.to_nanos("10")
    assert balance(ready, "contributor_available") == available - money.to_nanos("10")
    audit = list(PayoutAudit.objects.filter(payout_id=payout_id).values_list("action", "actor", "reason"))
    assert audit[:2] == [("requested", ready.pk, ""), ("approved", staff.pk, "receipts look fine")]
    assert audit[2][0] == "transferred"
    assert ledger.ledger_total() == 0


def test_rejected_payout_returns_the_money_and_keeps_the_reason(ready, contributor_api, staff, fake_stripe):
    available = balance(ready, "contributor_available")
    payout_id = request_payout(contributor_api, "10.00").json()["id"]

    with pytest.raises(Exception) as no_reason:
        payouts.payout_reject(payout_id=payout_id, staff=staff, reason=" ")
    payout = payouts.payout_reject(payout_id=payout_id, staff=staff, reason="device 3 failed re-execution")

    assert no_reason.value.code == "reason_required"
    assert payout.status == Payout.Status.REJECTED and payout.reviewed_by == staff and payout.reviewed_at
    assert balance(ready, "contributor_available") == available
    assert not fake_stripe.calls("/v1/transfers")
    assert PayoutAudit.objects.filter(payout=payout, action="rejected", actor=staff,
                                      reason="device 3 failed re-execution").exists()
    assert contributor_api.get("/api/payouts").json()[0]["reason"] == "device 3 failed re-execution"


def test_failed_transfer_returns_the_money_to_available(ready, contributor_api, staff, fake_stripe):
    available = balance(ready, "contributor_available")
    fake_stripe.failing_destinations.add("acct_testready")
    payout_id = request_payout(contributor_api, "10.00").json()["id"]

    payout = payouts.payout_approve(payout_id=payout_id, staff=staff)

    assert payout.status == Payout.Status.FAILED and "cannot receive transfers" in payout.failure
    assert balance(ready, "contributor_available") == available
    assert balance(ready, "contributor_paid_out") == 0 and balance(ready, "contributor_in_review") == 0


def test_reversed_transfer_returns_the_money_to_available(ready, contributor_api, staff, fake_stripe):
    available = balance(ready, "contributor_available")
    payout = payouts.payout_approve(payout_id=request_payout(contributor_api, "10.00").json()["id"], staff=staff)
    reversed_transfer = {"id": payout.stripe_transfer_id, "object": "transfer", "amount": 1000, "reversed": True}

    response = post_webhook(APIClient(), event("transfer.reversed", reversed_transfer))

    assert response.status_code == 200 and response.json()["status"] == "processed"
    assert Payout.objects.get(pk=payout.pk).status == Payout.Status.REVERSED
    assert balance(ready, "contributor_available") == available and balance(ready, "contributor_paid_out") == 0


def test_a_payout_approved_but_never_transferred_is_transferred_by_the_beat_task(ready, contributor_api, staff,
                                                                               fake_stripe):
    payout_id = request_payout(contributor_api, "10.00").json()["id"]
    # The process died between approving and transferring: approved a while ago, no transfer.
    Payout.objects.filter(pk=payout_id).update(status=Payout.Status.APPROVED, reviewed_by=staff,
                                               reviewed_at=timezone.now() - timedelta(minutes=10))

    assert retry_approved_payouts() == 1
    assert retry_approved_payouts() == 0

    assert Payout.objects.get(pk=payout_id).status == Payout.Status.PAID
    assert len(fake_stripe.calls("/v1/transfers")) == 1
    assert balance(ready, "contributor_paid_out") == money.to_nanos("10")


def test_staff_review_the_evidence_in_the_admin_and_approve(ready, contributor_api, staff, fake_stripe):
    payout_id = request_payout(contributor_api, "10.00").json()["id"]
    browser = Client()
    browser.force_login(staff)

    page = browser.get(f"/admin/billing/payout/{payout_id}/review/")
    approve = browser.post(f"/admin/billing/payout/{payout_id}/review/", {"decision": "approve", "reason": "ok"})

    assert page.status_code == 200
    html = page.content.decode()
    for evidence in ("Devices", "device", "Units behind the earnings", "accepted", "Earlier payouts", "Audit"):
        assert evidence in html
    assert approve.status_code == 302
    assert Payout.objects.get(pk=payout_id).status == Payout.Status.PAID
    assert browser.get("/admin/billing/payout/").status_code == 200


def test_work_found_fraudulent_before_clearing_is_forfeited_and_refunded(earned, customer, staff):
    charge = Transaction.objects.get(kind=Transaction.Kind.CHARGE)
    customer_before = balance(customer, "customer_available")
    browser = Client()
    browser.force_login(staff)
    under_review = Payout.objects.create(contributor=earned, amount=0, currency="EUR")  # the page the form is on
    payout_page = f"/admin/billing/payout/{under_review.pk}/review/"

    response = browser.post(payout_page, {"decision": "forfeit", "unit": charge.unit_id, "reason": "replayed weights"})
    again = services.earnings_forfeit(unit=charge.unit, staff=staff, reason="replayed weights")

    assert response.status_code == 302
    forfeit = Transaction.objects.get(kind=Transaction.Kind.FORFEIT)
    assert again == forfeit and forfeit.created_by == staff and "replayed weights" in forfeit.memo
    assert balance(earned, "contributor_pending") == 0
    assert balance(customer, "customer_available") == customer_before + -sum(
        e.amount for e in charge.entries.all() if e.account.kind == "customer_held")
    assert cleared(earned) == 0  # nothing left to clear
    assert ledger.ledger_total() == 0


def test_cleared_earnings_can_no_longer_be_forfeited(earned, staff):
    cleared(earned)
    charge = Transaction.objects.get(kind=Transaction.Kind.CHARGE)

    with pytest.raises(Exception) as refused:
        services.earnings_forfeit(unit=charge.unit, staff=staff, reason="too late")

    assert refused.value.code == "already_cleared"
    assert not Transaction.objects.filter(kind=Transaction.Kind.FORFEIT).exists()
